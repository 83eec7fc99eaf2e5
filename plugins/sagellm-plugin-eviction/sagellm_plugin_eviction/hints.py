"""Hint-aware eviction: what the client says of its KV (``Request.kv_hints``)
decides first, a robust policy (``fallback``) the rest.

The application knows what the server cannot: whether a conversation
continues, which prefix its agents share, when a tool call will be back
(docs/benchmarks/hints.md). The hints, as this policy takes them:

* **pin** (the prompt's first ``pin`` tokens): the prefix's blocks are never
  evicted until a request of the same tenant unpins it (``unpin``, the same
  number of tokens) or ``pin_ttl_s`` passes after the last request that
  pinned it ended. A tenant pins at most ``pin_share`` of the pool, and all
  tenants together at most half of it: a pin beyond either is refused whole
  (counted in ``pins_refused``), so pins never take the room running
  requests need. Pins are of content (the blocks' chained keys), so a prefix
  evicted before it was pinned is pinned again once it is cached.
* **retain_s**: the blocks the request leaves, and their prefix, stay until
  ``retain_s`` after it ended, behind every block no hint protects; when
  nothing else is left, the retention that ends soonest gives way first
  (advice, not a guarantee: SGLang's and vLLM's hint proposals say the same).
* **release**: the conversation is over; the blocks only it used (not a
  shared system prompt or document: a block another conversation used is
  shared from then on) are evicted before any other, oldest release first.
  The conversation is the hint's ``cache_key``, else the request's session.
  A tenant's releases are followed only while following them has paid
  (:class:`ReleaseOutcomes`): following a release evicts a released block
  instead of the fallback's victim, so it pays while the blocks the tenant
  releases come back no more often than the blocks the fallback evicts,
  both counted within ``release_window`` pool sizes of evictions. Counted
  on every release, followed or not, so a tenant whose hints turn right is
  followed again; asked when the releasing request finishes and again at
  every victim choice, so the released blocks of a tenant that stops being
  followed go back to the fallback's order.
* Everything else (no hint, or a protection ended) is the fallback's: the
  fallback observes every block event but the protected blocks' releases,
  and chooses among what is left. With no hints at all, this policy is its
  fallback exactly.

On :class:`~sagellm_core.kit.eviction.PriorityEviction`: its own order is
the released conversations' blocks (release order, leaves first). Cost: per
released block a few dict operations, and from the first release on a few
per block used or evicted (the release judge's watch); a pin hashes the pinned prompt pages
that are not cached yet (SHA-256, as the prefix cache keys them) and, from
the first pin on, every cached block's key is read; choosing k victims is
the fallback's choice plus O(k) from the released queue.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable, Iterator

import attrs
from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.kit.eviction import PriorityEviction
from sagellm_core.types import (
    ROOT_KEY,
    CachedBlock,
    EvictionCandidates,
    EvictionDecision,
    PrefixMatch,
    Request,
    RequestOutcome,
    chain_key,
)

from .adaptive import EXPERTS, AdaptiveEviction, ShadowCache, _Expert, expert_spec

#: What may decide where no hint does: an expert of ``adaptive``, or it.
FALLBACKS: dict[str, type] = {**EXPERTS, "adaptive": AdaptiveEviction}
#: The share of the pool all tenants' pins may hold together.
MAX_PINNED_SHARE = 0.5
#: The advice's judge: hits counted with a half-life of this many cache
#: sizes of blocks requested, and a side leads once ahead by this share.
HALF_LIFE = 2.0
MARGIN = 0.01


def _known_fallback(instance: object, attribute: object, value: str) -> None:
    if expert_spec(value)[0] not in FALLBACKS:
        raise ValueError(f"fallback = {value!r}: one of {', '.join(FALLBACKS)} (with settings as NAME:KEY=VALUE)")


@frozen
class HintSettings:
    #: The policy for the blocks no hint speaks of, ``NAME`` or
    #: ``NAME:KEY=VALUE,...``: ``revisit``, ``lru``, ``adaptive`` or another
    #: expert (``revisit`` chosen over ``lru`` on the policy suite's tune
    #: part: docs/benchmarks/hints.md).
    fallback: str = field(default="revisit", validator=[validators.instance_of(str), _known_fallback])
    #: The share of the pool each tenant may hold pinned (at most 0.5).
    pin_share: float = field(
        default=0.25, converter=float, validator=[validators.ge(0), validators.le(MAX_PINNED_SHARE)]
    )
    #: A pin ends this long after the last request that pinned its prefix ended.
    pin_ttl_s: float = field(default=3600.0, converter=float, validator=validators.gt(0))
    #: Follow ``release`` and ``retain_s`` only while a shadow cache that
    #: follows them hits at least as much as one that does not (wrong hints
    #: then cost little); false: always follow them.
    judged: bool = field(default=True, validator=validators.instance_of(bool))
    #: Follow a tenant's ``release`` only while its released blocks come
    #: back (are used again) within this many pool sizes of evictions at
    #: most as often as the blocks the fallback evicts do; 0: always.
    #: (Chosen on the policy suite's tune part among 0.5, 1 and 2.)
    release_window: float = field(default=1.0, converter=float, validator=validators.ge(0))


class _Tally:
    """Blocks that came back and blocks that did not, each count halved every
    ``half_life`` evictions."""

    __slots__ = ("back", "gone", "at")

    def __init__(self) -> None:
        self.back = self.gone = 0.0
        self.at = 0  # the eviction count the figures are decayed to

    def decay(self, now: int, per_eviction: float) -> None:
        if now != self.at:
            factor = per_eviction ** (now - self.at)
            self.back, self.gone, self.at = self.back * factor, self.gone * factor, now


class ReleaseOutcomes:
    """Whether following each tenant's releases pays, from what happened.

    Following a release evicts a released block where the fallback would
    have evicted its own victim: it costs a hit when the released block is
    used again after following the release evicted it but before the
    fallback would have, and it earns one when the victim spared is used
    again. So each block a tenant releases (followed or not) is watched for
    ``window`` evictions (the fallback keeps an evictable block at most a
    pool size of them). Used again within them, it came back at a cost if
    following the release evicted it (it is cached again) or, where the
    release was not followed, would have by then (more blocks evicted since
    than stood before it in the released order); used again sooner, it
    cost nothing and counts neither way (a document the next question
    reads); not used again, it was rightly released. Each block the
    fallback evicts is watched as long: cached again within them, the
    fallback evicted a block still needed. A tenant's releases are followed
    while the share of its released blocks that came back at a cost is at
    most the share of the fallback's victims that came back (one released
    block that did not come back assumed before its first; the fallback's
    share is 0 until a victim's window has closed). A return counts when
    its window closes, a released block's as a victim's (as one that did
    not come back does): counted at once, the returns would weigh a window
    more than the blocks that did not come back, and a tenant's share
    would be held to a bar it does not hold the fallback's to (with
    ``revisit`` as the fallback that turned RAG's truthful releases off
    where following them paid). Both shares weigh the recent evictions
    most (halved every ``half_life`` evictions), so a tenant whose hints
    turn right, or a cache that turns tight, is followed again.

    Cost: a few dict operations per released, used and evicted block, from
    the first release on (nothing is watched before it)."""

    def __init__(self, window: int, half_life: float):
        self.window = window
        self.evictions = 0  # the clock: blocks evicted so far
        self._per_eviction = 0.5 ** (1.0 / max(1.0, half_life))
        self.tenants: dict[str, _Tally] = {}
        self.fallback = _Tally()
        #: content key -> (tenant, released at, blocks before it in the released
        #: order then where the release was not followed, else None)
        self._released: dict[int, tuple[str, int, int | None]] = {}
        self._released_order: deque[tuple[int, int]] = deque()  # (released at, key), oldest first
        self._costly: dict[int, tuple[str, int, int | None]] = {}  # released keys back at a cost, window open
        self._evicted: dict[int, int] = {}  # key the fallback evicted -> evicted at (negative: cached again since)
        self._evicted_order: deque[tuple[int, int]] = deque()

    @property
    def watching(self) -> bool:
        """From the first release on."""
        return bool(self.tenants)

    def released(self, tenant: str, blocks: Iterable[CachedBlock], ahead: int | None) -> None:
        """``tenant`` released ``blocks`` (those only its conversation used,
        root first): followed (``ahead`` None), or not, with ``ahead``
        blocks in the released order that would have gone before them."""
        tally = self.tenants.get(tenant)
        if tally is None:
            tally = self.tenants[tenant] = _Tally()
            tally.gone, tally.at = 1.0, self.evictions  # the right release assumed before the first
        now, blocks = self.evictions, list(blocks)
        last = len(blocks) - 1
        for index, block in enumerate(blocks):  # (the released order takes a chain leaf first)
            if block.key in self._costly:  # released again before its window closed: its return counts now
                self._count(self._costly.pop(block.key)[0], back=True)
            self._released[block.key] = (tenant, now, None if ahead is None else ahead + last - index)
            self._released_order.append((now, block.key))

    def used(self, blocks: Iterable[CachedBlock], again: bool = False) -> None:
        """``blocks`` were hit, or cached ``again``: released ones came back,
        at a cost if following the release evicted them (they are cached
        again) or, where it was not followed, would have by now."""
        released, costly = self._released, self._costly
        for block in blocks:
            entry = released.pop(block.key, None)
            if entry is None:
                continue
            ahead = entry[2]
            if again or (ahead is not None and self.evictions - entry[1] > ahead):
                costly[block.key] = entry  # counted when its window closes, as a victim's return is

    def cached(self, blocks: Iterable[CachedBlock]) -> None:
        """``blocks`` were cached: those the fallback evicted were still needed."""
        self.used(blocks, again=True)
        evicted = self._evicted
        if evicted:
            for block in blocks:
                at = evicted.get(block.key)
                if at is not None and at > 0:
                    evicted[block.key] = -at  # counted when its window closes, as one that is not

    def evicted(self, blocks: Iterable[CachedBlock], by_fallback: set[int]) -> None:
        """``blocks`` were evicted, those in ``by_fallback`` the fallback's choice."""
        for block in blocks:
            self.evictions += 1
            if block.block_id in by_fallback:
                self._evicted[block.key] = self.evictions
                self._evicted_order.append((self.evictions, block.key))
        self._expire()

    def _expire(self) -> None:
        """Close the windows of the blocks watched ``window`` evictions:
        a released block still here was rightly released; a victim counts
        as it went (cached again, or not)."""
        due, per = self.evictions - self.window, self._per_eviction
        order, released = self._released_order, self._released
        costly = self._costly
        while order and order[0][0] <= due:
            at, key = order.popleft()
            entry = released.get(key)
            if entry is not None and entry[1] == at:
                del released[key]
                if entry[2] is None or entry[2] < self.window:  # (else following it would not have evicted it)
                    self._count(entry[0], back=False)
            else:
                entry = costly.get(key)
                if entry is not None and entry[1] == at:
                    del costly[key]
                    self._count(entry[0], back=True)
        order, evicted = self._evicted_order, self._evicted
        while order and order[0][0] <= due:
            at, key = order.popleft()
            state = evicted.get(key)
            if state is not None and abs(state) == at:
                del evicted[key]
                self.fallback.decay(self.evictions, per)
                if state < 0:
                    self.fallback.back += 1
                else:
                    self.fallback.gone += 1

    def _count(self, tenant: str, back: bool) -> None:
        tally = self.tenants[tenant]
        tally.decay(self.evictions, self._per_eviction)
        if back:
            tally.back += 1
        else:
            tally.gone += 1

    def share_back(self, tenant: str | None = None) -> float:
        """The decayed share of ``tenant``'s released blocks that came back
        at a cost (``None``: of the fallback's victims that came back); 0
        before any was judged."""
        tally = self.fallback if tenant is None else self.tenants.get(tenant)
        if tally is None:
            return 0.0
        judged = tally.back + tally.gone
        return tally.back / judged if judged > 0 else 0.0

    def follows(self, tenant: str) -> bool:
        """Whether following ``tenant``'s releases has paid."""
        return self.share_back(tenant) <= self.share_back(None)


