"""The request-lifecycle runtime: engine-agnostic, it owns the loop's block
accounting and asks plugins (through :mod:`sagellm_core.plugin_host`'s checked
calls) for every decision. Engine drivers use only the API below; none
writes counters or names a hook.

A driver whose blocks the runtime owns (the replay and torch engines)::

    rt.set_time(now_s)                      # the clock: simulated or real
    state = rt.arrive(request)              # predict lifetime, match, observe
    rt.decide_admission(state)              # admit, defer or reject (a plugin's rule)
    n = rt.admit(state, token_budget)       # lock the prefix, allocate, count
    rt.grow(state, n)                       # more blocks as the sequence grows
    rt.cache(state)                         # insert full blocks into the cache
    rt.preempt(state) / rt.finish(state)    # release, free, observe
    rt.reject(state, reason)                # a request that can never run

A driver whose engine keeps its own blocks (vLLM's pool, LMDeploy's trie)
reports what the engine did instead: ``count_admission`` (hits, host hits),
``blocks_cached`` / ``_touched`` / ``_released`` / ``_evicted``, and
``conclude`` when a request is done.

Which :class:`SequenceState` fields each side writes, its docstring says.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

from sagellm_core.config import Settings
from sagellm_core.errors import ConfigError, PluginError, RequestError
from sagellm_core.parts import answers, compaction, invariants
from sagellm_core.parts.counters import Counters as Counters
from sagellm_core.parts.tiers import HostTier
from sagellm_core.plugin_host import PluginHost
from sagellm_core.types import (
    Admission,
    AdmissionDecision,
    CachedBlock,
    EvictionCandidates,
    KVCaches,
    LifetimePrediction,
    PrefixMatch,
    Request,
    RequestOutcome,
    RequestStatus,
    SequenceState,
    TenantLedger,
    TransferPlan,
    TransferResult,
    as_token_array,
)

ADMITTED = AdmissionDecision(Admission.ADMIT)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Runtime(PluginHost):
    """The lifecycle over :class:`PluginHost`. ``engine_owns`` names the
    sections an engine serves itself; the block lifecycle below is then the
    engine's, reported through the observation methods."""

    def __init__(self, settings: Settings, **kwargs: Any):
        # The keywords are PluginHost's: hook_timing, engine_owns, future_requests.
        if settings.kv_pool is None and "kv_pool" not in kwargs.get("engine_owns", ()):
            raise ConfigError(
                f"{settings.path}: [kv_pool]: missing key 'plugin'"
                f" (engine {settings.engine.name!r} allocates blocks through it)"
            )
        super().__init__(settings, **kwargs)
        self._now_s = 0.0
        self._active: dict[str, SequenceState] = {}
        self._tenant_blocks: dict[str, int] = {}
        self._tenant_requests: dict[str, int] = {}
        #: What each tenant's admitted requests hold, for admission plugins.
        self.tenant_ledger = TenantLedger(
            MappingProxyType(self._tenant_blocks), MappingProxyType(self._tenant_requests)
        )
        self._host = HostTier(self) if settings.offload_evicted else None
        #: Whether the pool compacts (``compact``, once a step).
        self.compacts = compaction.compacts(self)
        if "kv_pool" in self.engine_owns:
            return
        usage = self.pool_usage()
        if usage.num_blocks != self.num_blocks or usage.num_free_blocks != self.num_blocks:
            raise PluginError(
                f"{self.who('kv_pool')} reports {usage.num_free_blocks}/{usage.num_blocks} free"
                f" blocks at start; the config asks for {self.num_blocks}"
            )

    @property
    def now_s(self) -> float:
        """The driver's clock: simulated seconds in replay, the engine's time
        in a live engine. Observations carry it."""
        return self._now_s

    def set_time(self, now_s: float) -> None:
        self._now_s = now_s

    def blocks_cached(self, blocks: tuple[CachedBlock, ...]) -> None:
        """The engine cached these blocks (they are referenced by a request)."""
        if blocks:
            self._observe("sagellm_blocks_cached", blocks=blocks, now_s=self._now_s)

    def blocks_touched(self, blocks: tuple[CachedBlock, ...]) -> None:
        """These cached blocks were hit or locked: not evictable until released."""
        if blocks:
            self._observe("sagellm_blocks_touched", blocks=blocks, now_s=self._now_s)

    def blocks_released(self, blocks: tuple[CachedBlock, ...], request: Request | None = None) -> None:
        """No request holds these cached blocks any more (``request`` let go of them last, where known)."""
        if blocks:
            self._observe("sagellm_blocks_released", blocks=blocks, now_s=self._now_s, request=request)

    def blocks_evicted(self, blocks: tuple[CachedBlock, ...]) -> None:
        """These blocks left the cache (counted as evictions)."""
        if blocks:
            self.counters.evicted_blocks += len(blocks)
            self._observe("sagellm_blocks_evicted", blocks=blocks, now_s=self._now_s)

    def transfer(self, plan: TransferPlan) -> TransferResult | None:
        """The transport's transfer, checked and counted."""
        result = self._checked_transfer(plan)
        if result is None:
            return None
        c = self.counters
        c.transfers += 1
        if result.ok:
            c.transferred_blocks += result.num_blocks
            c.transferred_bytes += result.num_bytes
            c.transfer_s += result.seconds
        else:
            c.transfer_failures += 1
        return result

    def predict_lifetime(self, request: Request) -> LifetimePrediction | None:
        """The lifetime plugin's prediction, checked. With ``[lifetime]
        fallback``, a predictor that raises or returns garbage is counted
        (``lifetime_fallbacks``; the first failure is kept, naming it) and the
        fallback answers instead, so no request is lost to it."""
        if "lifetime" not in self.plugins:
            return None
        try:
            return self._checked_prediction(self._predict, request)
        except PluginError as exc:
            if self._predict_fallback is None:
                raise
            self.counters.lifetime_fallbacks += 1
            if self.counters.lifetime_failure is None:
                self.counters.lifetime_failure = str(exc)
            return self._checked_prediction(self._predict_fallback, request)

    def _num_free(self) -> int:
        # Counted here when the runtime takes its pool's blocks (the pool's own
        # report is held to it at the end of a run): no hook call per block grown.
        owned = "kv_pool" in self.engine_owns
        return self.pool_usage().num_free_blocks if owned else self.num_blocks - len(self._in_use)

    def _make_room(self, num_blocks: int, candidates: EvictionCandidates | None = None) -> bool:
        """Evict until ``num_blocks`` blocks are free; False if it cannot."""
        short = num_blocks - self._num_free()
        return short <= 0 or self._evict_upto(short, candidates) >= short

    def _evict_upto(self, num_blocks: int | None, candidates: EvictionCandidates | None = None) -> int:
        """Evict up to ``num_blocks`` blocks (``None``: every evictable one) as the
        policy chooses (first from ``candidates``, just asked); return the blocks evicted."""
        evicted = 0
        while num_blocks is None or evicted < num_blocks:
            candidates = self.evictable() if candidates is None or evicted else candidates
            if len(candidates) == 0:
                break
            victims = self.select_victims(len(candidates) if num_blocks is None else num_blocks - evicted, candidates)
            if not victims:
                break
            evicted += self._evict(victims)
        return evicted

    def _evict(self, victims: Sequence[int]) -> int:
        removed = self.remove_cached(victims)
        ids = [b.block_id for b in removed]
        try:
            if self._host is not None and not self._host.offload(removed):
                self.counters.host_bypassed_blocks += len(removed)
        finally:  # a transport that raised leaks no block
            self.free_blocks(ids)
            self.blocks_evicted(removed)
        return len(ids)

    def compact(self) -> int:
        """Let a compacting pool move cached blocks to rejoin free runs (an
        engine calls it once a step); return the blocks moved."""
        return compaction.compact(self) if self.compacts else 0

    def reset_prefix_cache(self) -> int:
        """Evict every evictable cached block, as the eviction policy orders
        them (offloaded with ``offload_evicted``); blocks that requests hold
        stay. Returns the blocks evicted."""
        return self._evict_upto(None)

    @property
    def observes_arrivals(self) -> bool:
        """Whether a plugin observes arrivals (and their matched blocks)."""
        return self.dispatch.implemented("sagellm_request_arrived")

    def arrive(self, request: Request, match: PrefixMatch | int | None = None) -> SequenceState:
        """A new request: its lifetime predicted, its cached prefix looked up
        (or ``match``, where the engine matched it itself: its blocks, or only
        how many unless a plugin ``observes_arrivals``), observed."""
        prediction = self.predict_lifetime(request)
        state = SequenceState(request=request, prediction=prediction)
        if match is None:
            match = self.lookup(request)
        if isinstance(match, int) and self.observes_arrivals:
            raise RequestError(f"request {request.request_id!r}: arrival observers need the matched blocks")
        state.cached_tokens_hint = (match if isinstance(match, int) else match.num_blocks) * self.block_size
        self._observe("sagellm_request_arrived", request=request, prediction=prediction, match=match)
        return state

    @property
    def decides_admission(self) -> bool:
        """Whether an admission plugin decides (else every request is admitted)."""
        return "admission" in self.plugins

    def decide_admission(self, state: SequenceState) -> AdmissionDecision:
        """The admission plugin's decision for the waiting ``state``, checked
        and counted (``None`` admits)."""
        hook, available = "sagellm_admit_request", self._num_free() + len(self.evictable())
        kwargs = {"ledger": self.tenant_ledger, "running": self._active.values(), "available_blocks": available}
        decision = self._call("admission", hook, state=state, now_s=self._now_s, **kwargs)
        if decision is None:
            return ADMITTED
        self._checked("admission", hook, decision, answers.admission(decision))
        if decision.verdict is Admission.DEFER:
            self.counters.count_deferral(state.request.tenant)
        elif decision.verdict is Admission.REJECT:
            self.counters.admission_rejections += 1
        return decision  # type: ignore[no-any-return]

    def admit(self, state: SequenceState, token_budget: int, reserve_tokens: int = 0) -> int:
        """Match and lock ``state``'s prefix and allocate blocks for up to
        ``token_budget`` new tokens, and ``reserve_tokens`` more (room for
        decoding that an engine takes at admission, as LMDeploy's prefill
        does). Return the tokens scheduled, or 0 (nothing changed) when
        memory does not allow it."""
        request = state.request
        if self._active.get(request.request_id, state) is not state:
            raise RequestError(
                f"request id {request.request_id!r} arrived while another request with that id is in flight;"
                " request ids must be unique (the workload or the engine driver repeats one)"
            )
        match = self.acquire_prefix(request)
        cached = match.num_blocks * self.block_size
        host = self._host if state.num_preemptions == 0 else None
        try:
            host_keys = host.keys_after(request, match) if host is not None else ()
        except PluginError:  # nothing observed yet: the lock rolls back
            self.release_prefix(request)
            raise
        loaded = len(host_keys) * self.block_size
        num_new = min(state.num_tokens - cached - loaded, token_budget)
        need = blocks_for(cached + loaded + num_new + reserve_tokens, self.block_size) - match.num_blocks
        free = self._num_free()
        candidates = self.evictable() if need > free else None  # asked once, for the check and the first round
        if num_new <= 0 or (candidates is not None and need > free + len(candidates)):
            # Roll back the lock: the policy was not told of it. But a match
            # may have pinned blocks the policy holds as evictable (radix
            # pin_after_hits): they are not evictable any more, so it is told.
            self.release_prefix(request)
            if match.blocks:
                pinned = self.pinned_blocks()
                kept = tuple(b for b in match.blocks if b.block_id in pinned)
                self.blocks_touched(kept)
            return 0
        # Before any eviction, so the policy never picks a locked block.
        self.blocks_touched(match.blocks)
        try:
            ids = self.allocate_blocks(need, request) if need <= free or self._make_room(need, candidates) else None
        except PluginError:
            self._unlock_after_touch(request)
            raise
        if ids is None:
            self._unlock_after_touch(request)
            return 0
        try:
            if host is not None and host_keys:
                host_keys = host.still_held(host_keys)  # making room may have pushed some off a full tier
            if host is not None and host_keys and not host.load(host_keys, ids[: len(host_keys)]):
                num_new, host_keys = min(num_new + loaded, token_budget), ()  # compute them instead
        except PluginError:  # a transport that raised: nothing changed
            self.free_blocks(ids)
            self._unlock_after_touch(request)
            raise
        state.block_ids = [*match.block_ids, *ids]
        state.private_block_ids = set(ids)
        self._taken.update(match.block_ids)  # the holders of cached blocks, the ground truth of removals
        state.num_computed_tokens = cached + len(host_keys) * self.block_size
        state.status = RequestStatus.RUNNING
        self._active[request.request_id] = state
        tenant = request.tenant
        self._tenant_blocks[tenant] = self._tenant_blocks.get(tenant, 0) + len(state.block_ids)
        self._tenant_requests[tenant] = self._tenant_requests.get(tenant, 0) + 1
        self.count_admission(state, match.num_blocks, len(host_keys))
        return num_new

    def count_admission(self, state: SequenceState, hit_blocks: int, host_blocks: int = 0) -> None:
        """Count a request admitted with ``hit_blocks`` of its prefix cached
        and the next ``host_blocks`` loaded from the host tier: its first
        admission in the hit rates (and in its ``num_cached_tokens``), a
        later one (after preemption) as re-prefill."""
        if state.num_preemptions == 0:
            state.num_cached_tokens = (hit_blocks + host_blocks) * self.block_size
        self.counters.count_admission(state, hit_blocks, host_blocks, self.block_size)

    def _unlock_after_touch(self, request: Request) -> None:
        self.blocks_released(self.release_prefix(request), request)

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
        self._tenant_blocks[state.request.tenant] += need
        return True

    def cache(self, state: SequenceState, output_token_ids: Sequence[int] | None = None) -> None:
        """Insert the request's computed full blocks into the prefix cache.
        ``output_token_ids`` are the tokens a real engine generated; without
        them, the workload's known output (``Request.output_token_ids``)."""
        request = state.request
        token_ids = request.prompt_token_ids
        outputs = request.output_token_ids if output_token_ids is None else output_token_ids
        if outputs is not None and state.num_output_tokens:
            generated = as_token_array(outputs[: state.num_output_tokens])
            assert generated is not None
            token_ids = token_ids + generated
        num_full = min(state.num_computed_tokens, len(token_ids)) // self.block_size
        if num_full == 0:
            return
        given, whole = state.block_ids[:num_full], len(token_ids) // self.block_size == num_full  # whole: no copy
        result = self.insert_prefix(request, token_ids if whole else token_ids[: num_full * self.block_size], given)
        if result is None:
            return
        state.private_block_ids.difference_update(adopted := [b.block_id for b in result.adopted])
        self._taken.update(adopted + [b.block_id for _, b in result.replaced] if result.replaced else adopted)
        position = {block_id: i for i, block_id in enumerate(given)} if result.replaced else {}
        for given_id, cached in result.replaced:
            state.block_ids[position[given_id]] = cached.block_id
            state.private_block_ids.discard(given_id)
        self.free_blocks(g for g, _ in result.replaced)
        self.blocks_touched(result.locked)
        self.blocks_cached(result.adopted)

    def release(self, state: SequenceState) -> None:
        """Free the request's private blocks and drop its cache locks."""
        released = self.release_prefix(state.request)  # first: a plugin that raises here changed nothing of ours
        private = state.private_block_ids
        self.free_blocks(private)
        held = state.block_ids
        shared = held[: len(held) - len(private)]  # the cached blocks come first
        self._returned.update(shared if private.isdisjoint(shared) else [b for b in held if b not in private])
        if self._active.pop(state.request_id, None) is not None:
            tenant = state.request.tenant
            self._tenant_blocks[tenant] -= len(held)
            self._tenant_requests[tenant] -= 1
        state.block_ids = []
        state.private_block_ids = set()
        self.blocks_released(released, state.request)

    def register_kv_caches(self, kv_caches: KVCaches) -> None:
        """An engine with real KV tensors tells the plugins where they are,
        once, before the first request (a transport copies their bytes)."""
        if kv_caches.num_blocks != self.num_blocks:
            raise ConfigError(
                f"{self.settings.path}: the engine's KV tensors hold {kv_caches.num_blocks} blocks,"
                f" [kv_pool] num_blocks is {self.num_blocks}"
            )
        self._observe("sagellm_kv_caches_allocated", kv_caches=kv_caches)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def preempt(self, state: SequenceState) -> None:
        self.release(state)
        state.num_computed_tokens = 0
        state.num_preemptions += 1
        state.status = RequestStatus.WAITING
        self.counters.preemptions += 1

    def reject(self, state: SequenceState, reason: str = "never fits the pool") -> None:
        """A request that can never run, counted with ``reason``."""
        state.status = RequestStatus.FINISHED
        self.counters.count_rejection(reason)

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
            num_cached_tokens=state.num_cached_tokens,
            arrival_s=state.request.arrival_s,
            first_token_s=state.first_token_s if state.first_token_s is not None else self.now_s,
            finish_s=state.finish_s if state.finish_s is not None else self.now_s,
            num_preemptions=state.num_preemptions,
            prediction=state.prediction,
        )
        self.counters.count_finish(state)
        self._observe("sagellm_request_finished", outcome=outcome)
        return outcome

    #: Raise AssertionError if block accounting is inconsistent. O(blocks);
    #: for tests and the end of a run, not for the hot path.
    check_invariants = invariants.check

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished or preempted."""
        return len(self._active)
