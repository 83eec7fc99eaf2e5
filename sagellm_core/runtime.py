"""The request-lifecycle runtime: engine-agnostic, it owns the loop's state
and asks plugins for every decision.

An engine (the replay engine, or an adapter around a real engine) drives it::

    state = rt.arrive(request)              # predict lifetime, observe
    n = rt.admit(state, token_budget)       # match+lock prefix, allocate
    rt.grow(state, n)                       # more blocks as the sequence grows
    rt.cache(state)                         # insert full blocks into the cache
    rt.preempt(state) / rt.finish(state)    # release, free, observe

Every plugin answer is checked before the runtime changes anything: a plugin
that returns nonsense gets a :class:`PluginError` naming it, and the
runtime's own state (blocks in use, requests holding them) is unchanged.
"""

from __future__ import annotations

import sys
from itertools import takewhile
from typing import Any, Collection, Iterable, Sequence

import attrs
import pluggy

from sagellm_core import hookspecs
from sagellm_core.config import Selection, Settings
from sagellm_core.errors import ConfigError, PluginError, SagellmError
from sagellm_core.registry import PluginContext, PluginInfo, build_settings, load_class
from sagellm_core.tiers import HostTierIndex
from sagellm_core.timing import HookTimer
from sagellm_core.types import (
    EMPTY_MATCH,
    BlockAllocation,
    CachedBlock,
    EvictionCandidates,
    EvictionDecision,
    KVCaches,
    LifetimePrediction,
    PoolUsage,
    PrefixInsert,
    PrefixMatch,
    PreemptionDecision,
    Request,
    RequestOutcome,
    RequestStatus,
    ScheduleIR,
    SequenceState,
    StepResult,
    TransferPlan,
    TransferResult,
    as_token_array,
)

#: The hooks a plugin picked for a section must implement, all of them.
SECTION_HOOKS: dict[str, tuple[str, ...]] = {
    "prefix_cache": (
        "sagellm_lookup_prefix",
        "sagellm_acquire_prefix",
        "sagellm_insert_prefix",
        "sagellm_release_prefix",
        "sagellm_evictable_blocks",
        "sagellm_remove_blocks",
    ),
    "kv_pool": ("sagellm_allocate_blocks", "sagellm_free_blocks", "sagellm_pool_usage"),
    "eviction": ("sagellm_select_victims",),
    "lifetime": ("sagellm_predict_lifetime",),
    "scheduler": ("sagellm_schedule_pass",),
    "transport": ("sagellm_transfer_blocks",),
}


@attrs.frozen
class LoadedPlugin:
    selection: Selection
    info: PluginInfo
    instance: Any

    def __str__(self) -> str:
        dist = f" ({self.info.distribution} {self.info.version})" if self.info.distribution else ""
        return f"{self.selection.section} plugin {self.selection.name!r}{dist}"