class _Unprotected:
    """The candidates less the protected (withheld) blocks: what the fallback
    may choose from. A fallback that keeps blocks in its order while they
    are held (S3-FIFO's queues) would otherwise name a pinned block."""

    def __init__(self, candidates: EvictionCandidates, withheld: dict[int, CachedBlock]):
        self.candidates, self.withheld = candidates, withheld

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.candidates and block_id not in self.withheld

    def __len__(self) -> int:  # (the withheld blocks are evictable: among the candidates, where all are offered)
        return max(0, len(self.candidates) - len(self.withheld))

    def __iter__(self) -> Iterator[int]:
        return (block_id for block_id in self.candidates if block_id not in self.withheld)


class _Pin:
    """A tenant's pin on a prefix: its blocks' keys, root first."""

    __slots__ = ("keys", "tenant", "expires_s")

    def __init__(self, keys: tuple[int, ...], tenant: str, expires_s: float):
        self.keys, self.tenant, self.expires_s = keys, tenant, expires_s


def conversation_of(request: Request | None) -> str | None:
    """The group a request's blocks belong to: its hints' ``cache_key``, else
    its session, else the request alone (``None`` where no request is known)."""
    if request is None:
        return None
    hints = request.kv_hints
    if hints is not None and hints.cache_key is not None:
        return hints.cache_key
    return request.session_id if request.session_id is not None else request.request_id


