"""Checked hook calls: the plugins the config picks, loaded and registered,
and every decision asked of them with its answer checked.

The checks hold each answer against the ground truth kept here (the blocks
taken from the pool, and of those the ones the prefix cache holds), before
anything changes: a plugin that raises or returns nonsense gets a one-line
:class:`PluginError` naming it, and the caller's state is unchanged. The
lifecycle (:mod:`sagellm_core.runtime`) is built on these calls.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import attrs
import pluggy

from sagellm_core import hookspecs
from sagellm_core.config import Selection, Settings
from sagellm_core.errors import ConfigError, PluginError, SagellmError
from sagellm_core.parts.timing import HookTimer
from sagellm_core.registry import PluginContext, PluginInfo, build_settings, load_class
from sagellm_core.types import (
    EMPTY_MATCH,
    BlockAllocation,
    CachedBlock,
    EvictionCandidates,
    EvictionDecision,
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


class CheckedHooks:
    """The configured plugins behind checked calls. ``engine_owns`` names the
    sections an engine adapter serves with the engine's own machinery
    (vLLM's hash table and block pool, say): their plugins are not loaded."""

    def __init__(
        self,
        settings: Settings,
        *,
        hook_timing: bool | None = None,
        engine_owns: Collection[str] = (),
        future_requests: Callable[[], Iterable[Request]] | None = None,
    ):
        self.settings = settings
        self.engine_owns = frozenset(engine_owns)
        self.block_size = settings.block_size
        self.num_blocks = settings.num_blocks
        self._future_requests = future_requests
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, list[LoadedPlugin]] = {}
        self.timer: HookTimer | None = None
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
        self._predict: Caller = (self.hook.sagellm_predict_lifetime, self.who("lifetime"))
        self._predict_fallback: Caller | None = None
        if settings.lifetime_fallback is not None and "lifetime" in self.plugins:
            self._register(settings.lifetime_fallback)
            primary, fallback = self.plugins["lifetime"]
            # Each predictor alone: pluggy would otherwise ask the fallback first.
            subset = self.pm.subset_hook_caller
            self._predict = (subset("sagellm_predict_lifetime", [fallback.instance]), str(primary))
            self._predict_fallback = (subset("sagellm_predict_lifetime", [primary.instance]), str(fallback))
        # Ground truth for the checks: blocks taken from the pool and not yet
        # returned; of these, the ones the prefix cache holds.
        self._in_use: set[int] = set()
        self._cached: set[int] = set()

    def _register(self, sel: Selection) -> None:
        cls, info = load_class(sel.section, sel.name, sel.where)
        settings = build_settings(cls, sel.params, f"{sel.where} plugin {sel.name!r}")
        seed = self.settings.workload.seed
        context = PluginContext(sel.name, self.block_size, self.num_blocks, seed, self._future_requests)
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
        """The plugin(s) serving ``section``, as error messages name them."""
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

    def _observe(self, hook_name: str, **kwargs: Any) -> None:
        self._call("observer", hook_name, **kwargs)

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
        given = set(block_ids)
        adopted = [b.block_id for b in result.adopted]
        if any(b not in given or b in self._cached for b in adopted) or any(
            g not in given or g in self._cached or b.block_id not in self._cached for g, b in result.replaced
        ):
            raise self._bad(
                "prefix_cache",
                hook,
                f"adopted {adopted} / replaced {[g for g, _ in result.replaced]} of blocks {list(block_ids)}"
                " it was not given or that were cached",
            )
        stray = [b.block_id for b in result.locked if b.block_id not in self._cached]
        if stray:
            raise self._bad("prefix_cache", hook, f"locked blocks that are not cached: {stray[:8]}")
        self._cached.update(adopted)
        return result

    def evictable(self) -> EvictionCandidates:
        return self._call("prefix_cache", "sagellm_evictable_blocks") or ()

    def pinned_blocks(self) -> Collection[int]:
        return self._call("prefix_cache", "sagellm_pinned_blocks") or ()

    def block_keys(self, request: Request, start: int, num_blocks: int) -> tuple[Any, ...]:
        return (
            self._call("prefix_cache", "sagellm_block_keys", request=request, start=start, num_blocks=num_blocks) or ()
        )

    def remove_cached(self, victims: Sequence[int]) -> tuple[CachedBlock, ...]:
        """Drop the evictable ``victims`` (and their cached descendants) from
        the prefix cache; return every block removed. The caller frees them."""
        hook = "sagellm_remove_blocks"
        removed = self._call("prefix_cache", hook, block_ids=victims)
        if not isinstance(removed, tuple) or not all(isinstance(b, CachedBlock) for b in removed):
            raise self._bad("prefix_cache", hook, f"returned {removed!r}, not CachedBlocks")
        ids = [b.block_id for b in removed]
        if len(set(ids)) != len(ids) or not set(victims) <= set(ids) or not self._cached.issuperset(ids):
            raise self._bad("prefix_cache", hook, f"removed {ids} for victims {list(victims)}")
        self._cached.difference_update(ids)
        return removed

    def pool_usage(self) -> PoolUsage:
        usage = self._call("kv_pool", "sagellm_pool_usage")
        if not isinstance(usage, PoolUsage):
            raise self._bad("kv_pool", "sagellm_pool_usage", f"returned {usage!r}, not a PoolUsage")
        return usage

    def allocate_blocks(self, num_blocks: int, request: Request | None) -> tuple[int, ...]:
        """Take ``num_blocks`` blocks from the pool (the caller made room),
        checked: exactly as many, distinct, in range, not in use."""
        if num_blocks == 0:
            return ()
        hook = "sagellm_allocate_blocks"
        alloc = self._call("kv_pool", hook, num_blocks=num_blocks, request=request)
        if not isinstance(alloc, BlockAllocation):
            raise self._bad("kv_pool", hook, f"returned {alloc!r}, not a BlockAllocation")
        ids = alloc.block_ids
        if len(ids) != num_blocks:
            raise self._bad("kv_pool", hook, f"returned {len(ids)} blocks, asked for {num_blocks} with enough free")
        if len(set(ids)) != len(ids):
            raise self._bad("kv_pool", hook, f"returned duplicate blocks {ids}")
        bad = [b for b in ids if not (isinstance(b, int) and 0 <= b < self.num_blocks)]
        if bad:
            raise self._bad("kv_pool", hook, f"returned block ids out of range: {bad[:8]}")
        busy = self._in_use.intersection(ids)
        if busy:
            raise self._bad("kv_pool", hook, f"returned blocks already in use: {sorted(busy)[:8]}")
        self._in_use.update(ids)
        return ids

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the pool."""
        ids = tuple(block_ids)
        if not ids:
            return
        self._call("kv_pool", "sagellm_free_blocks", block_ids=ids)
        self._in_use.difference_update(ids)

    def select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> tuple[int, ...]:
        """Ask the eviction policy for up to ``num_blocks`` of ``candidates``,
        checked: distinct, no more than asked, every one a candidate."""
        hook = "sagellm_select_victims"
        decision = self._call("eviction", hook, num_blocks=num_blocks, candidates=candidates)
        if not isinstance(decision, EvictionDecision):
            raise self._bad("eviction", hook, f"returned {decision!r}, not an EvictionDecision")
        victims = decision.victim_ids
        if len(victims) > num_blocks:
            raise self._bad("eviction", hook, f"returned {len(victims)} victims, asked for at most {num_blocks}")
        if len(set(victims)) != len(victims):
            raise self._bad("eviction", hook, f"returned duplicate victims {victims}")
        stray = [v for v in victims if v not in candidates]
        if stray:
            raise self._bad("eviction", hook, f"returned victims that are not evictable candidates: {stray[:8]}")
        return victims

    def select_preemption(self, running: Sequence[SequenceState], needed_by: SequenceState) -> SequenceState:
        hook = "sagellm_select_preemption"
        decision = self._call("eviction", hook, running=running, needed_by=needed_by)
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
        reorder the lists and lower the budgets, never drop, duplicate or
        invent requests. Returns the names of the lists the passes reordered
        (``"waiting"``, ``"running"``), so an engine copies back only those."""
        hook = "sagellm_schedule_pass"
        before = {"waiting": list(ir.waiting), "running": list(ir.running)}
        self._call("scheduler", hook, ir=ir)
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
                    "scheduler",
                    hook,
                    f"changed the set of {name} requests ({len(was)} -> {len(now)}); passes may only reorder",
                )
        if ir.token_budget <= 0 or ir.max_num_seqs <= 0:
            raise self._bad("scheduler", hook, "left no token budget or sequence slots")
        return frozenset(moved)

    def _checked_transfer(self, plan: TransferPlan) -> TransferResult | None:
        result = self._call("transport", "sagellm_transfer_blocks", plan=plan)
        if result is not None and not isinstance(result, TransferResult):
            raise self._bad("transport", "sagellm_transfer_blocks", f"returned {result!r}, not a TransferResult")
        return result
