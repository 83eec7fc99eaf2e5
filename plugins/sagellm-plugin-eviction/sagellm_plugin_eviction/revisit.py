"""Request-aware dead-block prediction: learn online, from the request that
released a chain, whether its blocks come back, and evict the blocks
predicted dead first within LRU's order.

Most of the gap between LRU and Belady on the policy suite is blocks kept
that are never used again (``belady:knows=whether`` closes three quarters of
it). Whether a released chain comes back is mostly a question about its
*request*: does its session send another turn, is its document or tool
prompt shared. The kernel passes the releasing request to
``sagellm_blocks_released`` (``None`` where the engine does not say); this
policy keys its predictor on it.

* **Labels, from the past only.** Every released block is *pending* under
  its content key, with the signature it was released with. If the key is
  used again (a hit, or the same content cached anew after an eviction)
  within ``horizon`` times LRU's eviction age, the signature is trained
  *live*; if not, *dead*. LRU's eviction age is measured: the newly cached
  blocks between a block's release and its eviction, for the blocks
  evicted in LRU's order (those predicted live), smoothed. A block back
  later than that is gone under LRU anyway, so keeping it is worth little;
  and before the first eviction nothing is labelled dead (order does not
  matter yet).
* **Features.** A block's signature is a few hashed table indexes: the
  releasing request's turn in its conversation with its tenant; the turn
  with the block's distance from the chain's end; the conversation itself;
  the chain's first block (a shared document or system prompt); the
  request's prompt and output sizes; the block's content key; and the
  user's time since the conversation's previous turn (log2 seconds). The
  conversation is the request's session, its turn the session's count of
  requests so far; without a session it is guessed from the chain: the
  conversation of the deepest block the request hit below the chain's
  first (its previous turn cached it), one turn later, or a new one. Each
  feature is split by the block's kind: new (cached by this request), its
  conversation's own (cached by an earlier turn), or shared (used by two
  conversations: one conversation's end does not end it).
* **The predictor.** A logistic regression over those features (a weight
  per table entry, and a bias), one gradient step per label
  (``learning_rate``). A block is predicted dead when its predicted chance
  of being dead is above ``dead_chance``; with no evidence every weight is
  0 and the chance 1/2, so before any evidence the policy is LRU.
* **The order.** LRU's (release order, deepest block first), with a block
  predicted dead placed as if released ``demotion`` cache sizes of
  releases earlier, or ``guessed_demotion`` where its conversation is
  guessed (no session, or no request from the engine: a weaker signal).
  Within a release, once a block is predicted dead every deeper one is
  too: a use of a block uses its whole prefix.

It reads no future (``future_requests`` is never touched): the requests it
learns from are those that already released their blocks. Cost: per
released block a few hashes and table reads; per cached or hit block a dict
lookup; choosing k victims is O(k), a merge of two ordered queues. Memory:
the tables, a few entries per cached or pending block, and the
``KEPT_SESSIONS`` most recently seen sessions and request ids.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from itertools import islice

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import CachedBlock, EvictionCandidates, EvictionDecision, Request

#: Entries per feature's table (feature hashes are folded into it).
TABLE_SIZE = 8192
#: Features per signature.
FEATURES = 7
#: Released blocks waiting for their label, at most, in cache sizes.
PENDING_CAPACITIES = 8
#: Sessions and request ids remembered, the most recently seen: a server
#: that runs for days holds this many, not every session it ever saw (a
#: session quiet for longer starts again as a new conversation).
KEPT_SESSIONS = 65536
#: Smoothing of LRU's eviction age (the weight of each new victim's age).
AGE_WEIGHT = 1 / 64
#: The conversation of a block that two conversations used.
SHARED = 1 << 62


@frozen
class RevisitSettings:
    #: A released block whose content is not used again within this many
    #: times LRU's eviction age (newly cached blocks between a block's
    #: release and its eviction, for the blocks predicted live) is labelled
    #: dead. Before the first eviction nothing is: order does not matter yet.
    horizon: float = field(default=1.0, converter=float, validator=validators.gt(0))
    #: A block predicted dead goes in LRU's order as if released this many
    #: cache sizes of releases earlier; ``inf``: before every live block.
    demotion: float = field(default=1.0, converter=float, validator=validators.ge(0))
    #: The same for a block released by a request without a session (or by
    #: an engine that does not say which request): its conversation is
    #: guessed from the chain, a weaker signal, so it is demoted less.
    guessed_demotion: float = field(default=0.5, converter=float, validator=validators.ge(0))
    #: Predicted dead when the predicted chance that it is dead is above this.
    dead_chance: float = field(default=0.8, converter=float, validator=[validators.gt(0), validators.lt(1)])
    #: The logistic regression's step size.
    learning_rate: float = field(default=0.01, converter=float, validator=validators.gt(0))


def _bucket(n: int) -> int:
    """0, 1, 2-3, 4-7, ...: a log2 scale for counts and sizes."""
    return n.bit_length()


class RevisitEviction:
    """``[eviction] plugin = "revisit"``"""

    Settings = RevisitSettings

    def __init__(self, settings: RevisitSettings | None, context: PluginContext):
        settings = settings if settings is not None else RevisitSettings()
        self.settings = settings
        self._capacity = max(1, context.num_blocks)
        self._age = math.inf  # LRU's eviction age, smoothed
        self._released_at: dict[int, int] = {}  # evictable block predicted live -> the clock at its release
        self._demotion = settings.demotion * context.num_blocks
        self._guessed_demotion = settings.guessed_demotion * context.num_blocks
        self._inserted = 0  # newly cached blocks so far: the labels' clock
        self._releases = 0  # released blocks so far: the order's clock
        #: content key -> [the insertion clock at its release, its signature]
        self._pending: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()
        # per feature, per entry: a weight, > 0 for dead (log-odds)
        self._weights = [[0.0] * TABLE_SIZE for _ in range(FEATURES)]
        self._bias = 0.0
        self._dead_logit = math.log(settings.dead_chance / (1 - settings.dead_chance))
        self._dead: OrderedDict[int, float] = OrderedDict()  # evictable, predicted dead
        self._guessed: OrderedDict[int, float] = OrderedDict()  # the same, of a guessed conversation
        self._live: OrderedDict[int, float] = OrderedDict()
        self._root: dict[int, int] = {}  # cached block -> its chain's first block's key
        #: cached block -> (conversation, turn) of the request that cached it
        self._owner: dict[int, tuple[int, int]] = {}
        self._anonymous = 0  # conversations without a session so far
        self._last_release: dict[int, float] = {}  # conversation -> its latest release's time
        self._hit_now: set[int] = set()  # hit since its last release
        #: session id -> [its number, its requests released so far], the
        #: KEPT_SESSIONS most recently seen
        self._sessions: OrderedDict[str, list[int]] = OrderedDict()
        self._seen_requests: dict[str, None] = {}  # (bounded) requests already counted
        # strings hash differently in each process: numbered, so that the
        # tables' collisions are the same from run to run
        self._names: dict[object, int] = {}  # tenants and namespaces (few)
        self._numbered = 0
        #: Labels trained: [live, dead].
        self.trained = [0, 0]
        #: Released blocks predicted [dead, live].
        self.predicted = [0, 0]

    def _number(self, name: object) -> int:
        number = self._names.get(name)
        if number is None:
            number = self._names[name] = self._new_number()
        return number

    def _new_number(self) -> int:
        self._numbered += 1
        return self._numbered - 1

    # ------------------------------------------------------------ labels --

    def _train(self, signature: tuple[int, ...], live: bool) -> None:
        """A logistic regression's gradient step toward the label."""
        self.trained[0 if live else 1] += 1
        total = max(-30.0, min(30.0, self.total(signature)))
        step = self.settings.learning_rate * ((0.0 if live else 1.0) - 1.0 / (1.0 + math.exp(-total)))
        self._bias += step
        for table, index in zip(self._weights, signature):
            table[index] += step

    def _used(self, key: int) -> None:
        entry = self._pending.pop(key, None)
        if entry is not None:
            self._train(entry[1], True)

    def _expire(self) -> None:
        pending, horizon = self._pending, self.settings.horizon * self._age
        oldest = self._inserted - horizon
        while pending:
            key, entry = next(iter(pending.items()))
            if entry[0] > oldest:
                if len(pending) <= PENDING_CAPACITIES * self._capacity:
                    break
                pending.popitem(last=False)  # too many to remember: forgotten, not judged
                continue
            pending.popitem(last=False)
            self._train(entry[1], False)

    # ------------------------------------------------------- observations --

    @hookimpl
    def sagellm_blocks_cached(self, blocks: tuple[CachedBlock, ...]) -> None:
        root = self._root
        for block in blocks:
            parent = block.parent_id
            root[block.block_id] = root.get(parent, block.key) if parent is not None else block.key
            self._used(block.key)
        self._inserted += len(blocks)
        self._expire()

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...]) -> None:
        dead, live, hit_now = self._dead, self._live, self._hit_now
        for block in blocks:
            block_id = block.block_id
            dead.pop(block_id, None)
            self._guessed.pop(block_id, None)
            live.pop(block_id, None)
            self._released_at.pop(block_id, None)
            hit_now.add(block_id)
            self._used(block.key)

    def conversation(self, blocks: tuple[CachedBlock, ...], request: Request | None) -> tuple[int, int]:
        """The releasing request's conversation (a number) and its turn in
        it: its session and its count of requests in it so far; without a
        session, the conversation of the deepest block it hit below the
        chain's first (its previous turn cached it) and one turn more, or a
        new conversation."""
        if request is not None and request.session_id is not None:
            sessions = self._sessions
            session = sessions.get(request.session_id)
            if session is None:
                session = sessions[request.session_id] = [self._new_number(), 0]
                if len(sessions) > KEPT_SESSIONS:
                    sessions.popitem(last=False)
            else:
                sessions.move_to_end(request.session_id)
            if request.request_id not in self._seen_requests:
                self._seen_requests[request.request_id] = None
                if len(self._seen_requests) > KEPT_SESSIONS:
                    self._seen_requests.pop(next(iter(self._seen_requests)))
                session[1] += 1
            return session[0], max(session[1], 1)
        hit_now, owner = self._hit_now, self._owner
        for block in reversed(blocks):
            if block.depth == 0:
                break
            if block.block_id in hit_now and block.block_id in owner:
                conversation, turn = owner[block.block_id]
                if conversation == SHARED:  # branching off a shared prefix: a new one
                    break
                return conversation, turn + 1
        self._anonymous += 1
        return -self._anonymous, 1

    def signatures(
        self, blocks: tuple[CachedBlock, ...], request: Request | None, now_s: float = 0.0
    ) -> list[tuple[int, ...]]:
        """The table index per feature of each released block. A block is
        new (cached by this request), its conversation's own (hit, cached
        by an earlier turn of it) or shared (hit, cached by another)."""
        conversation, turn = self.conversation(blocks, request)
        before = self._last_release.pop(conversation, None)
        self._last_release[conversation] = now_s
        if len(self._last_release) > PENDING_CAPACITIES * self._capacity:
            self._last_release.pop(next(iter(self._last_release)))
        # the user's time since the conversation's previous turn, log2 seconds
        gap = -1 if before is None else int(max(0.0, now_s - before)).bit_length()
        if request is not None:
            tenant = self._number(("tenant", request.tenant))
            size = (_bucket(request.num_prompt_tokens), _bucket(request.output_tokens))
        else:
            tenant = self._number(("space", blocks[0].tenant, blocks[0].namespace)) if blocks else -1
            size = (-1, -1)
        turn_bucket = min(turn, 16)
        hit_now, root, owner = self._hit_now, self._root, self._owner
        length, out = len(blocks), []
        for i, block in enumerate(blocks):
            block_id = block.block_id
            if block_id not in hit_now:
                kind = 0
                owner[block_id] = (conversation, turn)
            else:
                mine = owner.get(block_id)
                kind = 1 if mine is not None and mine[0] == conversation else 2
                # shared once another conversation used it: its own
                # conversation's end no longer ends it
                owner[block_id] = (conversation, turn) if kind == 1 else (SHARED, 0)
            tail = _bucket(length - 1 - i)
            out.append(
                (
                    hash((tenant, turn_bucket, kind)) % TABLE_SIZE,
                    hash((turn_bucket, kind, tail)) % TABLE_SIZE,
                    hash((conversation, kind, tail)) % TABLE_SIZE,
                    hash((root.get(block_id, block.key), kind)) % TABLE_SIZE,
                    hash((size, kind, tail)) % TABLE_SIZE,
                    hash((block.key, kind)) % TABLE_SIZE,
                    hash((gap, min(turn, 4), kind)) % TABLE_SIZE,
                )
            )
        return out

    def total(self, signature: tuple[int, ...]) -> float:
        """The log-odds that a block of this signature is dead."""
        return self._bias + sum(table[index] for table, index in zip(self._weights, signature))

    @hookimpl
    def sagellm_blocks_released(self, blocks: tuple[CachedBlock, ...], now_s: float, request: Request | None) -> None:
        signatures = self.signatures(blocks, request, now_s)
        threshold, pending, inserted = self._dead_logit, self._pending, self._inserted
        fates, dead = [], False
        for block, signature in zip(blocks, signatures):  # root first: a dead block's descendants are dead too
            dead = dead or self.total(signature) > threshold
            fates.append(dead)
            self.predicted[0 if dead else 1] += 1
            pending.pop(block.key, None)
            pending[block.key] = (inserted, signature)
            self._hit_now.discard(block.block_id)
        if request is None or request.session_id is None:
            queue, demotion = self._guessed, self._guessed_demotion
        else:
            queue, demotion = self._dead, self._demotion
        for block, is_dead in zip(reversed(blocks), reversed(fates)):  # leaves first
            self._releases += 1
            if is_dead:
                queue[block.block_id] = self._releases - demotion
            else:
                self._live[block.block_id] = self._releases
                self._released_at[block.block_id] = self._inserted

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            block_id = block.block_id
            self._dead.pop(block_id, None)
            self._guessed.pop(block_id, None)
            self._live.pop(block_id, None)
            released_at = self._released_at.pop(block_id, None)
            if released_at is not None:  # a block LRU's order evicted
                age = self._inserted - released_at
                self._age = age if math.isinf(self._age) else self._age + AGE_WEIGHT * (age - self._age)
            self._root.pop(block_id, None)
            self._owner.pop(block_id, None)
            self._hit_now.discard(block_id)

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision:
        order = self._merged() if self._dead or self._guessed else iter(self._live)
        return EvictionDecision(tuple(islice(filter(candidates.__contains__, order), num_blocks)))

    def _merged(self) -> Iterator[int]:
        """The evictable blocks, lowest place first (each queue is in place
        order already; at equal places the dead first)."""
        heads = []
        for queue in (self._dead, self._guessed, self._live):
            items = iter(queue.items())
            head = next(items, None)
            if head is not None:
                heads.append([head[1], head[0], items])
        while len(heads) > 1:
            best = heads[0]
            for head in heads[1:]:
                if head[0] < best[0]:
                    best = head
            yield best[1]
            following = next(best[2], None)
            if following is None:
                heads.remove(best)
            else:
                best[1], best[0] = following
        if heads:
            yield heads[0][1]
            yield from (block_id for block_id, _ in heads[0][2])

    @property
    def predicted_dead(self) -> int:
        """Evictable blocks predicted dead now."""
        return len(self._dead) + len(self._guessed)
