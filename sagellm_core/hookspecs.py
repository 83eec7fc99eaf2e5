"""Hook specifications: the decisions of KV-cache management, and the
observations every plugin receives.

Conventions (after pytest and simonw/llm):

* Every hook is named ``sagellm_<what it decides or observes>`` and documented
  here, where it is declared. ``docs/hooks.md`` is generated from this module.
* A *decision* has one answer: it is ``firstresult``, and a plugin may return
  ``None`` to pass the decision on to the next plugin.
* An *observation* goes to every registered plugin; its return value is
  ignored. Plugins keep their own state up to date from observations.
* Hooks are called per request or per step, never per block or per token:
  block-level facts travel as tuples in one call.
* A plugin never calls another plugin. What one decision needs from another
  (the evictable blocks, a lifetime prediction) the runtime passes as an
  argument.

A plugin implements any subset, with the argument names below (pluggy lets it
omit arguments it does not need).
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import pluggy

from sagellm_core.types import (
    AdmissionDecision,
    BlockAllocation,
    CachedBlock,
    EvictionCandidates,
    EvictionDecision,
    InstanceLoad,
    KVCaches,
    LifetimePrediction,
    PoolUsage,
    PreemptionDecision,
    PrefixInsert,
    PrefixMatch,
    Request,
    RequestOutcome,
    RouteDecision,
    ScheduleIR,
    SequenceState,
    TenantLedger,
    TransferPlan,
    TransferResult,
)

PROJECT = "sagellm"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------------
# 1. Prefix matching: which leading blocks of a prompt are already in KV.
#    Served by a `sagellm.prefix_cache` plugin.
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def sagellm_lookup_prefix(request: Request) -> PrefixMatch | None:
    """Return the longest cached, block-aligned prefix of ``request``'s prompt,
    without changing any state.

    Used for scheduling hints (a prefix-aware pass orders by it). At least one
    prompt token is always left to compute, as in vLLM and LMDeploy, so a fully
    cached prompt matches one block less.
    """


@hookspec(firstresult=True)
def sagellm_acquire_prefix(request: Request) -> PrefixMatch | None:
    """Match ``request``'s prompt like :func:`sagellm_lookup_prefix` and lock the
    matched blocks for it (reference count +1), so they cannot be evicted while
    the request uses them. Called once at admission; paired with
    :func:`sagellm_release_prefix`.
    """


@hookspec(firstresult=True)
def sagellm_insert_prefix(request: Request, token_ids: Sequence[int], block_ids: Sequence[int]) -> PrefixInsert | None:
    """Cache the full blocks of ``token_ids`` (the request's prompt, or prompt
    and output), whose KV lives in ``block_ids`` (one id per full block, in
    token order, the acquired prefix included). The request's whole path
    stays locked for it until :func:`sagellm_release_prefix`. Pages already
    cached under another block are reported in ``replaced``: the request
    switches to the cached block and the runtime frees its own copy.
    """


@hookspec(firstresult=True)
def sagellm_release_prefix(request: Request) -> tuple[CachedBlock, ...] | None:
    """Drop ``request``'s locks. Return the blocks whose reference count fell to
    zero (now evictable), in chain order, root first. Releasing a request that
    holds nothing returns ``()``.
    """


@hookspec(firstresult=True)
def sagellm_evictable_blocks() -> EvictionCandidates | None:
    """Return a live view of the evictable (unreferenced) cached blocks, with
    O(1) membership and size."""


@hookspec(firstresult=True)
def sagellm_block_keys(request: Request, start: int, num_blocks: int) -> tuple[int, ...] | None:
    """Optional: the content keys (:attr:`CachedBlock.key`) that full blocks
    ``start`` to ``num_blocks - 1`` of ``request``'s prompt have, or would
    have, in this cache. With ``[kv_stores]`` the runtime finds the blocks
    the stores below the device hold by them; it asks from the end of the
    cached prefix (``start``), one key first, so that a chained key costs
    one hash per block looked at, not per block of the prompt."""


@hookspec(firstresult=True)
def sagellm_pinned_blocks() -> Collection[int] | None:
    """Optional: the cached blocks the cache keeps although no request holds
    them (pinned prefixes). They are neither held nor evictable; the
    runtime's invariant checks account for them."""


@hookspec(firstresult=True)
def sagellm_move_blocks(moves: tuple[tuple[int, int], ...]) -> tuple[CachedBlock, ...] | None:
    """Optional: each evictable cached block ``src`` of ``moves`` is now block
    ``dst`` (same KV, same key). Relabel; return every record that changed:
    the moved blocks, and those whose ``parent_id`` moved."""