@attrs.define
class Counters:
    """What the runtime itself counts; the report is built from these."""

    requests_finished: int = 0
    requests_rejected: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    #: Causal (query, key) token pairs of the prompts and of their cached
    #: prefixes, n(n+1)/2 each: the attention part of prefill compute, which
    #: grows with depth, so a deep hit saves more than a shallow one.
    query_token_pairs: int = 0
    hit_token_pairs: int = 0
    #: Cached blocks a request found at arrival but not at admission: its
    #: prefix was evicted while it waited.
    lost_waiting_blocks: int = 0
    prefill_tokens: int = 0
    reprefill_tokens: int = 0
    evicted_blocks: int = 0
    preemptions: int = 0
    transfers: int = 0
    transfer_failures: int = 0
    transferred_blocks: int = 0
    transferred_bytes: int = 0
    transfer_s: float = 0.0
    #: Blocks found on the host tier after the device-cache hit (loaded back
    #: by an engine's KV connector instead of recomputed), first admissions.
    host_hit_blocks: int = 0
    lifetime_abs_error: float = 0.0
    lifetime_predictions: int = 0
    #: Predictions the fallback made because the picked predictor failed,
    #: and the first failure, naming the plugin.
    lifetime_fallbacks: int = 0
    lifetime_failure: str | None = None
    #: tenant -> [query blocks, hit blocks], first admissions only.
    tenant_blocks: dict[str, list[int]] = attrs.field(factory=dict)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Runtime:
    """``engine_owns`` names the sections an engine adapter serves with the
    engine's own machinery (vLLM's hash table and block pool, say): their
    plugins are not loaded, and the block lifecycle below is the engine's."""

    def __init__(
        self, settings: Settings, *, hook_timing: bool | None = None, engine_owns: Collection[str] = ()
    ):
        self.settings = settings
        self.engine_owns = frozenset(engine_owns)
        if settings.kv_pool is None and "kv_pool" not in self.engine_owns:
            raise ConfigError(
                f"{settings.path}: [kv_pool]: missing key 'plugin'"
                f" (engine {settings.engine.name!r} allocates blocks through it)"
            )
        self.block_size = settings.block_size
        self.num_blocks = settings.num_blocks
        self.now_s = 0.0
        self.counters = Counters()
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, list[LoadedPlugin]] = {}
        self.timer = None
        if settings.report.hook_timing if hook_timing is None else hook_timing:
            self.timer = HookTimer()
            self.pm.register(self.timer, name="sagellm:hook-timer")
        # pluggy calls implementations last-registered first: register the
        # passes in reverse so they run in the order the config lists them.
        for sel in [*reversed(settings.passes), *settings.decisions()]:
            if sel.section not in self.engine_owns:
                self._register(sel)
        if "scheduler" in self.plugins:
            self.plugins["scheduler"].reverse()  # listed in config order
        self.hook = self.pm.hook
        # (hook caller, who answers through it)
        self._predict: tuple[Any, str] = (self.hook.sagellm_predict_lifetime, self.who("lifetime"))
        self._predict_fallback: tuple[Any, str] | None = None
        if settings.lifetime_fallback is not None and "lifetime" in self.plugins:
            self._register(settings.lifetime_fallback)
            primary, fallback = self.plugins["lifetime"]
            # Each predictor alone: pluggy would otherwise ask the fallback first.
            subset = self.pm.subset_hook_caller
            self._predict = (subset("sagellm_predict_lifetime", [fallback.instance]), str(primary))
            self._predict_fallback = (subset("sagellm_predict_lifetime", [primary.instance]), str(fallback))
        # Ground truth for invariants: blocks taken from the pool and not yet
        # returned; of these, the ones the prefix cache holds.
        self._in_use: set[int] = set()
        self._cached: set[int] = set()
        self._active: dict[str, SequenceState] = {}
        # Evicted blocks copied to the host tier, found again by content key;
        # the transport plugin sizes the tier and reuses its slots.
        self._host = HostTierIndex(sys.maxsize) if settings.offload_evicted else None
        if "kv_pool" in self.engine_owns:
            return
        usage = self.pool_usage()
        if usage.num_blocks != self.num_blocks or usage.num_free_blocks != self.num_blocks:
            raise PluginError(
                f"{self.who('kv_pool')} reports {usage.num_free_blocks}/{usage.num_blocks} free"
                f" blocks at start; the config asks for {self.num_blocks}"
            )

    # ------------------------------------------------------------ plugins --

    def _register(self, sel: Selection) -> None:
        cls, info = load_class(sel.section, sel.name, sel.where)
        settings = build_settings(cls, sel.params, f"{sel.where} plugin {sel.name!r}")
        context = PluginContext(
            sel.name, self.block_size, self.num_blocks, self.settings.workload.seed, self.settings.workload
        )
        try:
            instance = cls(settings, context)
        except SagellmError:
            raise
        except Exception as exc:
            raise ConfigError(f"{sel.where}: plugin {sel.name!r} failed to start: {exc}") from exc
        loaded = LoadedPlugin(sel, info, instance)
        try:
            self.pm.register(instance, name=f"{sel.section}:{sel.name}")
            self.pm.check_pending()
        except (pluggy.PluginValidationError, ValueError) as exc:
            raise ConfigError(f"{sel.where}: {loaded} is not a valid plugin: {exc}") from exc
        missing = [h for h in SECTION_HOOKS.get(sel.section, ()) if not hasattr(instance, h)]
        if missing:
            raise ConfigError(f"{sel.where}: {loaded} does not implement {', '.join(missing)}")
        self.plugins.setdefault(sel.section, []).append(loaded)

    def who(self, section: str) -> str:
        loaded = self.plugins.get(section)
        if not loaded:
            return f"no {section} plugin"
        return " / ".join(str(p) for p in loaded)

    def _culprit(self, exc: BaseException, section: str) -> str:
        """The plugin whose method raised ``exc``, found in its traceback."""
        by_instance = {id(p.instance): p for ps in self.plugins.values() for p in ps}
        tb = exc.__traceback__
        culprit = None
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if id(owner) in by_instance:
                culprit = by_instance[id(owner)]
            tb = tb.tb_next
        return str(culprit) if culprit else self.who(section)

    def _call(self, section: str, hook_name: str, caller: Any = None, **kwargs: Any) -> Any:
        try:
            return (caller or getattr(self.hook, hook_name))(**kwargs)
        except SagellmError:
            raise
        except Exception as exc:
            # One line, whatever the plugin's message looks like.
            message = " ".join(str(exc).split())
            raise PluginError(
                f"{self._culprit(exc, section)} raised in {hook_name}: {type(exc).__name__}: {message}"
            ) from exc

    def _bad(self, section: str, hook_name: str, what: str) -> PluginError:
        return PluginError(f"{self.who(section)} {hook_name} {what}")

    def observe(self, hook_name: str, **kwargs: Any) -> None:
        self._call("observer", hook_name, **kwargs)

    # --------------------------------------------------------- decisions --

    def pool_usage(self) -> PoolUsage:
        usage = self._call("kv_pool", "sagellm_pool_usage")
        if not isinstance(usage, PoolUsage):
            raise self._bad("kv_pool", "sagellm_pool_usage", f"returned {usage!r}, not a PoolUsage")
        return usage

    def evictable(self):
        return self._call("prefix_cache", "sagellm_evictable_blocks") or ()

    def lookup(self, request: Request) -> PrefixMatch:
        match = self._call("prefix_cache", "sagellm_lookup_prefix", request=request) or EMPTY_MATCH
        self._check_match(request, match, "sagellm_lookup_prefix")
        return match

    def _check_match(self, request: Request, match: Any, hook_name: str) -> None:
        if not isinstance(match, PrefixMatch):
            raise self._bad("prefix_cache", hook_name, f"returned {match!r}, not a PrefixMatch")
        limit = (request.num_prompt_tokens - 1) // self.block_size
        if match.num_blocks > limit:
            raise self._bad(
                "prefix_cache",
                hook_name,
                f"matched {match.num_blocks} blocks of a {request.num_prompt_tokens}-token prompt"
                f" (at most {limit}: one token is always computed)",
            )
        ids = match.block_ids
        if len(set(ids)) != len(ids) or not self._cached.issuperset(ids):
            raise self._bad("prefix_cache", hook_name, f"matched blocks that are not cached: {ids}")

    # The prefix cache's lifecycle, each answer checked. The runtime's own
    # admit / cache / release use them; so does an engine adapter whose
    # engine keeps its own block lifecycle but lets the prefix-cache plugin
    # decide the matches (LMDeploy's).

    def acquire_prefix(self, request: Request) -> PrefixMatch:
        """Match ``request``'s prompt and lock the matched blocks for it."""
        match = self._call("prefix_cache", "sagellm_acquire_prefix", request=request) or EMPTY_MATCH
        try:
            self._check_match(request, match, "sagellm_acquire_prefix")
        except PluginError:
            self._call("prefix_cache", "sagellm_release_prefix", request=request)
            raise
        return match

    def release_prefix(self, request: Request) -> tuple[CachedBlock, ...]:
        """Drop ``request``'s locks; return the blocks now evictable."""
        return self._call("prefix_cache", "sagellm_release_prefix", request=request) or ()

    def insert_prefix(self, request: Request, token_ids, block_ids: Sequence[int]) -> PrefixInsert | None:
        """Cache the full blocks of ``token_ids``, held in ``block_ids``
        (the matched prefix first, then blocks not cached yet). Checked: the
        plugin adopts or replaces only given blocks that were not cached, and
        replaces and locks only cached ones."""
        result = self._call(
            "prefix_cache", "sagellm_insert_prefix", request=request, token_ids=token_ids, block_ids=block_ids
        )
        if result is None:
            return None
        if not isinstance(result, PrefixInsert):
            raise self._bad("prefix_cache", "sagellm_insert_prefix", f"returned {result!r}, not a PrefixInsert")
        given = set(block_ids)
        adopted = [b.block_id for b in result.adopted]
        if any(b not in given or b in self._cached for b in adopted) or any(
            g not in given or g in self._cached or b.block_id not in self._cached for g, b in result.replaced
        ):
            raise self._bad(
                "prefix_cache", "sagellm_insert_prefix",
                f"adopted {adopted} / replaced {[g for g, _ in result.replaced]} of blocks {list(block_ids)}"
                " it was not given or that were cached",
            )
        stray = [b.block_id for b in result.locked if b.block_id not in self._cached]
        if stray:
            raise self._bad("prefix_cache", "sagellm_insert_prefix", f"locked blocks that are not cached: {stray[:8]}")
        self._cached.update(adopted)
        return result

    def remove_cached(self, victims: Sequence[int]) -> tuple[CachedBlock, ...]:
        """Drop the evictable ``victims`` (and their cached descendants) from
        the prefix cache; return every block removed. The caller frees them."""
        removed = self._call("prefix_cache", "sagellm_remove_blocks", block_ids=victims)
        if not isinstance(removed, tuple) or not all(isinstance(b, CachedBlock) for b in removed):
            raise self._bad("prefix_cache", "sagellm_remove_blocks", f"returned {removed!r}, not CachedBlocks")
        ids = [b.block_id for b in removed]
        if len(set(ids)) != len(ids) or not set(victims) <= set(ids) or not self._cached.issuperset(ids):
            raise self._bad("prefix_cache", "sagellm_remove_blocks", f"removed {ids} for victims {list(victims)}")
        self._cached.difference_update(ids)
        return removed

    def pinned_blocks(self) -> Collection[int]:
        return self._call("prefix_cache", "sagellm_pinned_blocks") or ()

    def select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> tuple[int, ...]:
        """Ask the eviction policy for up to ``num_blocks`` of ``candidates``,
        checked: distinct, no more than asked, every one a candidate."""
        decision = self._call("eviction", "sagellm_select_victims", num_blocks=num_blocks, candidates=candidates)
        if not isinstance(decision, EvictionDecision):
            raise self._bad(
                "eviction", "sagellm_select_victims", f"returned {decision!r}, not an EvictionDecision"
            )
        victims = decision.victim_ids
        if len(victims) > num_blocks:
            raise self._bad(
                "eviction", "sagellm_select_victims", f"returned {len(victims)} victims, asked for at most {num_blocks}"
            )
        if len(set(victims)) != len(victims):
            raise self._bad("eviction", "sagellm_select_victims", f"returned duplicate victims {victims}")
        stray = [v for v in victims if v not in candidates]
        if stray:
            raise self._bad(
                "eviction", "sagellm_select_victims", f"returned victims that are not evictable candidates: {stray[:8]}"
            )
        return victims

    def _make_room(self, num_blocks: int) -> bool:
        """Evict until ``num_blocks`` blocks are free; False if it cannot."""
        short = num_blocks - self.pool_usage().num_free_blocks
        while short > 0:
            candidates = self.evictable()
            if len(candidates) == 0:
                return False
            victims = self.select_victims(short, candidates)
            if not victims:
                return False
            short -= self._evict(victims)
        return True

    def _evict(self, victims: Sequence[int]) -> int:
        removed = self.remove_cached(victims)
        ids = [b.block_id for b in removed]
        if self.settings.offload_evicted:
            keys = tuple(b.key for b in removed)
            result = self.transfer(TransferPlan("device", "host", tuple(ids), self.block_size, block_keys=keys))
            if result is not None and result.ok and len(result.dst_block_ids) == len(keys):
                self._host.record(keys, result.dst_block_ids)
        self.free_blocks(ids)
        self.counters.evicted_blocks += len(ids)
        self.observe("sagellm_blocks_evicted", blocks=removed, now_s=self.now_s)
        return len(ids)

    def reset_prefix_cache(self) -> int:
        """Evict every evictable cached block, as the eviction policy orders
        them (offloaded with ``offload_evicted``); blocks that requests hold
        stay. Returns the blocks evicted."""
        evicted = 0
        while True:
            candidates = self.evictable()
            if len(candidates) == 0:
                return evicted
            victims = self.select_victims(len(candidates), candidates)
            if not victims:
                return evicted
            evicted += self._evict(victims)

    def transfer(self, plan: TransferPlan) -> TransferResult | None:
        result = self._call("transport", "sagellm_transfer_blocks", plan=plan)
        if result is None:
            return None
        if not isinstance(result, TransferResult):
            raise self._bad("transport", "sagellm_transfer_blocks", f"returned {result!r}, not a TransferResult")
        c = self.counters
        c.transfers += 1
        if result.ok:
            c.transferred_blocks += result.num_blocks
            c.transferred_bytes += result.num_bytes
            c.transfer_s += result.seconds
        else:
            c.transfer_failures += 1
        return result

    def allocate_blocks(self, num_blocks: int, request: Request | None) -> tuple[int, ...]:
        """Take ``num_blocks`` blocks from the pool (the caller made room),
        checked: exactly as many, distinct, in range, not in use."""
        if num_blocks == 0:
            return ()
        alloc = self._call("kv_pool", "sagellm_allocate_blocks", num_blocks=num_blocks, request=request)
        if not isinstance(alloc, BlockAllocation):
            raise self._bad("kv_pool", "sagellm_allocate_blocks", f"returned {alloc!r}, not a BlockAllocation")
        ids = alloc.block_ids
        if len(ids) != num_blocks:
            raise self._bad(
                "kv_pool", "sagellm_allocate_blocks",
                f"returned {len(ids)} blocks, asked for {num_blocks} with enough free",
            )
        if len(set(ids)) != len(ids):
            raise self._bad("kv_pool", "sagellm_allocate_blocks", f"returned duplicate blocks {ids}")
        bad = [b for b in ids if not (isinstance(b, int) and 0 <= b < self.num_blocks)]
        if bad:
            raise self._bad("kv_pool", "sagellm_allocate_blocks", f"returned block ids out of range: {bad[:8]}")
        busy = self._in_use.intersection(ids)
        if busy:
            raise self._bad("kv_pool", "sagellm_allocate_blocks", f"returned blocks already in use: {sorted(busy)[:8]}")
        self._in_use.update(ids)
        return ids

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the pool."""
        ids = tuple(block_ids)
        if not ids:
            return
        self._call("kv_pool", "sagellm_free_blocks", block_ids=ids)
        self._in_use.difference_update(ids)

    # --------------------------------------------------------- lifecycle --

    def predict_lifetime(self, request: Request) -> LifetimePrediction | None:
        """The lifetime plugin's prediction, checked. With ``[lifetime]
        fallback``, a predictor that raises or returns garbage is counted
        (``lifetime_fallbacks``; the first failure is kept, naming it) and the
        fallback answers instead, so no request is lost to it."""
        try:
            return self._checked_prediction(self._predict, request)
        except PluginError as exc:
            if self._predict_fallback is None:
                raise
            self.counters.lifetime_fallbacks += 1
            if self.counters.lifetime_failure is None:
                self.counters.lifetime_failure = str(exc)
            return self._checked_prediction(self._predict_fallback, request)

    def _checked_prediction(self, predictor: tuple[Any, str], request: Request) -> LifetimePrediction | None:
        caller, who = predictor
        prediction = self._call("lifetime", "sagellm_predict_lifetime", caller, request=request)
        if prediction is None:
            return None
        problem = (
            prediction.problem() if isinstance(prediction, LifetimePrediction) else "is not a LifetimePrediction"
        )
        if problem is not None:
            raise PluginError(f"{who} sagellm_predict_lifetime returned {prediction!r}: it {problem}")
        return prediction

    def arrive(self, request: Request) -> SequenceState:
        prediction = self.predict_lifetime(request)
        state = SequenceState(request=request, prediction=prediction)
        match = self.lookup(request)
        state.cached_tokens_hint = match.num_blocks * self.block_size
        self.observe("sagellm_request_arrived", request=request, prediction=prediction, match=match)
        return state

    def admit(self, state: SequenceState, token_budget: int, reserve_tokens: int = 0) -> int:
        """Match and lock ``state``'s prefix and allocate blocks for up to
        ``token_budget`` new tokens, and ``reserve_tokens`` more (room for
        decoding that an engine takes at admission, as LMDeploy's prefill
        does). Return the tokens scheduled, or 0 (nothing changed) when
        memory does not allow it."""
        request = state.request
        match = self.acquire_prefix(request)
        cached = match.num_blocks * self.block_size
        host_keys = self._on_host(request, match) if state.num_preemptions == 0 else ()
        loaded = len(host_keys) * self.block_size
        num_new = min(state.num_tokens - cached - loaded, token_budget)
        need = blocks_for(cached + loaded + num_new + reserve_tokens, self.block_size) - match.num_blocks
        free = self.pool_usage().num_free_blocks
        if num_new <= 0 or need > free + len(self.evictable()):
            # Roll back the lock: the policy was not told of it. But a match
            # may have pinned blocks the policy holds as evictable (radix
            # pin_after_hits): they are not evictable any more, so it is told.
            self.release_prefix(request)
            if match.blocks:
                pinned = self.pinned_blocks()
                kept = tuple(b for b in match.blocks if b.block_id in pinned)
                if kept:
                    self.observe("sagellm_blocks_touched", blocks=kept, now_s=self.now_s)
            return 0
        if match.blocks:
            # Before any eviction, so the policy never picks a locked block.
            self.observe("sagellm_blocks_touched", blocks=match.blocks, now_s=self.now_s)
        try:
            ids = self.allocate_blocks(need, request) if need <= free or self._make_room(need) else None
        except PluginError:
            self._unlock_after_touch(request)
            raise
        if ids is None:
            self._unlock_after_touch(request)
            return 0
        state.block_ids = [*match.block_ids, *ids]
        state.private_block_ids = set(ids)
        # Making room may have pushed some of them off a full host tier.
        host_keys = tuple(takewhile(self._host.__contains__, host_keys)) if host_keys else ()
        if host_keys and not self._load(host_keys, ids[: len(host_keys)]):
            num_new, host_keys = min(num_new + loaded, token_budget), ()  # compute them instead
        state.num_computed_tokens = cached + len(host_keys) * self.block_size
        state.status = RequestStatus.RUNNING
        self._active[request.request_id] = state
        self.count_admission(state, match.num_blocks, len(host_keys))
        return num_new

    def _on_host(self, request: Request, match: PrefixMatch) -> tuple:
        """Content keys of the prompt's blocks after the device match that the
        host tier holds (a run from the first one), leaving one token to
        compute. Empty without ``offload_evicted``, or without keys from the
        prefix cache (``sagellm_block_keys`` is optional)."""
        if not self._host:  # no tier, or nothing on it yet: no keys to compute
            return ()
        start, limit = match.num_blocks, (request.num_prompt_tokens - 1) // self.block_size
        if limit <= start:
            return ()

        def keys(end: int) -> tuple:
            return self._call("prefix_cache", "sagellm_block_keys", request=request, start=start, num_blocks=end) or ()

        first = keys(start + 1)  # most admissions stop at the first key
        if not first or first[0] not in self._host:
            return ()
        run = keys(limit) if limit > start + 1 else first
        return tuple(takewhile(self._host.__contains__, run[: limit - start]))

    def _load(self, keys: tuple, block_ids: Sequence[int]) -> bool:
        """Copy blocks back from the host tier into ``block_ids``."""
        plan = TransferPlan("host", "device", tuple(self._host.slots(keys)), self.block_size,
                            dst_block_ids=tuple(block_ids), block_keys=keys)
        result = self.transfer(plan)
        return result is not None and result.ok

    def count_admission(self, state: SequenceState, hit_blocks: int, host_blocks: int = 0) -> None:
        """Count a request admitted with ``hit_blocks`` of its prefix cached
        and the next ``host_blocks`` loaded from the host tier: its first
        admission in the hit rates, a later one (after preemption) as
        re-prefill."""
        request, c = state.request, self.counters
        cached = hit_blocks * self.block_size
        if state.num_preemptions == 0:
            c.host_hit_blocks += host_blocks
            query = blocks_for(request.num_prompt_tokens, self.block_size)
            c.query_blocks += query
            c.hit_blocks += hit_blocks
            c.lost_waiting_blocks += max(0, state.cached_tokens_hint // self.block_size - hit_blocks)
            tenant = c.tenant_blocks.setdefault(request.tenant, [0, 0])
            tenant[0] += query
            tenant[1] += hit_blocks
            c.query_tokens += request.num_prompt_tokens
            c.hit_tokens += cached
            c.query_token_pairs += request.num_prompt_tokens * (request.num_prompt_tokens + 1) // 2
            c.hit_token_pairs += cached * (cached + 1) // 2
            c.prefill_tokens += state.num_tokens - cached - host_blocks * self.block_size
        else:
            c.reprefill_tokens += state.num_tokens - cached

    def _unlock_after_touch(self, request: Request) -> None:
        released = self.release_prefix(request)
        if released:
            self.observe("sagellm_blocks_released", blocks=released, now_s=self.now_s)

    def grow(self, state: SequenceState, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of a running request."""
        need = blocks_for(state.num_computed_tokens + num_new_tokens, self.block_size) - len(state.block_ids)
        if need <= 0:
            return True
        if not self._make_room(need):
            return False
        ids = self.allocate_blocks(need, state.request)
        state.block_ids.extend(ids)
        state.private_block_ids.update(ids)
        return True

    def cache(self, state: SequenceState, output_token_ids: Sequence[int] | None = None) -> None:
        """Insert the request's computed full blocks into the prefix cache.
        ``output_token_ids`` are the tokens a real engine generated; without
        them, the workload's known output (``Request.output_token_ids``)."""
        request = state.request
        token_ids = request.prompt_token_ids
        outputs = request.output_token_ids if output_token_ids is None else output_token_ids
        if outputs is not None and state.num_output_tokens:
            token_ids = token_ids + as_token_array(outputs[: state.num_output_tokens])
        num_full = min(state.num_computed_tokens, len(token_ids)) // self.block_size
        if num_full == 0:
            return
        given = state.block_ids[:num_full]
        result = self.insert_prefix(request, token_ids[: num_full * self.block_size], given)
        if result is None:
            return
        position = {block_id: i for i, block_id in enumerate(given)}
        state.private_block_ids.difference_update(b.block_id for b in result.adopted)
        if result.replaced:
            for given_id, cached in result.replaced:
                state.block_ids[position[given_id]] = cached.block_id
                state.private_block_ids.discard(given_id)
            self.free_blocks(g for g, _ in result.replaced)
        if result.locked:
            self.observe("sagellm_blocks_touched", blocks=result.locked, now_s=self.now_s)
        if result.adopted:
            self.observe("sagellm_blocks_cached", blocks=result.adopted, now_s=self.now_s)

    def select_preemption(self, running: Sequence[SequenceState], needed_by: SequenceState) -> SequenceState:
        decision = self._call("eviction", "sagellm_select_preemption", running=running, needed_by=needed_by)
        if decision is None:
            return running[-1]  # vLLM's FCFS rule: the last one scheduled
        if isinstance(decision, PreemptionDecision):
            for state in running:
                if state.request_id == decision.request_id:
                    return state
        raise self._bad("eviction", "sagellm_select_preemption", f"returned {decision!r}, not a running request")

    def release(self, state: SequenceState) -> None:
        """Free the request's private blocks and drop its cache locks."""
        self.free_blocks(state.private_block_ids)
        released = self.release_prefix(state.request)
        state.block_ids = []
        state.private_block_ids = set()
        self._active.pop(state.request_id, None)
        if released:
            self.observe("sagellm_blocks_released", blocks=released, now_s=self.now_s)

    def schedule(self, ir: ScheduleIR) -> frozenset[str]:
        """Run the scheduling passes over ``ir``, in config order. A pass may
        reorder the lists and lower the budgets, never drop, duplicate or
        invent requests. Returns the names of the lists the passes reordered
        (``"waiting"``, ``"running"``), so an engine copies back only those."""
        before = {"waiting": list(ir.waiting), "running": list(ir.running)}
        self._call("scheduler", "sagellm_schedule_pass", ir=ir)
        moved = set()
        for name, was in before.items():
            now = getattr(ir, name)
            # SequenceState compares by identity, so == is a C-speed check
            # that nothing moved; only a reordered list needs the set check.
            if now == was:
                continue
            moved.add(name)
            if len(now) != len(was) or {id(s) for s in now} != {id(s) for s in was}:
                raise self._bad(
                    "scheduler", "sagellm_schedule_pass",
                    f"changed the set of {name} requests ({len(was)} -> {len(now)}); passes may only reorder",
                )
        if ir.token_budget <= 0 or ir.max_num_seqs <= 0:
            raise self._bad("scheduler", "sagellm_schedule_pass", "left no token budget or sequence slots")
        return frozenset(moved)

    def register_kv_caches(self, kv_caches: KVCaches) -> None:
        """An engine with real KV tensors tells the plugins where they are,
        once, before the first request (a transport copies their bytes)."""
        if kv_caches.num_blocks != self.num_blocks:
            raise ConfigError(
                f"{self.settings.path}: the engine's KV tensors hold {kv_caches.num_blocks} blocks,"
                f" [kv_pool] num_blocks is {self.num_blocks}"
            )
        self.observe("sagellm_kv_caches_allocated", kv_caches=kv_caches)

    def step_done(self, result: StepResult) -> None:
        self.observe("sagellm_step_done", result=result)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def preempt(self, state: SequenceState) -> None:
        self.release(state)
        state.num_computed_tokens = 0
        state.num_preemptions += 1
        state.status = RequestStatus.WAITING
        self.counters.preemptions += 1

    def reject(self, state: SequenceState) -> None:
        """A request that can never fit the pool."""
        state.status = RequestStatus.FINISHED
        self.counters.requests_rejected += 1

    def finish(self, state: SequenceState, output_token_ids: Sequence[int] | None = None) -> RequestOutcome:
        self.cache(state, output_token_ids)
        self.release(state)
        return self.conclude(state)

    def conclude(self, state: SequenceState) -> RequestOutcome:
        """Count and observe a finished request whose blocks are already
        returned (by :meth:`finish`, or by an engine that owns its blocks)."""
        state.status = RequestStatus.FINISHED
        outcome = RequestOutcome(
            request=state.request,
            num_output_tokens=state.num_output_tokens,
            num_cached_tokens=state.cached_tokens_hint,
            arrival_s=state.request.arrival_s,
            first_token_s=state.first_token_s if state.first_token_s is not None else self.now_s,
            finish_s=state.finish_s if state.finish_s is not None else self.now_s,
            num_preemptions=state.num_preemptions,
            prediction=state.prediction,
        )
        c = self.counters
        c.requests_finished += 1
        if state.prediction is not None:
            c.lifetime_predictions += 1
            c.lifetime_abs_error += abs(state.prediction.output_tokens - state.num_output_tokens)
        self.observe("sagellm_request_finished", outcome=outcome)
        return outcome

    # --------------------------------------------------------- invariants --

    def check_invariants(self) -> None:
        """Raise AssertionError if block accounting is inconsistent. O(blocks);
        for tests, not for the hot path."""
        usage = self.pool_usage()
        assert usage.num_free_blocks + len(self._in_use) == self.num_blocks, (
            f"pool reports {usage.num_free_blocks} free, runtime holds {len(self._in_use)} of {self.num_blocks}"
        )
        private: set[int] = set()
        referenced: set[int] = set()
        for state in self._active.values():
            assert not (private & state.private_block_ids), "a private block is owned twice"
            private |= state.private_block_ids
            referenced.update(b for b in state.block_ids if b not in state.private_block_ids)
            assert set(state.block_ids) <= self._in_use, "a request holds a free block"
        assert not (private & self._cached), "a block is both private and cached"
        assert private | self._cached == self._in_use, "a block is leaked (in use, owned by nobody)"
        evictable = set(self.evictable())
        pinned = set(self.pinned_blocks())
        assert evictable <= self._cached, "an evictable block is not cached"
        assert not (evictable & referenced), "a block held by a request is evictable"
        assert not (evictable & pinned), "a pinned block is evictable"
        assert evictable | referenced | pinned == self._cached, "a cached block is neither held, pinned nor evictable"
