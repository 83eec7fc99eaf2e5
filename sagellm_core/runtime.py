"""The request-lifecycle runtime, composed of three parts: the block ledger
(:mod:`sagellm_core.ledger`: the ground truth of blocks), the plugin host
(:mod:`sagellm_core.plugin_host`: the plugins, every answer checked against
the ledger) and the KV stores below the device pool
(:mod:`sagellm_core.stores`). The runtime is the lifecycle over them:
engine-agnostic, it owns the loop's block accounting and asks plugins for
every decision. Engine drivers use only the API below (``docs/plugin-guide.md``
lists it, and ``tests/core/test_drivers.py`` holds the class to that list);
none writes counters or names a hook.

A driver whose blocks the runtime owns (the replay and torch engines)::

    rt.set_time(now_s)                      # the clock: simulated or real
    state = rt.arrive(request)              # predict lifetime, match, observe
    rt.decide_admission(state)              # admit, defer or reject (a plugin's rule)
    n = rt.admit(state, token_budget)       # plan (lock the prefix, ask the stores), commit (allocate, load)
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

from collections.abc import Collection, Sequence
from typing import Any

from attrs import frozen

from sagellm_core import compaction
from sagellm_core.config import Settings
from sagellm_core.counters import Counters
from sagellm_core.errors import ConfigError, PluginError, RequestError
from sagellm_core.ledger import BlockLedger
from sagellm_core.plugin_host import PluginHost
from sagellm_core.stores import ExternalRun, StoreTiers
from sagellm_core.timing import HookTimer
from sagellm_core.types import (
    Admission,
    AdmissionDecision,
    CachedBlock,
    EvictionCandidates,
    KVCaches,
    LifetimePrediction,
    LoadCosts,
    PoolUsage,
    PrefixMatch,
    Request,
    RequestOutcome,
    RequestStatus,
    ScheduleIR,
    SequenceState,
    TransferPlan,
    TransferResult,
    as_token_array,
)

ADMITTED = AdmissionDecision(Admission.ADMIT)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@frozen
class AdmissionPlan:
    """An admission decided and not yet done (:meth:`Runtime.plan_admission`):
    the prefix matched and locked, the blocks stores can provide after it,
    the tokens to compute and the blocks to take."""

    state: SequenceState
    match: PrefixMatch
    external: tuple[ExternalRun, ...]
    #: Runs a store holds that are computed instead (loading them is slower).
    recomputed: tuple[ExternalRun, ...]
    num_new_tokens: int
    num_blocks: int
    num_free_blocks: int
    candidates: EvictionCandidates | None
    token_budget: int


class Runtime:
    """The lifecycle over a :class:`BlockLedger`, a :class:`PluginHost` and
    the :class:`StoreTiers`. ``engine_owns`` names the sections an engine
    serves itself; the block lifecycle is then the engine's, reported
    through the observation methods. The keywords are the plugin host's:
    ``hook_timing``, ``engine_owns``, ``future_requests``."""

    def __init__(self, settings: Settings, **kwargs: Any):
        if settings.kv_pool is None and "kv_pool" not in kwargs.get("engine_owns", ()):
            raise ConfigError(
                f"{settings.path}: [kv_pool]: missing key 'plugin'"
                f" (engine {settings.engine.name!r} allocates blocks through it)"
            )
        self.settings = settings
        self.block_size = settings.block_size
        self.num_blocks = settings.num_blocks
        #: What the runtime counts; the report is built from these (read them, never write).
        self.counters = Counters()
        self.ledger = BlockLedger(settings.num_blocks)
        self.host = PluginHost(settings, self.ledger, self.counters, **kwargs)
        self.engine_owns = self.host.engine_owns
        self.stores = StoreTiers(self.host)
        #: Whether the pool compacts (``compact``, once a step), and sets blocks aside (``sagellm_reserved_blocks``).
        self.compacts = compaction.compacts(self.host)
        self.reserves = "kv_pool" not in self.engine_owns and self.host.observes("sagellm_reserved_blocks")
        self._now_s = 0.0
        if "kv_pool" in self.engine_owns:
            if self.stores:
                raise ConfigError(
                    f"{settings.path}: [kv_stores]: engine {settings.engine.name!r} keeps its own blocks;"
                    " its host tier is its KV connector (plugins/sagellm-plugin-*/README.md)"
                )
            return
        usage = self.pool_usage()
        if usage.num_blocks != self.num_blocks or usage.num_free_blocks != self.num_blocks:
            raise PluginError(
                f"{self.host.who('kv_pool')} reports {usage.num_free_blocks}/{usage.num_blocks} free"
                f" blocks at start; the config asks for {self.num_blocks}"
            )

    # -------------------------------------------------------------- time --

    @property
    def now_s(self) -> float:
        """The driver's clock: simulated seconds in replay, the engine's time
        in a live engine. Observations carry it."""
        return self._now_s

    def set_time(self, now_s: float) -> None:
        self._now_s = now_s

    # ---------------------------------------- what it holds now (read-only) --

    @property
    def timer(self) -> HookTimer | None:
        """The hook timer (``[report] hook_timing``), if on."""
        return self.host.timer

    def pool_usage(self) -> PoolUsage:
        return self.host.pool_usage()

    def evictable(self) -> EvictionCandidates:
        return self.host.evictable()

    def pinned_blocks(self) -> Collection[int]:
        return self.host.pinned_blocks()

    @property
    def num_cached_blocks(self) -> int:
        return len(self.ledger.cached)

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished or preempted."""
        return len(self.ledger.active)

    @property
    def observes_arrivals(self) -> bool:
        """Whether a plugin observes arrivals (and their matched blocks)."""
        return self.host.observes("sagellm_request_arrived")

    @property
    def decides_admission(self) -> bool:
        """Whether an admission plugin decides (else every request is admitted)."""
        return "admission" in self.host.plugins

    def check_invariants(self) -> None:
        """Raise AssertionError if block accounting is inconsistent. O(blocks);
        for tests and the end of a run, not for the hot path."""
        pool_is_ours = "kv_pool" not in self.engine_owns
        self.ledger.check(self.pool_usage(), self.evictable(), self.pinned_blocks(), pool_is_ours=pool_is_ours)

    # ---------------------------------------------------------- decisions --

    def schedule(self, ir: ScheduleIR) -> frozenset[str]:
        """Run the scheduling passes over ``ir`` (checked: they only reorder)."""
        return self.host.schedule(ir)

    def select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> tuple[int, ...]:
        return self.host.select_victims(num_blocks, candidates)

    def select_preemption(self, running: Sequence[SequenceState], needed_by: SequenceState) -> SequenceState:
        return self.host.select_preemption(running, needed_by)

    def predict_lifetime(self, request: Request) -> LifetimePrediction | None:
        return self.host.predict_lifetime(request)

    def decide_admission(self, state: SequenceState) -> AdmissionDecision:
        """The admission plugin's decision for the waiting ``state``, checked
        and counted (``None`` admits)."""
        decision = self.host.admit_request(state, self._now_s, self._num_free() + len(self.evictable()))
        if decision is None:
            return ADMITTED
        if decision.verdict is Admission.DEFER:
            self.counters.count_deferral(state.request.tenant)
        elif decision.verdict is Admission.REJECT:
            self.counters.admission_rejections += 1
        return decision

    # ---------------------------------------------- observations of blocks --

    def blocks_cached(self, blocks: tuple[CachedBlock, ...]) -> None:
        """The engine cached these blocks (they are referenced by a request)."""
        if blocks:
            self.host.observe("sagellm_blocks_cached", blocks=blocks, now_s=self._now_s)

    def blocks_touched(self, blocks: tuple[CachedBlock, ...]) -> None:
        """These cached blocks were hit or locked: not evictable until released."""
        if blocks:
            self.host.observe("sagellm_blocks_touched", blocks=blocks, now_s=self._now_s)

    def blocks_released(self, blocks: tuple[CachedBlock, ...], request: Request | None = None) -> None:
        """No request holds these cached blocks any more (``request`` let go of them last, where known)."""
        if blocks:
            self.host.observe("sagellm_blocks_released", blocks=blocks, now_s=self._now_s, request=request)

    def blocks_evicted(self, blocks: tuple[CachedBlock, ...]) -> None:
        """These blocks left the cache (counted as evictions)."""
        if blocks:
            self.counters.evicted_blocks += len(blocks)
            self.host.observe("sagellm_blocks_evicted", blocks=blocks, now_s=self._now_s)

    # ------------------------------------------------------------ KV memory --

    def register_kv_caches(self, kv_caches: KVCaches) -> None:
        """An engine with real KV tensors tells the plugins where they are,
        once, before the first request (the stores copy their bytes)."""
        if kv_caches.num_blocks != self.num_blocks:
            raise ConfigError(
                f"{self.settings.path}: the engine's KV tensors hold {kv_caches.num_blocks} blocks,"
                f" [kv_pool] num_blocks is {self.num_blocks}"
            )
        self.stores.kv = kv_caches
        self.host.observe("sagellm_kv_caches_allocated", kv_caches=kv_caches)

    def set_load_costs(self, costs: LoadCosts) -> None:
        """The engine's costs of loading a store's blocks against computing
        them (:class:`~sagellm_core.types.LoadCosts`): with ``[kv_stores]
        load_or_recompute`` a run is loaded only where that is faster, and
        the loads' seconds are counted per store (``load_s``)."""
        self.stores.costs = costs

    def transfer(self, plan: TransferPlan) -> TransferResult | None:
        """The transport's transfer (an engine's KV connector), checked and counted."""
        result = self.host.transfer_blocks(plan)
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

    def compact(self) -> int:
        """Let a compacting pool move cached blocks to rejoin free runs (an
        engine calls it once a step); return the blocks moved."""
        return compaction.compact(self.host, self.ledger, self.counters, self._now_s) if self.compacts else 0

    def reset_prefix_cache(self) -> int:
        """Evict every evictable cached block, as the eviction policy orders
        them (offered to the KV stores); blocks that requests hold stay.
        Returns the blocks evicted."""
        return self._evict_upto(None)

    # ----------------------------------------------------------- requests --

    def arrive(self, request: Request, match: PrefixMatch | int | None = None) -> SequenceState:
        """A new request: its lifetime predicted, its cached prefix looked up
        (or ``match``, where the engine matched it itself: its blocks, or only
        how many unless a plugin ``observes_arrivals``), observed."""
        prediction = self.predict_lifetime(request)
        state = SequenceState(request=request, prediction=prediction)
        if match is None:
            match = self.host.lookup(request)
        if isinstance(match, int) and self.observes_arrivals:
            raise RequestError(f"request id {request.request_id!r}: arrival observers need the matched blocks")
        state.cached_tokens_hint = (match if isinstance(match, int) else match.num_blocks) * self.block_size
        self.host.observe("sagellm_request_arrived", request=request, prediction=prediction, match=match)
        if self.stores.prefetching:
            self.prefetch(state)
        return state

    def prefetch(self, state: SequenceState) -> int:
        """Start moving the waiting ``state``'s prompt blocks that the KV
        stores hold (past its device match) up to where they load fastest,
        each store's ``prefetch``, so the copies overlap its wait; at its
        admission they are loaded (or, not ready, counted late; not loaded,
        wasted). Called at arrival under ``[kv_stores] prefetch``, and by
        anything else that knows a request's prefix is worth bringing up (a
        client's hint). Once a request; returns the blocks set moving."""
        request = state.request
        waiting = state.status is RequestStatus.WAITING and not state.num_preemptions  # a recompute computes
        if not self.stores or not waiting or self.stores.prefetch_started(request.request_id):
            return 0
        runs = self.stores.match(request, state.cached_tokens_hint // self.block_size)
        self.stores.start_prefetch(request.request_id, runs, self._now_s)
        return sum(len(run.keys) for run in runs)

    def admit(self, state: SequenceState, token_budget: int, reserve_tokens: int = 0) -> int:
        """Match and lock ``state``'s prefix and allocate blocks for up to
        ``token_budget`` new tokens, and ``reserve_tokens`` more (room for
        decoding that an engine takes at admission, as LMDeploy's prefill
        does): :meth:`plan_admission`, then :meth:`commit_admission`. Return
        the tokens scheduled, or 0 (nothing changed) when memory does not
        allow it."""
        plan = self.plan_admission(state, token_budget, reserve_tokens)
        return 0 if plan is None else self.commit_admission(plan)

    def plan_admission(self, state: SequenceState, token_budget: int, reserve_tokens: int = 0) -> AdmissionPlan | None:
        """The first half of :meth:`admit`: match and lock the prefix, ask
        the stores how many of the next blocks they can provide (at a first
        admission: a recompute after preemption computes), and check that
        the blocks fit (free, or evictable). ``None``, the lock rolled back,
        when they do not."""
        request, host = state.request, self.host
        if self.ledger.active.get(request.request_id, state) is not state:
            raise RequestError(
                f"request id {request.request_id!r} arrived while another request with that id is in flight;"
                " request ids must be unique (the workload or the engine driver repeats one)"
            )
        match = host.acquire_prefix(request)
        cached = match.num_blocks * self.block_size
        external: tuple[ExternalRun, ...] = ()
        recomputed: tuple[ExternalRun, ...] = ()
        if self.stores and not state.num_preemptions:
            try:
                held = self.stores.match(request, match.num_blocks)
                external, recomputed = self.stores.worth_loading(
                    request.request_id, held, match.num_blocks, self._now_s
                )
            except PluginError:  # nothing observed yet: the lock rolls back
                host.release_prefix(request)
                raise
        loaded = sum(len(run.keys) for run in external) * self.block_size
        num_new = min(state.num_tokens - cached - loaded, token_budget)
        need = blocks_for(cached + loaded + num_new + reserve_tokens, self.block_size) - match.num_blocks
        free = self._num_free()
        candidates = self.evictable() if need > free else None  # asked once, for the check and the first round
        if num_new > 0 and (candidates is None or need <= free + len(candidates)):
            return AdmissionPlan(state, match, external, recomputed, num_new, need, free, candidates, token_budget)
        # Roll back the lock: the policy was not told of it. But a match may
        # have pinned blocks the policy holds as evictable (radix
        # pin_after_hits): they are not evictable any more, so it is told.
        host.release_prefix(request)
        if match.blocks:
            pinned = self.pinned_blocks()
            self.blocks_touched(tuple(b for b in match.blocks if b.block_id in pinned))
        return None

    def commit_admission(self, plan: AdmissionPlan) -> int:
        """The second half of :meth:`admit`: make room (evicting), take the
        blocks, load the stores' blocks into them (checked), and start the
        request. Returns the tokens scheduled, or 0 (the lock released) when
        the eviction policy did not free enough."""
        state, match, need, request = plan.state, plan.match, plan.num_blocks, plan.state.request
        # Before any eviction, so the policy never picks a locked block.
        self.blocks_touched(match.blocks)
        try:
            fits = need <= plan.num_free_blocks and not self.reserves or self._make_room(need, plan.candidates, request)
            ids = self.host.allocate_blocks(need, request) if fits else None
        except PluginError:
            self._unlock_after_touch(request)
            raise
        if ids is None:
            self._unlock_after_touch(request)
            return 0
        num_new, stores = plan.num_new_tokens, self.stores
        try:
            loading = plan.external or stores.prefetch_started(request.request_id)
            held, loaded = stores.load(request.request_id, plan.external, ids, self._now_s) if loading else (0, 0)
            for run in plan.recomputed:
                stores.counters[run.tier].recomputed_blocks += len(run.keys)
            if loaded < held:  # the rest failed their check: computed instead
                num_new = min(num_new + (held - loaded) * self.block_size, plan.token_budget)
            if stores.tracks_hits and match.blocks:
                stores.hit(match.blocks)
        except PluginError:  # a store that raised: nothing changed
            self.host.free_blocks(ids)
            self._unlock_after_touch(request)
            raise
        stores.admitted(request.request_id)
        state.block_ids = [*match.block_ids, *ids]
        state.private_block_ids = set(ids)
        state.num_computed_tokens = (match.num_blocks + loaded) * self.block_size
        state.status = RequestStatus.RUNNING
        self.ledger.start(state, match.block_ids)
        self.count_admission(state, match.num_blocks, loaded)
        return num_new

    def count_admission(self, state: SequenceState, hit_blocks: int, host_blocks: int = 0) -> None:
        """Count a request admitted with ``hit_blocks`` of its prefix cached
        and the next ``host_blocks`` loaded from below the device (a KV store,
        an engine's connector): its first admission in the hit rates (and in
        its ``num_cached_tokens``), a later one (after preemption) as
        re-prefill."""
        if state.num_preemptions == 0:
            state.num_cached_tokens = (hit_blocks + host_blocks) * self.block_size
        self.counters.count_admission(state, hit_blocks, host_blocks, self.block_size)

    def grow(self, state: SequenceState, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of a running request."""
        need = blocks_for(state.num_computed_tokens + num_new_tokens, self.block_size) - len(state.block_ids)
        if need <= 0:
            return True
        if not self._make_room(need, request=state.request):
            return False
        ids = self.host.allocate_blocks(need, state.request)
        state.block_ids.extend(ids)
        state.private_block_ids.update(ids)
        self.ledger.grew(state, need)
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
        result = self.host.insert_prefix(
            request, token_ids if whole else token_ids[: num_full * self.block_size], given
        )
        if result is None:
            return
        state.private_block_ids.difference_update(adopted := [b.block_id for b in result.adopted])
        self.ledger.taken.update(adopted + [b.block_id for _, b in result.replaced] if result.replaced else adopted)
        position = {block_id: i for i, block_id in enumerate(given)} if result.replaced else {}
        for given_id, cached in result.replaced:
            state.block_ids[position[given_id]] = cached.block_id
            state.private_block_ids.discard(given_id)
        self.host.free_blocks(g for g, _ in result.replaced)
        self.blocks_touched(result.locked)
        self.blocks_cached(result.adopted)
        if self.stores.writes_through and result.adopted:
            self.stores.cached(result.adopted)

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
        self.stores.ended(state.request_id)

    def finish(self, state: SequenceState, output_token_ids: Sequence[int] | None = None) -> RequestOutcome:
        self.cache(state, output_token_ids)
        self.release(state)
        return self.conclude(state)

    def conclude(self, state: SequenceState) -> RequestOutcome:
        """Count and observe a finished request whose blocks are already
        returned (by :meth:`finish`, or by an engine that owns its blocks)."""
        state.status = RequestStatus.FINISHED
        self.stores.ended(state.request_id)  # (one aborted while it waited)
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
        self.host.observe("sagellm_request_finished", outcome=outcome)
        return outcome

    def release(self, state: SequenceState) -> None:
        """Free the request's private blocks and drop its cache locks,
        without ending it (a lease that held blocks for a transfer lets them
        go; :meth:`finish` and :meth:`preempt` release for a request)."""
        released = self.host.release_prefix(state.request)  # first: a plugin that raises here changed nothing of ours
        self.host.free_blocks(state.private_block_ids)
        self.ledger.end(state)
        state.block_ids = []
        state.private_block_ids = set()
        self.blocks_released(released, state.request)

    # -------------------------------------------------------------- inside --

    def _unlock_after_touch(self, request: Request) -> None:
        self.blocks_released(self.host.release_prefix(request), request)

    def _num_free(self) -> int:
        # Counted here when the runtime takes its pool's blocks (the pool's own
        # report is held to it at the end of a run): no hook call per block grown.
        owned = "kv_pool" in self.engine_owns
        return self.pool_usage().num_free_blocks if owned else self.num_blocks - len(self.ledger.in_use)

    def _make_room(
        self, need: int, candidates: EvictionCandidates | None = None, request: Request | None = None
    ) -> bool:
        """Evict until ``need`` blocks are free, and those the pool sets aside as far as it can; False if it cannot."""
        short = need - self._num_free()
        kept = self.host.reserved_blocks(need, request) if self.reserves else 0
        return short + kept <= 0 or self._evict_upto(short + kept, candidates) >= short

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
        removed = self.host.remove_cached(victims)
        try:
            if self.stores:
                self.stores.offload(removed)
        finally:  # a store that raised leaks no block
            self.host.free_blocks([b.block_id for b in removed])
            self.blocks_evicted(removed)
        return len(removed)