@hookspec(firstresult=True)
def sagellm_remove_blocks(block_ids: Sequence[int]) -> tuple[CachedBlock, ...] | None:
    """Drop evictable ``block_ids`` from the cache, with their cached
    descendants (a block is useless once its parent is gone). Return every
    block removed; the runtime returns them to the pool."""


# --------------------------------------------------------------------------
# 2. Block allocation: physical KV blocks. Served by a `sagellm.kv_pool` plugin.
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def sagellm_allocate_blocks(num_blocks: int, request: Request | None) -> BlockAllocation | None:
    """Take exactly ``num_blocks`` free blocks for ``request``, or return an
    empty allocation (nothing taken) when fewer are free. The runtime checks
    that the ids are distinct, in range and not in use. ``request`` is None
    where an engine allocates below the request level (LMDeploy's physical
    allocator)."""


@hookspec(firstresult=True)
def sagellm_free_blocks(block_ids: Sequence[int]) -> bool | None:
    """Return ``block_ids`` to the free pool. Return ``True``."""


@hookspec(firstresult=True)
def sagellm_pool_usage() -> PoolUsage | None:
    """Report the pool's size and free blocks."""


@hookspec(firstresult=True)
def sagellm_reserved_blocks(num_blocks: int, request: Request | None) -> int | None:
    """Optional: the free blocks the pool sets aside for requests to grow into
    once it has taken ``num_blocks`` for ``request``. Asked before each
    allocation; the runtime evicts cached blocks to keep them free too, and
    where it cannot, allocates all the same (the pool takes reserved blocks)."""


@hookspec(firstresult=True)
def sagellm_plan_compaction(movable: EvictionCandidates) -> tuple[tuple[int, int], ...] | None:
    """Optional: moves ``(src, dst)`` that rejoin runs of free blocks: the
    cached block ``src``, one of ``movable`` (no request holds them), to the
    free block ``dst``; ``None`` or ``()`` when none is due. Asked once a
    step (O(1) when none is due); the runtime checks the moves, then the
    prefix cache relabels (:func:`sagellm_move_blocks`) and every plugin is
    told (:func:`sagellm_blocks_moved`). Refused at start unless those
    plugins implement them."""


