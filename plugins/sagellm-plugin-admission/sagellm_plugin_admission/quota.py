"""``[admission] plugin = "quota"``: per-tenant KV quotas, a guaranteed share
and a cap of the device pool for each tenant.

A tenant's *held* blocks are the ledger's: the blocks in its admitted
requests' block tables (``TenantLedger.blocks``). A request *needs* the
blocks of its prompt (and of what it generated before a preemption).

* **Admission.** A request that alone needs more than its tenant's cap (if
  it has one) is rejected; one that would take its tenant past the cap is deferred (the
  step scheduler asks the requests behind it: one tenant at its cap holds
  no other back). Within the tenant's guarantee it is admitted, memory
  permitting: making room evicts other tenants' cached blocks first (below).
  Past the guarantee it is a *loan*, admitted only while the blocks free or
  evictable after it still cover ``1 - lend`` of the other tenants' unused
  guarantees, so that much is reclaimed by eviction, never by preemption
  (or while nothing runs: there is nothing to wait for).
* **Eviction.** Cached blocks no request holds are charged to a tenant: the
  one whose isolated namespace holds them (``CachedBlock.tenant``), else the
  one whose request released them last. While a tenant within its
  guarantee has cached blocks to lose, the tenants holding and charged with
  more than theirs lose theirs first, the furthest over first, least
  recently released first within it; otherwise (no guarantee to protect,
  or no tenant over its own) the decision passes to the ``[eviction]``
  policy. When memory runs out while a request within its tenant's
  guarantee grows, the preempted request is the newest running one of the
  tenant furthest over its guarantee: a loan reclaimed; otherwise the
  policy's rule decides.
* **Figures** per tenant (``sagellm_report_figures``): requests deferred,
  admissions on loan and the blocks lent, guarantee violations (a request
  within its guarantee that memory refused: asked again with no preemption
  between) and cap excesses (decisions that found the tenant past its cap,
  which only decoding after admission can do).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import attrs
from attrs import define, field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import (
    Admission,
    AdmissionDecision,
    CachedBlock,
    EvictionCandidates,
    EvictionDecision,
    PreemptionDecision,
    Request,
    RequestOutcome,
    SequenceState,
    TenantLedger,
)

OVER_CAP = "needs more blocks than its tenant's cap"
DEFER = AdmissionDecision(Admission.DEFER)

_shares = validators.deep_mapping(
    key_validator=validators.instance_of(str),
    value_validator=[validators.instance_of((int, float)), validators.ge(0), validators.le(1)],
    mapping_validator=validators.instance_of(dict),
)


@frozen
class QuotaSettings:
    #: Tenant -> the share of the pool it is guaranteed (a tenant not named: none).
    guarantees: dict = field(factory=dict, validator=_shares)
    #: Tenant -> the share of the pool its admitted requests may hold at most (a tenant not named: no cap).
    caps: dict = field(factory=dict, validator=_shares)
    #: The share of the other tenants' unused guarantees a tenant may borrow
    #: for running requests (0: only its cached blocks borrow them).
    lend: float = field(default=1.0, validator=[validators.instance_of(float), validators.ge(0), validators.le(1)])

    def __attrs_post_init__(self) -> None:
        if sum(self.guarantees.values()) > 1:
            raise ValueError(f"guarantees = {self.guarantees!r}: they add up to more than the pool (1.0)")
        for tenant, share in self.guarantees.items():
            if share > self.caps.get(tenant, 1.0):
                raise ValueError(f"guarantees: tenant {tenant!r} is guaranteed {share}, more than its cap")


@define
class TenantFigures:
    """What the plugin counted of one tenant."""

    deferred: int = 0
    loans: int = 0
    lent_blocks: int = 0
    guarantee_violations: int = 0
    cap_exceeded: int = 0
    held_peak: int = 0


class QuotaAdmission:
    """Guarantees and caps at admission, the guarantees again at eviction
    and preemption (the module's docstring)."""

    Settings = QuotaSettings

    def __init__(self, settings: QuotaSettings, context: PluginContext):
        pool, self.block_size = context.num_blocks, context.block_size
        # Whole blocks, down; the epsilon keeps 0.29 of 100 at 29 (0.29 * 100 is 28.999...).
        self.guaranteed = {t: math.floor(share * pool + 1e-9) for t, share in settings.guarantees.items()}
        self.caps = {t: math.floor(share * pool + 1e-9) for t, share in settings.caps.items()}
        self.lend = settings.lend
        self.figures: dict[str, TenantFigures] = {}
        #: Requests answered ADMIT within their guarantee: id -> preemptions then.
        self._admitted: dict[str, int] = {}
        # Cached blocks no request holds, by the tenant charged with them, least recently released first.
        self._owner: dict[int, str] = {}
        self._idle: dict[str, OrderedDict[int, None]] = {}
        #: The runtime's ledger (a live view), kept from the first admission
        #: decision: victim selection is not given it.
        self._ledger: TenantLedger | None = None

    def _tenant(self, tenant: str) -> TenantFigures:
        figures = self.figures.get(tenant)
        if figures is None:
            figures = self.figures[tenant] = TenantFigures()
        return figures

    # ------------------------------------------------------------ admission --

    @hookimpl
    def sagellm_admit_request(
        self, state: SequenceState, ledger: TenantLedger, running: Collection[SequenceState], available_blocks: int
    ) -> AdmissionDecision | None:
        self._ledger = ledger
        request = state.request
        tenant, figures = request.tenant, self._tenant(request.tenant)
        held, cap = ledger.blocks.get(tenant, 0), self.caps.get(tenant)
        figures.held_peak = max(figures.held_peak, held)
        need = -(-state.num_tokens // self.block_size)
        if cap is not None:
            figures.cap_exceeded += held > cap
            if need > cap:
                return AdmissionDecision(Admission.REJECT, OVER_CAP)
            if held + need > cap:
                figures.deferred += 1
                return DEFER
        guarantee = self.guaranteed.get(tenant, 0)
        if held + need <= guarantee:
            if self._admitted.get(request.request_id) == state.num_preemptions:
                figures.guarantee_violations += 1  # asked again: memory refused it
            self._admitted[request.request_id] = state.num_preemptions
            return None
        # A loan: what the other tenants' unused guarantees keep back of the
        # memory, while anything runs (a deferral waits for running requests).
        unused = sum(max(0, g - ledger.blocks.get(t, 0)) for t, g in self.guaranteed.items() if t != tenant)
        kept = (1.0 - self.lend) * unused
        if running and kept and available_blocks - need < kept:
            figures.deferred += 1
            return DEFER
        figures.loans += 1
        figures.lent_blocks += held + need - max(guarantee, held)
        return None

    @hookimpl
    def sagellm_request_finished(self, outcome: RequestOutcome) -> None:
        self._admitted.pop(outcome.request.request_id, None)

    # ------------------------------------------------- eviction, preemption --

    def _excess(self) -> dict[str, int]:
        """Tenant -> the blocks it holds and is charged with beyond its guarantee (negative: below it)."""
        held: Mapping[str, int] = {} if self._ledger is None else self._ledger.blocks
        tenants = set(self._idle) | set(self.guaranteed)
        return {t: held.get(t, 0) + len(self._idle.get(t, ())) - self.guaranteed.get(t, 0) for t in tenants}

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision | None:
        excess = self._excess()
        if not any(excess[t] <= 0 and self._idle.get(t) for t in self.guaranteed):
            return None  # no cached block within a guarantee to protect: the policy decides
        cursors = {t: iter(self._idle[t]) for t, n in excess.items() if n > 0 and self._idle.get(t)}
        victims: list[int] = []
        while len(victims) < num_blocks and cursors:
            tenant = max(cursors, key=lambda t: (excess[t], t))
            if excess[tenant] <= 0:
                break
            block = next((b for b in cursors[tenant] if b in candidates), None)
            if block is None:
                del cursors[tenant]
                continue
            victims.append(block)
            excess[tenant] -= 1
        return EvictionDecision(tuple(victims)) if victims else None

    @hookimpl
    def sagellm_select_preemption(
        self, running: Sequence[SequenceState], needed_by: SequenceState
    ) -> PreemptionDecision | None:
        held: dict[str, int] = {}
        for state in running:
            held[state.request.tenant] = held.get(state.request.tenant, 0) + len(state.block_ids)
        over = {t: n - self.guaranteed.get(t, 0) for t, n in held.items() if n > self.guaranteed.get(t, 0)}
        if not over or needed_by.request.tenant in over:
            return None  # not a guarantee to reclaim: the policy's rule
        tenant = max(over, key=lambda t: (over[t], t))
        newest = next(s for s in reversed(running) if s.request.tenant == tenant)
        return PreemptionDecision(newest.request_id)

    # ---------------------------------------- the cached blocks' tenants --

    @hookimpl
    def sagellm_blocks_released(self, blocks: tuple[CachedBlock, ...], request: Request | None) -> None:
        fallback = "" if request is None else request.tenant
        for block in reversed(blocks):  # deepest first: leaves go before parents
            tenant = fallback if block.tenant is None else block.tenant
            self._owner[block.block_id] = tenant
            self._idle.setdefault(tenant, OrderedDict())[block.block_id] = None

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...]) -> None:
        self._forget(blocks)

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...]) -> None:
        self._forget(blocks)

    def _forget(self, blocks: Collection[CachedBlock]) -> None:
        owner, idle = self._owner, self._idle
        for block in blocks:
            tenant = owner.pop(block.block_id, None)
            if tenant is not None:
                idle[tenant].pop(block.block_id, None)

    @hookimpl
    def sagellm_blocks_moved(self, moves: tuple[tuple[int, int], ...]) -> None:
        moved = dict(moves)
        for src, dst in moves:
            tenant = self._owner.pop(src, None)
            if tenant is not None:
                self._owner[dst] = tenant
        for tenant, queue in self._idle.items():
            if not moved.keys().isdisjoint(queue):
                self._idle[tenant] = OrderedDict((moved.get(b, b), None) for b in queue)

    # -------------------------------------------------------------- figures --

    @hookimpl
    def sagellm_report_figures(self) -> dict[str, Any]:
        return {"quota": {t: attrs.asdict(f) for t, f in sorted(self.figures.items())}}
