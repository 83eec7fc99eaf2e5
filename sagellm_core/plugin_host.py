"""The plugin host: the plugins the config picks, loaded and registered,
and every decision asked of them with its answer checked.

The checks hold each answer against the ground truth of the block ledger
(:mod:`sagellm_core.ledger`: the blocks taken from the pool, and of those
the ones the prefix cache holds), before anything changes: a plugin that
raises or returns nonsense gets a one-line :class:`PluginError` naming it,
and the caller's state is unchanged. The host records what a checked call
changed in the ledger (blocks allocated, freed, cached, removed); the
lifecycle (:mod:`sagellm_core.runtime`) is built on these calls.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import pluggy

from sagellm_core import checks, hookspecs
from sagellm_core.config import Selection, Settings
from sagellm_core.counters import Counters
from sagellm_core.dispatch import Dispatch, PluginManager
from sagellm_core.errors import ConfigError, PluginError, PluginStartError, SagellmError
from sagellm_core.ledger import BlockLedger
from sagellm_core.registry import GROUPS, PluginContext, PluginInfo, build_settings, load_class
from sagellm_core.timing import HookTimer
from sagellm_core.types import (
    EMPTY_MATCH,
    AdmissionDecision,
    CachedBlock,
    EvictionCandidates,
    LifetimePrediction,
    PoolUsage,
    PreemptionDecision,
    PrefixInsert,
    PrefixMatch,
    Request,
    ScheduleIR,
    SequenceState,
    TransferPlan,
    TransferResult,
)
from sagellm_core.watchdog import HookTimeout, Watchdog, guard_observations

#: What a plugin may raise from a hook and be named for: an error, a
#: ``sys.exit()`` (its fault, not a clean end of the run), a time-out.
PLUGIN_FAULTS = (Exception, SystemExit, HookTimeout)

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
    "admission": ("sagellm_admit_request",),
    "transport": ("sagellm_transfer_blocks",),
    # Not hooks: a store's methods (sagellm_core.types.KVStore), called in tier order.
    "kv_stores": ("contains", "put", "get", "prefetch", "pin", "unpin", "remove", "stats"),
}

#: A hook caller, and who answers through it (for error messages).
Caller = tuple[Any, str]


@attrs.frozen
class LoadedPlugin:
    selection: Selection
    info: PluginInfo
    instance: Any

    def __str__(self) -> str:
        dist = f" ({self.info.distribution} {self.info.version})" if self.info.distribution else ""
        return f"{self.selection.section} plugin {self.selection.name!r}{dist}"


class PluginHost:
    """The configured plugins behind checked calls, checked against
    ``ledger``. ``engine_owns`` names the sections an engine adapter serves
    with the engine's own machinery (vLLM's hash table and block pool, say):
    their plugins are not loaded."""

    def __init__(
        self,
        settings: Settings,
        ledger: BlockLedger,
        counters: Counters,
        *,
        hook_timing: bool | None = None,
        engine_owns: Collection[str] = (),
        future_requests: Callable[[], Iterable[Request]] | None = None,
    ):
        self.settings = settings
        self.ledger = ledger
        self.engine_owns = frozenset(engine_owns)
        self.block_size = settings.block_size
        self.num_blocks = settings.num_blocks
        self._future_requests = future_requests
        self.pm = PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, list[LoadedPlugin]] = {}
        self.counters = counters
        timed = settings.report.hook_timing if hook_timing is None else hook_timing
        self.timer: HookTimer | None = HookTimer() if timed else None
        self.dispatch = Dispatch(self.pm, self.timer)
        #: The per-call time limit (``[limits] hook_time_limit_s``), if one is set.
        self.watchdog: Watchdog | None = None
        if settings.limits.hook_time_limit_s > 0:
            try:
                self.watchdog = Watchdog(settings.limits.hook_time_limit_s)
            except ValueError as exc:
                raise ConfigError(f"{settings.path}: [limits] hook_time_limit_s: {exc}") from None
            self.pm.register(self.watchdog, name="sagellm:watchdog")
        # pluggy calls implementations last-registered first: register the
        # passes in reverse so they run in the order the config lists them.
        for sel in [*reversed(settings.passes), *settings.decisions(), *settings.kv_stores.tiers]:
            if sel.section not in self.engine_owns:
                self._register(sel, fallback=settings.lifetime_fallback if sel.section == "lifetime" else None)
        if "scheduler" in self.plugins:
            self.plugins["scheduler"].reverse()  # listed in config order
        first_party = GROUPS["scheduler"][1]  # others' passes are checked not to edit states (docs/threat-model.md)
        self._verify_passes = any(p.info.distribution != first_party for p in self.plugins.get("scheduler", ()))
        self.hook = self.pm.hook
        self._predict: Caller = (None, self.who("lifetime"))  # every predictor, through the dispatch
        self._predict_fallback: Caller | None = None
        lifetime = self.plugins.get("lifetime", [])
        if settings.lifetime_fallback is not None and lifetime:
            # Each predictor alone: pluggy would otherwise ask the fallback first.
            *primary, fallback = lifetime
            subset = self.pm.subset_hook_caller
            self._predict_fallback = (subset("sagellm_predict_lifetime", [p.instance for p in primary]), str(fallback))
            if primary:
                self._predict = (subset("sagellm_predict_lifetime", [fallback.instance]), str(primary[0]))
            else:  # it failed to start: every prediction is the fallback's
                self._predict = (self._failed_predictor, f"lifetime plugin {settings.lifetime.name!r}")  # type: ignore[union-attr]

    def _register(self, sel: Selection, fallback: Selection | None = None) -> None:
        """Load, build and register ``sel``'s plugin. A lifetime predictor
        with a ``fallback`` that fails to import or start, or later raises
        in an observation, is counted and the fallback answers instead."""
        try:
            cls, info = load_class(sel.section, sel.name, sel.where)
            settings = build_settings(cls, sel.params, f"{sel.where} plugin {sel.name!r}")
            folder = str(Path(self.settings.path).parent) if Path(self.settings.path).is_file() else None
            seed, instance = self.settings.workload.seed, self.settings.instance
            context = PluginContext(
                sel.name,
                self.block_size,
                self.num_blocks,
                seed,
                self._future_requests,
                folder,
                instance.id,
                instance.role,
            )
            try:
                instance = cls(settings, context)
            except SagellmError as exc:  # its own one-line message, said where
                where = "" if str(exc).startswith(self.settings.path) else f"{sel.where}: "
                raise PluginStartError(f"{where}{exc}") from exc
            except PLUGIN_FAULTS as exc:
                raise PluginStartError(f"{sel.where}: plugin {sel.name!r} failed to start: {exc}") from exc
        except PluginStartError as exc:
            if fallback is None:
                raise
            self.counters.lifetime_failure = " ".join(str(exc).split())
            return self._register(fallback)
        if fallback is not None:
            guard_observations(instance, lambda exc, hook: self._lifetime_failed(f"{sel.name!r} raised in {hook}", exc))
        loaded = LoadedPlugin(sel, info, instance)
        try:
            self.pm.register(instance, name=f"{sel.section}:{sel.name}")
            self.pm.check_pending()
        except (pluggy.PluginValidationError, ValueError) as exc:
            raise ConfigError(f"{sel.where}: {loaded} is not a valid plugin: {exc}") from exc
        missing = [h for h in SECTION_HOOKS.get(sel.section, ()) if not callable(getattr(instance, h, None))]
        if missing:
            raise ConfigError(f"{sel.where}: {loaded} does not implement {', '.join(missing)}")
        self.plugins.setdefault(sel.section, []).append(loaded)
        if fallback is not None:
            self._register(fallback)

    def _failed_predictor(self, request: Request) -> None:
        raise PluginError(f"{self.counters.lifetime_failure}")

    def _lifetime_failed(self, what: str, exc: BaseException) -> None:
        self.counters.lifetime_fallbacks += 1
        if self.counters.lifetime_failure is None:
            self.counters.lifetime_failure = f"{what}: {type(exc).__name__}: {' '.join(str(exc).split())}"

    def who(self, section: str) -> str:
        """The plugin(s) serving ``section``, as error messages name them."""
        loaded = self.plugins.get(section)
        if not loaded:
            return f"no {section} plugin"
        return " / ".join(str(p) for p in loaded)

    def _call(self, section: str, hook_name: str, caller: Any = None, **kwargs: Any) -> Any:
        try:
            return self.dispatch.call(hook_name, kwargs, caller)
        except SagellmError:
            raise
        except PLUGIN_FAULTS as exc:
            # One line, whatever the plugin's message looks like.
            message = " ".join(str(exc).split())
            who = checks.culprit(exc, self.plugins, hook_name) or self.who(section)
            raise PluginError(f"{who} raised in {hook_name}: {type(exc).__name__}: {message}") from exc

    def _bad(self, section: str, hook_name: str, what: str) -> PluginError:
        """Names every plugin that implements the hook: one of another section may answer first."""
        answering = [str(p) for ps in self.plugins.values() for p in ps if callable(getattr(p.instance, hook_name, 0))]
        return PluginError(f"{' / '.join(answering) or self.who(section)} {hook_name} {what}")

    def observe(self, hook_name: str, **kwargs: Any) -> None:
        """Tell every plugin that implements the observation ``hook_name``."""
        if self.dispatch.implemented(hook_name):
            self._call("observer", hook_name, **kwargs)

    def observes(self, hook_name: str) -> bool:
        """Whether any plugin implements ``hook_name``."""
        return self.dispatch.implemented(hook_name)

    def lookup(self, request: Request) -> PrefixMatch:
        match = self._call("prefix_cache", "sagellm_lookup_prefix", request=request) or EMPTY_MATCH
        self._check_match(request, match, "sagellm_lookup_prefix")
        return match

    def _check_match(self, request: Request, match: Any, hook_name: str) -> None:
        problem = checks.match(match, request.num_prompt_tokens, self.block_size, self.ledger.cached)
        if problem:
            raise self._bad("prefix_cache", hook_name, problem)

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
        released = self._call("prefix_cache", "sagellm_release_prefix", request=request)
        problem = None if released is None else checks.released(released, self.ledger.cached)
        return () if released is None else self._checked("prefix_cache", "sagellm_release_prefix", released, problem)

    def insert_prefix(self, request: Request, token_ids: Any, block_ids: Sequence[int]) -> PrefixInsert | None:
        """Cache the full blocks of ``token_ids``, held in ``block_ids``
        (the matched prefix first, then blocks not cached yet). Checked: the
        plugin adopts or replaces only given blocks that were not cached, and
        replaces and locks only cached ones."""
        hook = "sagellm_insert_prefix"
        result = self._call("prefix_cache", hook, request=request, token_ids=token_ids, block_ids=block_ids)
        if result is None:
            return None
        if not isinstance(result, PrefixInsert):
            raise self._bad("prefix_cache", hook, f"returned {result!r}, not a PrefixInsert")
        problem = checks.insert(result, block_ids, self.ledger.cached)
        if problem:
            raise self._bad("prefix_cache", hook, problem)
        self.ledger.cached.update(b.block_id for b in result.adopted)
        return result

    def _checked(self, section: str, hook_name: str, answer: Any, problem: str | None) -> Any:
        if problem:
            raise self._bad(section, hook_name, problem)
        return answer

    def evictable(self) -> EvictionCandidates:
        found = self._call("prefix_cache", "sagellm_evictable_blocks")
        return (
            ()
            if found is None
            else self._checked("prefix_cache", "sagellm_evictable_blocks", found, checks.collection(found))
        )

    def pinned_blocks(self) -> Collection[int]:
        found = self._call("prefix_cache", "sagellm_pinned_blocks")
        return (
            ()
            if found is None
            else self._checked("prefix_cache", "sagellm_pinned_blocks", found, checks.collection(found))
        )

    def block_keys(self, request: Request, start: int, num_blocks: int) -> tuple[Any, ...]:
        hook = "sagellm_block_keys"
        keys = self._call("prefix_cache", hook, request=request, start=start, num_blocks=num_blocks)
        return () if keys is None else self._checked("prefix_cache", hook, keys, checks.keys(keys, num_blocks - start))

    def remove_cached(self, victims: Sequence[int]) -> tuple[CachedBlock, ...]:
        """Drop the evictable ``victims`` (and their cached descendants) from
        the prefix cache; return every block removed. The caller frees them."""
        hook = "sagellm_remove_blocks"
        removed = self._call("prefix_cache", hook, block_ids=victims)
        self._checked(
            "prefix_cache",
            hook,
            removed,
            checks.removal(removed, victims, self.ledger.cached, self.ledger.taken, self.ledger.returned),
        )
        self.ledger.cached.difference_update(b.block_id for b in removed)
        return removed  # type: ignore[no-any-return]

    def plugin_figures(self) -> dict[str, Any]:
        """The plugins' own figures (``sagellm_report_figures``), merged."""
        hook = "sagellm_report_figures"
        answers_ = self._call("observer", hook) if self.dispatch.implemented(hook) else []
        for bad in [a for a in answers_ if not (isinstance(a, Mapping) and all(isinstance(k, str) for k in a))]:
            raise self._bad("observer", hook, f"returned {bad!r}, not figures by name")
        return {name: figures for answer in answers_ for name, figures in answer.items()}

    def pool_usage(self) -> PoolUsage:
        usage = self._call("kv_pool", "sagellm_pool_usage")
        if (
            type(usage) is PoolUsage
            and type(usage.num_free_blocks) is int
            and 0 <= usage.num_free_blocks <= usage.num_blocks
        ):
            return usage  # the common case, checked in line: this is called every step
        return self._checked("kv_pool", "sagellm_pool_usage", usage, checks.usage(usage, self.num_blocks))  # type: ignore[no-any-return]

    def reserved_blocks(self, num_blocks: int, request: Request | None) -> int:
        """The free blocks the pool sets aside once it has taken ``num_blocks`` for ``request`` (checked)."""
        hook = "sagellm_reserved_blocks"
        kept = self._call("kv_pool", hook, num_blocks=num_blocks, request=request)
        if kept is None:
            return 0
        if type(kept) is not int or not 0 <= kept <= self.num_blocks:
            raise self._bad("kv_pool", hook, f"returned {kept!r}, not a block count in 0..{self.num_blocks}")
        return kept

    def allocate_blocks(self, num_blocks: int, request: Request | None) -> tuple[int, ...]:
        """Take ``num_blocks`` blocks from the pool (the caller made room),
        checked: exactly as many, distinct, in range, not in use."""
        if num_blocks == 0:
            return ()
        hook = "sagellm_allocate_blocks"
        alloc = self._call("kv_pool", hook, num_blocks=num_blocks, request=request)
        self._checked("kv_pool", hook, alloc, checks.allocation(alloc, num_blocks, self.num_blocks, self.ledger.in_use))
        ids: tuple[int, ...] = tuple(alloc.block_ids)
        self.ledger.in_use.update(ids)
        return ids

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the pool."""
        ids = tuple(block_ids)
        if not ids:
            return
        self._call("kv_pool", "sagellm_free_blocks", block_ids=ids)
        self.ledger.in_use.difference_update(ids)

    def select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> tuple[int, ...]:
        """Ask the eviction policy for up to ``num_blocks`` of ``candidates``,
        checked: distinct, no more than asked, every one a candidate."""
        hook = "sagellm_select_victims"
        decision = self._call("eviction", hook, num_blocks=num_blocks, candidates=candidates)
        self._checked("eviction", hook, decision, checks.victims(decision, num_blocks, candidates))
        return decision.victim_ids  # type: ignore[no-any-return]

    def select_preemption(self, running: Sequence[SequenceState], needed_by: SequenceState) -> SequenceState:
        hook = "sagellm_select_preemption"
        decision = self._call("eviction", hook, running=tuple(running), needed_by=needed_by)  # not the live list
        if decision is None:
            return running[-1]  # vLLM's FCFS rule: the last one scheduled
        if isinstance(decision, PreemptionDecision):
            for state in running:
                if state.request_id == decision.request_id:
                    return state
        raise self._bad("eviction", hook, f"returned {decision!r}, not a running request")

    def _checked_prediction(self, predictor: Caller, request: Request) -> LifetimePrediction | None:
        caller, who = predictor
        prediction: LifetimePrediction | None = self._call(
            "lifetime", "sagellm_predict_lifetime", caller, request=request
        )
        if prediction is None:
            return None
        problem = prediction.problem() if isinstance(prediction, LifetimePrediction) else "is not a LifetimePrediction"
        if problem is not None:
            raise PluginError(f"{who} sagellm_predict_lifetime returned {prediction!r}: it {problem}")
        return prediction

    def schedule(self, ir: ScheduleIR) -> frozenset[str]:
        """Run the scheduling passes over ``ir``, in config order. A pass may
        reorder the lists, lower the budgets and cap chunks, never drop,
        duplicate or invent requests. Returns the names of the lists the
        passes reordered (``"waiting"``, ``"running"``), so an engine copies
        back only those."""
        hook = "sagellm_schedule_pass"
        if "scheduler" not in self.plugins:
            return frozenset()
        before, budgets = {"waiting": list(ir.waiting), "running": list(ir.running)}, (ir.token_budget, ir.max_num_seqs)
        # A waiting request's runtime fields are reset at admission: the running ones' are checked.
        states = checks.fingerprint(before["running"]) if self._verify_passes else None
        self._call("scheduler", hook, ir=ir)
        if not (
            ir.waiting == before["waiting"]
            and ir.running == before["running"]
            and budgets == (ir.token_budget, ir.max_num_seqs)
            and not ir.chunk_limits
        ):
            self._checked("scheduler", hook, None, checks.schedule(ir, before, *budgets))  # anything moved: checked
        if states is not None and checks.fingerprint(before["running"]) != states:
            raise self._bad("scheduler", hook, "changed a SequenceState it was given; passes only read them")
        return frozenset(name for name, was in before.items() if getattr(ir, name) != was)

    def admit_request(self, state: SequenceState, now_s: float, available_blocks: int) -> AdmissionDecision | None:
        """The admission plugin's decision for the waiting ``state``, checked."""
        hook, ledger = "sagellm_admit_request", self.ledger
        kwargs = {"ledger": ledger.tenants, "running": ledger.active.values(), "available_blocks": available_blocks}
        decision = self._call("admission", hook, state=state, now_s=now_s, **kwargs)
        if decision is None:
            return None
        checked: AdmissionDecision = self._checked("admission", hook, decision, checks.admission(decision))
        return checked

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

    def transfer_blocks(self, plan: TransferPlan) -> TransferResult | None:
        """The transport's transfer, checked."""
        result = self._call("transport", "sagellm_transfer_blocks", plan=plan)
        return (
            None
            if result is None
            else self._checked("transport", "sagellm_transfer_blocks", result, checks.transfer(result, plan))
        )