# --------------------------------------------------------------------------
# 3. Victim selection: which cached blocks to evict, which request to preempt.
#    Served by a `sagellm.eviction` plugin, which keeps its own order up to
#    date from the block observations below and answers in O(k log n).
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def sagellm_select_victims(num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision | None:
    """Choose up to ``num_blocks`` evictable blocks to evict, best victim first.
    Every victim must be in ``candidates``; returning fewer is allowed (the
    runtime then frees what it can)."""


@hookspec(firstresult=True)
def sagellm_select_preemption(running: Sequence[SequenceState], needed_by: SequenceState) -> PreemptionDecision | None:
    """Memory ran out while ``needed_by`` grows: choose the running request to
    preempt (its blocks are released and it is recomputed later). May choose
    ``needed_by`` itself."""


# --------------------------------------------------------------------------
# 4. Lifetime prediction: how many tokens a request will generate.
#    Served by a `sagellm.lifetime` plugin.
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def sagellm_predict_lifetime(request: Request) -> LifetimePrediction | None:
    """Predict ``request``'s output length at arrival. Plugins learn from
    :func:`sagellm_request_finished`."""


# --------------------------------------------------------------------------
# 5. Scheduling: the pipeline from waiting+running to a step's batch (each
#    `sagellm.scheduler_passes` plugin is one pass), and admission.
# --------------------------------------------------------------------------


@hookspec
def sagellm_schedule_pass(ir: ScheduleIR) -> None:
    """Refine ``ir`` in place: reorder ``ir.waiting`` / ``ir.running``, lower
    the budgets or cap requests' chunks (``ir.chunk_limits``). Passes run in the
    order the config lists them; the engine then packs the result into a
    :class:`~sagellm_core.drivers.step_scheduler.StepPlan`."""


@hookspec(firstresult=True)
def sagellm_admit_request(
    state: SequenceState, ledger: TenantLedger, now_s: float, running: Collection[SequenceState], available_blocks: int
) -> AdmissionDecision | None:
    """Decide whether the waiting request ``state`` may start in this step,
    before any block is taken for it: ``ADMIT`` (the step scheduler takes its
    blocks if memory allows, and admits no further request if not),
    ``DEFER`` (it keeps its place in the queue and the scheduler asks the
    next one: a tenant over its quota holds no other tenant back) or
    ``REJECT`` (it ends, rejected, counted under the decision's reason).
    ``None`` admits. ``ledger``: what each tenant's admitted requests hold;
    ``running``: those requests (a live read-only view); ``available_blocks``:
    the free and evictable blocks, what admission and growth can take
    without preempting. Asked in each step for every waiting request the
    scheduler reaches, in the passes' order; served by a
    ``sagellm.admission`` plugin. A deferral waits for running requests to
    end: in a step where nothing runs, a deferred request is rejected
    (``deferred with nothing running``).
    """


# --------------------------------------------------------------------------
# 6. KV transport: moving KV blocks between tiers or hosts.
#    Served by a `sagellm.transport` plugin.
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def sagellm_transfer_blocks(plan: TransferPlan) -> TransferResult | None:
    """Carry out ``plan``. A failed transfer returns ``ok=False`` with an error
    rather than raising; the runtime counts it and goes on without the copy."""


# --------------------------------------------------------------------------
# 7. Routing: which instance of a cluster serves a request.
#    Served by a `sagellm.router` plugin.
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def sagellm_route_request(request: Request, instances: Sequence[InstanceLoad], now_s: float) -> RouteDecision | None:
    """Choose the instance that computes ``request``'s prompt (a
    ``colocated`` or ``prefill`` one of ``instances``) and, if it is a
    prefill instance, the ``decode`` instance its KV goes to. ``instances``
    are every instance of the cluster as the router sees them now: the work
    queued on each, and how many of this prompt's blocks each holds (from
    the KV events they publish; zero on all while the router's index is
    degraded by a gap in them, so that a stale index attracts nothing).
    Asked once per request, at arrival, by the cluster's front."""


# --------------------------------------------------------------------------
# Observations: every registered plugin receives them.
# --------------------------------------------------------------------------


@hookspec
def sagellm_request_arrived(request: Request, prediction: LifetimePrediction | None, match: PrefixMatch) -> None:
    """A request entered the waiting queue. ``match`` is the cached prefix a
    lookup found for it then (empty where the engine does not say): the
    blocks it will hit if they are still cached when it is admitted."""


@hookspec
def sagellm_request_finished(outcome: RequestOutcome) -> None:
    """A request finished; ``outcome`` carries its true output length."""


@hookspec
def sagellm_blocks_cached(blocks: tuple[CachedBlock, ...], now_s: float) -> None:
    """Blocks entered the prefix cache (locked by the request that made them)."""


@hookspec
def sagellm_blocks_touched(blocks: tuple[CachedBlock, ...], now_s: float) -> None:
    """Cached blocks were hit and locked by a request (no longer evictable)."""


@hookspec
def sagellm_blocks_released(blocks: tuple[CachedBlock, ...], now_s: float, request: Request | None) -> None:
    """Cached blocks lost their last reference and became evictable, chain
    order, root first; ``request`` let go of them last (its session says if
    they may return), ``None`` where the engine does not say (vLLM, LMDeploy)."""


@hookspec
def sagellm_blocks_evicted(blocks: tuple[CachedBlock, ...], now_s: float) -> None:
    """Blocks left the prefix cache (victims and their descendants)."""


@hookspec
def sagellm_blocks_moved(moves: tuple[tuple[int, int], ...], blocks: tuple[CachedBlock, ...], now_s: float) -> None:
    """The pool compacted: cached block ``src`` of each ``(src, dst)`` is now
    ``dst``, ``blocks`` the changed records (:func:`sagellm_move_blocks`).
    Plugins that keep blocks by id relabel; the pool frees ``src``, takes
    ``dst`` and copies the KV bytes where it holds the engine's tensors."""


@hookspec
def sagellm_report_figures() -> Mapping[str, Any] | None:
    """Optional: a plugin's own figures, ``{name: figures}`` (JSON values),
    for the run's report and a server's metrics; asked off the hot path."""


@hookspec
def sagellm_kv_caches_allocated(kv_caches: KVCaches) -> None:
    """An engine that owns real KV tensors (the torch engine) allocated them,
    once, before the first request: ``kv_caches.tensor`` indexed by the pool's
    block ids along ``kv_caches.block_dim``. A transport keeps it to copy
    evicted blocks' bytes to its host tier and back (vLLM's KV connectors
    get ``register_kv_caches`` for the same reason). Engines without KV
    tensors (replay, the adapters' CPU drivers) never call it; where KV
    stores are configured the runtime then announces a stand-in pool of
    byte rows (``[kv_stores] bytes_per_block``) before their first copy."""


# --------------------------------------------------------------------------
# Command-line extensions: a `sagellm.commands` entry point names a module
# (or object) implementing this hook.
# --------------------------------------------------------------------------


@hookspec
def sagellm_register_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add subcommands to ``sagellm`` (``sagellm lifetime evaluate``, say):
    ``subparsers`` is the command's argparse sub-parser action. A command sets
    ``func`` (taking the parsed arguments, returning an exit status) with
    ``set_defaults``; a :class:`~sagellm_core.errors.SagellmError` it raises
    is printed as a one-line error."""