class HintEviction(PriorityEviction):
    """``[eviction] plugin = "hints"``"""

    Settings = HintSettings
    #: Its own order (the released conversations' blocks) is release order.
    monotone = True

    def __init__(self, settings: HintSettings | None, context: PluginContext):
        settings = settings if settings is not None else HintSettings()
        super().__init__(settings, context)
        self.fallback = _Expert.named(settings.fallback, context, FALLBACKS)
        self.block_size = context.block_size
        #: Content blocks each tenant may pin, and all tenants together.
        self.pin_budget = int(settings.pin_share * context.num_blocks)
        self.max_pinned = int(MAX_PINNED_SHARE * context.num_blocks)
        self.pin_ttl_s = settings.pin_ttl_s
        self.latest_s = 0.0  # the latest time a hook told
        self._blocks: dict[int, CachedBlock] = {}  # every cached block
        self._evictable: set[int] = set()
        self._withheld: dict[int, CachedBlock] = {}  # evictable and protected: not the fallback's
        self._deadline: dict[int, float] = {}  # cached block -> retained until
        self._retained: list[tuple[float, int, int]] = []  # (deadline, -depth, block) of withheld blocks, lazy
        self._pins: dict[tuple[str, int], _Pin] = {}  # (tenant, prefix's last key) -> pin
        self._pin_expiry: list[tuple[float, str, int]] = []  # (expires, tenant, prefix's last key), lazy
        self._pinned_by: dict[str, tuple[str, int]] = {}  # request in flight -> its pin's (tenant, last key)
        self._pinned_keys: dict[int, int] = {}  # key -> pins covering it
        self._tenant_keys: dict[str, dict[int, int]] = {}  # tenant -> key -> its pins covering it
        self._by_key: dict[int, set[int]] | None = None  # key -> cached blocks, from the first pin on
        self._owner: dict[int, str | None] = {}  # cached block -> the conversation that used it first
        self._shared: set[int] = set()  # cached blocks two conversations used
        # request with release -> (its tenant, the blocks only its conversation used)
        self._ending: dict[str, tuple[str, list[CachedBlock]]] = {}
        self._first: dict[int, str] = {}  # block in the released order -> the tenant that released it
        self._first_count: Counter[str] = Counter()  # tenant -> its blocks in the released order
        self.pins_taken = 0
        self.pins_refused = 0
        self.unpins = 0
        self.unpins_unmatched = 0
        #: Whether ``release`` and ``retain_s`` are followed now.
        self.advice = True
        #: The advice's judge, from the first advising hint: shadow caches
        #: of the fallback alone and of the fallback with the advice, their
        #: decayed hits, and the switches of ``advice`` as (blocks
        #: requested so far, on).
        self._judged = settings.judged
        self._duel: tuple[ShadowCache, ShadowCache] | None = None
        self._scores = [0.0, 0.0]
        self._decay_per_block = 0.5 ** (1.0 / (HALF_LIFE * max(1, context.num_blocks)))
        self._context, self._settings = context, settings
        self.requested = 0
        self.switches: list[tuple[int, bool]] = []
        #: Whether following each tenant's releases has paid (``release_window``);
        #: ``_watch`` records into it (none in the judge's advised shadow,
        #: which reads the real cache's).
        self.outcomes = ReleaseOutcomes(
            max(1, round(settings.release_window * context.num_blocks)), HALF_LIFE * max(1, context.num_blocks)
        )
        self._watch: ReleaseOutcomes | None = self.outcomes
        self._release_judged = settings.release_window > 0
        self._fallback_victims: set[int] = set()  # chosen by the fallback, not yet evicted

    def priority(self, block: CachedBlock, now_s: float) -> int:
        return 0  # (monotone: release order decides)

    # --------------------------------------------------------- questions --

    def pinned_keys(self, tenant: str | None = None) -> frozenset[int]:
        """The content keys pinned (by ``tenant``, or by anyone)."""
        return frozenset(self._pinned_keys if tenant is None else self._tenant_keys.get(tenant, {}))

    def is_protected(self, block: CachedBlock, now_s: float) -> bool:
        """Pinned, or retained until after ``now_s`` while the advice is followed."""
        if self.advice and self._deadline.get(block.block_id, 0.0) > now_s:
            return True
        return bool(self._pinned_keys) and block.key in self._pinned_keys

    # ------------------------------------------------------ observations --

    @hookimpl
    def sagellm_request_arrived(self, request: Request, match: PrefixMatch) -> None:
        conversation = conversation_of(request)
        owner, shared = self._owner, self._shared
        for block in match.blocks:  # a block another conversation matched is shared
            if owner.setdefault(block.block_id, conversation) != conversation:
                shared.add(block.block_id)
        hints = request.kv_hints
        if hints is None:
            return
        if hints.pin:
            self._pin(request, match, hints.pin)
        elif hints.unpin:
            self._unpin(request, match, hints.unpin)

    @hookimpl
    def sagellm_request_finished(self, outcome: RequestOutcome) -> None:
        request_id = outcome.request.request_id
        pin = self._pins.get(self._pinned_by.pop(request_id, ("", ROOT_KEY)))
        if pin is not None:  # a pin lasts pin_ttl_s from its last request's end
            self._extend(pin, self.latest_s + self.pin_ttl_s)
        self._release_first(request_id)

    def _release_first(self, request_id: str) -> None:
        """A released conversation's blocks go first once its request has
        finished (a preempted one comes back for them), if its tenant's
        releases are followed then."""
        tenant, ending = self._ending.pop(request_id, ("", ()))
        if not ending:
            return
        follows = self._follows(tenant)
        if self._watch is not None and self._release_judged:
            self._watch.released(tenant, ending, None if follows else len(self._queue))
        if not follows:
            return
        first = tuple(b for b in ending if b.block_id in self._evictable and b.block_id not in self._withheld)
        if first:
            super().sagellm_blocks_released(first, self.latest_s)
            if self._release_judged:
                for block in first:
                    self._forget_first(block.block_id)  # (released again: counted once, for its latest tenant)
                    self._first[block.block_id] = tenant
                self._first_count[tenant] += len(first)

    def _follows(self, tenant: str) -> bool:
        return not self._release_judged or self.outcomes.follows(tenant)

    def _unfollow(self) -> None:
        """The released blocks of tenants no longer followed leave the
        released order (the fallback's order holds them already)."""
        dropped = {tenant for tenant in self._first_count if not self._follows(tenant)}
        if dropped:
            out = [block_id for block_id, tenant in self._first.items() if tenant in dropped]
            for block_id in out:
                del self._first[block_id]
            for tenant in dropped:
                del self._first_count[tenant]
            super().sagellm_blocks_touched(tuple(self._blocks[block_id] for block_id in out))

    def _forget_first(self, block_id: int) -> None:
        tenant = self._first.pop(block_id, None)
        if tenant is not None:
            self._first_count[tenant] -= 1
            if not self._first_count[tenant]:
                del self._first_count[tenant]

    @hookimpl
    def sagellm_blocks_cached(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        self.latest_s = now_s
        known = self._blocks
        for block in blocks:
            known[block.block_id] = block
        if self._by_key is not None:
            for block in blocks:
                self._by_key.setdefault(block.key, set()).add(block.block_id)
        if self._watch is not None and self._watch.watching:
            self._watch.cached(blocks)
        self.fallback.tell("sagellm_blocks_cached", blocks, now_s)

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        self.latest_s = now_s
        evictable, withheld = self._evictable, self._withheld
        for block in blocks:
            evictable.discard(block.block_id)
            withheld.pop(block.block_id, None)
        if self._watch is not None and self._watch.watching:
            self._watch.used(blocks)
        if self._first:
            for block in blocks:
                self._forget_first(block.block_id)
        self.fallback.tell("sagellm_blocks_touched", blocks, now_s)
        super().sagellm_blocks_touched(blocks)

    @hookimpl
    def sagellm_blocks_released(self, blocks: tuple[CachedBlock, ...], now_s: float, request: Request | None) -> None:
        self.latest_s = now_s
        hints = request.kv_hints if request is not None else None
        own = self._own(blocks, conversation_of(request))
        if hints is not None and hints.retain_s > 0:
            until, deadline = now_s + hints.retain_s, self._deadline
            for block in self._path(blocks):
                if deadline.get(block.block_id, 0.0) < until:
                    deadline[block.block_id] = until
        self._evictable.update(block.block_id for block in blocks)
        given = blocks
        if self._deadline or self._pinned_keys:
            protected = [block for block in blocks if self.is_protected(block, now_s)]
            if protected:
                self._withhold(protected)
                kept = {block.block_id for block in protected}
                given = tuple(block for block in blocks if block.block_id not in kept)
        self.fallback.tell("sagellm_blocks_released", given, now_s, request)
        if hints is not None and hints.release and request is not None:
            self._ending[request.request_id] = (request.tenant, own)  # first once it has finished
        if (
            self._judged
            and blocks
            and (self._duel is not None or (hints is not None and (hints.release or hints.retain_s)))
        ):
            self._judge(blocks[-1], now_s, request)

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        self.latest_s = now_s
        if self._watch is not None and self._watch.watching:
            self._watch.evicted(blocks, self._fallback_victims)
        if self._fallback_victims:
            self._fallback_victims.difference_update(block.block_id for block in blocks)
        for block in blocks:
            block_id = block.block_id
            self._blocks.pop(block_id, None)
            self._evictable.discard(block_id)
            self._withheld.pop(block_id, None)
            self._deadline.pop(block_id, None)
            self._owner.pop(block_id, None)
            self._shared.discard(block_id)
            if self._first:
                self._forget_first(block_id)
            if self._by_key is not None:
                same = self._by_key.get(block.key)
                if same is not None:
                    same.discard(block_id)
                    if not same:
                        del self._by_key[block.key]
        self.fallback.tell("sagellm_blocks_evicted", blocks, now_s)
        super().sagellm_blocks_evicted(blocks)

    # ------------------------------------------------------------ choice --

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision:
        self._expire(self.latest_s)
        self._fallback_victims.clear()  # (the last choice's are evicted, or were not taken)
        if self._first:
            self._unfollow()
        victims = list(super().sagellm_select_victims(num_blocks, candidates).victim_ids) if self.advice else []
        chosen = set(victims)
        if len(victims) < num_blocks:
            offered = _Unprotected(candidates, self._withheld) if self._withheld else candidates
            for block_id in self.fallback.select(num_blocks, offered).victim_ids:
                if block_id not in chosen:
                    victims.append(block_id)
                    chosen.add(block_id)
                    if self.outcomes.watching:
                        self._fallback_victims.add(block_id)
                    if len(victims) == num_blocks:
                        break
        if len(victims) < num_blocks and self._retained and self.advice:
            victims += self._give_way(num_blocks - len(victims), candidates, chosen)
        return EvictionDecision(tuple(victims))

    # ----------------------------------------------------------- judge --

    def _judge(self, end: CachedBlock, now_s: float, request: Request | None) -> None:
        """Play the chain ending at ``end`` on both shadows; follow the
        advice or not as they have hit so far (ACME's and set dueling's
        rule, as ``adaptive``)."""
        if self._duel is None:
            capacity, context = self._context.num_blocks, self._context
            advised = HintEviction(attrs.evolve(self._settings, judged=False), context)
            advised.outcomes, advised._watch = self.outcomes, None  # the real cache's outcomes decide there too
            self._duel = (
                ShadowCache(_Expert.named(self._settings.fallback, context, FALLBACKS), capacity),
                ShadowCache(_Expert("advised", advised), capacity),
            )
        keys = []
        block: CachedBlock | None = end
        while block is not None:
            keys.append(block.key)
            block = self._blocks.get(block.parent_id) if block.parent_id is not None else None
        keys.reverse()
        self.requested += len(keys)
        decay, scores = self._decay_per_block ** len(keys), self._scores
        for side, shadow in enumerate(self._duel):
            scores[side] = scores[side] * decay + shadow.play(keys, now_s, request)
        if request is not None:  # a shadow's request ends as it is played
            self._duel[1].expert.policy._release_first(request.request_id)
        without, advised_hits = scores
        if self.advice and without > advised_hits * (1.0 + MARGIN):
            self.advice = False
            self.switches.append((self.requested, False))
            self._hand_back([b for b in self._withheld.values() if not self.is_protected(b, now_s)])
        elif not self.advice and advised_hits > without * (1.0 + MARGIN):
            self.advice = True
            self.switches.append((self.requested, True))

    # ----------------------------------------------------------- helpers --

    def _own(self, blocks: tuple[CachedBlock, ...], conversation: str | None) -> list[CachedBlock]:
        """Record who used ``blocks``; return those only ``conversation`` used."""
        owner, shared, own = self._owner, self._shared, []
        for block in blocks:
            if owner.setdefault(block.block_id, conversation) != conversation:
                shared.add(block.block_id)
            elif block.block_id not in shared:
                own.append(block)
        return own

    def _path(self, blocks: tuple[CachedBlock, ...]) -> list[CachedBlock]:
        """``blocks`` (a released chain, root first) with their cached prefix."""
        up: list[CachedBlock] = []
        parent = blocks[0].parent_id if blocks else None
        while parent is not None and parent in self._blocks:
            up.append(self._blocks[parent])
            parent = self._blocks[parent].parent_id
        return [*reversed(up), *blocks]

    def _withhold(self, blocks: Iterable[CachedBlock]) -> None:
        """Evictable blocks now protected: the fallback no longer holds them."""
        for block in blocks:
            self._withheld[block.block_id] = block
            until = self._deadline.get(block.block_id)
            if until is not None and until > self.latest_s:
                heapq.heappush(self._retained, (until, -block.depth, block.block_id))

    def _hand_back(self, blocks: list[CachedBlock]) -> None:
        """Protection ended: the blocks join the fallback's order, released now."""
        if not blocks:
            return
        blocks.sort(key=lambda block: block.depth)  # chain order, root first
        for block in blocks:
            self._withheld.pop(block.block_id, None)
        self.fallback.tell("sagellm_blocks_released", tuple(blocks), self.latest_s, None)

    def _expire(self, now_s: float) -> None:
        """End the pins and retentions due by ``now_s``."""
        while self._pin_expiry and self._pin_expiry[0][0] <= now_s:
            expires_s, tenant, last_key = heapq.heappop(self._pin_expiry)
            pin = self._pins.get((tenant, last_key))
            if pin is not None and pin.expires_s == expires_s:
                self._drop(self._pins.pop((tenant, last_key)))
        due: list[CachedBlock] = []
        while self._retained and self._retained[0][0] <= now_s:
            until, _, block_id = heapq.heappop(self._retained)
            block = self._withheld.get(block_id)
            if block is not None and self._deadline.get(block_id) == until:
                del self._deadline[block_id]
                if not self.is_protected(block, now_s):
                    due.append(block)
        self._hand_back(due)

    def _give_way(self, count: int, candidates: EvictionCandidates, chosen_ids: set[int]) -> list[int]:
        """Nothing unprotected is left: the retentions that end soonest (the
        deepest block first among equals) give way, ``count`` blocks of them."""
        chosen: list[CachedBlock] = []
        passed: list[tuple[float, int, int]] = []
        while self._retained and len(chosen) < count:
            entry = heapq.heappop(self._retained)
            until, _, block_id = entry
            block = self._withheld.get(block_id)
            if block is None or self._deadline.get(block_id) != until or block_id in chosen_ids:
                continue  # stale, or chosen already
            if self._pinned_keys and block.key in self._pinned_keys:
                continue  # pinned: never; unpinning puts it back
            if block_id not in candidates:
                passed.append(entry)
                continue
            del self._deadline[block_id]
            chosen.append(block)
        for entry in passed:
            heapq.heappush(self._retained, entry)
        self._hand_back(list(chosen))  # the fallback holds what is evicted, as always
        return [block.block_id for block in chosen]

    def _prefix_keys(self, request: Request, matched: tuple[CachedBlock, ...], tokens: int) -> list[int]:
        """The content keys of the prompt's first ``tokens`` tokens' whole
        blocks: the matched blocks' own, then hashed as the cache keys them."""
        count = tokens // self.block_size
        keys = [block.key for block in matched[:count]]
        prompt, size = request.prompt_token_ids, self.block_size
        key = keys[-1] if keys else ROOT_KEY
        for page in range(len(keys), count):
            key = chain_key(key, prompt[page * size : (page + 1) * size].tobytes())
            keys.append(key)
        return keys

    def _key_index(self) -> dict[int, set[int]]:
        if self._by_key is None:
            self._by_key = {}
            for block in self._blocks.values():
                self._by_key.setdefault(block.key, set()).add(block.block_id)
        return self._by_key

    def _extend(self, pin: _Pin, expires_s: float) -> None:
        if expires_s > pin.expires_s:
            pin.expires_s = expires_s
            heapq.heappush(self._pin_expiry, (expires_s, pin.tenant, pin.keys[-1]))

    def _pin(self, request: Request, match: PrefixMatch, tokens: int) -> None:
        keys = self._prefix_keys(request, match.blocks, tokens)
        if not keys:
            return  # less than a block: nothing to pin
        tenant, expires_s = request.tenant, self.latest_s + self.pin_ttl_s
        self._pinned_by[request.request_id] = (tenant, keys[-1])
        pin = self._pins.get((tenant, keys[-1]))
        if pin is not None:
            self._extend(pin, expires_s)
            return
        mine = self._tenant_keys.setdefault(tenant, {})
        pinned = self._pinned_keys
        if (
            len(mine) + sum(1 for k in keys if k not in mine) > self.pin_budget
            or len(pinned) + sum(1 for k in keys if k not in pinned) > self.max_pinned
        ):
            self.pins_refused += 1
            return
        self.pins_taken += 1
        self._pins[(tenant, keys[-1])] = _Pin(tuple(keys), tenant, expires_s)
        heapq.heappush(self._pin_expiry, (expires_s, tenant, keys[-1]))
        for key in keys:
            mine[key] = mine.get(key, 0) + 1
            pinned[key] = pinned.get(key, 0) + 1
        # Blocks of the prefix that are evictable now leave the fallback's order (and the released queue).
        index = self._key_index()
        now = tuple(
            self._blocks[block_id]
            for key in keys
            for block_id in index.get(key, ())
            if block_id in self._evictable and block_id not in self._withheld
        )
        if now:
            self._withhold(now)
            self.fallback.tell("sagellm_blocks_touched", now, self.latest_s)
            super().sagellm_blocks_touched(now)

    def _unpin(self, request: Request, match: PrefixMatch, tokens: int) -> None:
        keys = self._prefix_keys(request, match.blocks, tokens)
        pin = self._pins.pop((request.tenant, keys[-1]), None) if keys else None
        if pin is None:
            self.unpins_unmatched += 1
            return
        self.unpins += 1
        self._drop(pin)

    def _drop(self, pin: _Pin) -> None:
        """End a pin: its blocks no other pin or retention keeps go back."""
        mine, pinned, freed = self._tenant_keys[pin.tenant], self._pinned_keys, []
        for key in pin.keys:
            mine[key] -= 1
            if not mine[key]:
                del mine[key]
            pinned[key] -= 1
            if not pinned[key]:
                del pinned[key]
                freed.append(key)
        index = self._key_index()
        back = []
        for key in freed:
            for block_id in index.get(key, ()):
                block = self._withheld.get(block_id)
                if block is not None and not self.is_protected(block, self.latest_s):
                    back.append(block)
                elif block is not None:
                    self._withhold([block])  # still retained: back in the retained order
        self._hand_back(back)
