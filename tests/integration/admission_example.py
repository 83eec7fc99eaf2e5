"""``[admission] plugin = "tenant-cap"``: a cap on the KV blocks of each
limited tenant (the plugin guide's example; the first-party ``quota``
plugin adds guarantees, loans and the eviction side).

A request of a limited tenant waits (deferred) while its tenant's admitted
requests hold ``max_blocks`` blocks or more with it, and the requests of the
other tenants queued behind it are admitted meanwhile; a request that alone
needs more than the cap is rejected.
"""

from __future__ import annotations

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import Admission, AdmissionDecision, SequenceState, TenantLedger

OVER_CAP = "needs more blocks than its tenant's cap"


@frozen
class CapSettings:
    #: KV blocks a limited tenant's admitted requests may hold together.
    max_blocks: int = field(default=1024, validator=[validators.instance_of(int), validators.gt(0)])
    #: The limited tenants (empty: every tenant).
    tenants: list[str] = field(
        factory=list, validator=validators.deep_iterable(validators.instance_of(str), validators.instance_of(list))
    )


class TenantCap:
    """Defers a limited tenant's request while its prompt's blocks would
    take the tenant past ``max_blocks`` (``ledger.blocks``: what its
    admitted requests hold now)."""

    Settings = CapSettings

    def __init__(self, settings: CapSettings, context: PluginContext):
        self.max_blocks = settings.max_blocks
        self.limited = frozenset(settings.tenants)
        self.block_size = context.block_size

    @hookimpl
    def sagellm_admit_request(self, state: SequenceState, ledger: TenantLedger) -> AdmissionDecision | None:
        tenant = state.request.tenant
        if self.limited and tenant not in self.limited:
            return None  # not limited: admitted
        need = -(-state.num_tokens // self.block_size)
        if need > self.max_blocks:
            return AdmissionDecision(Admission.REJECT, OVER_CAP)
        if ledger.blocks.get(tenant, 0) + need > self.max_blocks:
            return AdmissionDecision(Admission.DEFER)
        return None
