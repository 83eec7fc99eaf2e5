"""Plugins the pool-depth tests declare: an exact lifetime predictor, and
the quota rule remembering what it admitted within a guarantee."""

from __future__ import annotations

from sagellm_plugin_admission.quota import QuotaAdmission

from sagellm_core import hookimpl
from sagellm_core.types import LifetimePrediction


class Oracle:
    """A lifetime predictor that knows every output length exactly."""

    def __init__(self, settings, context):
        pass

    @hookimpl
    def sagellm_predict_lifetime(self, request):
        n = float(request.output_tokens)
        return LifetimePrediction(n, n, n, 1.0, "oracle", (n,) * 9)


class RecordingQuota(QuotaAdmission):
    """The quota rule, remembering what it admitted within a guarantee in a step."""

    def __init__(self, settings, context):
        super().__init__(settings, context)
        self.within: list = []

    @hookimpl
    def sagellm_admit_request(self, state, ledger, running, available_blocks):
        decision = super().sagellm_admit_request(state, ledger, running, available_blocks)
        need = -(-state.num_tokens // self.block_size)
        if decision is None and ledger.blocks.get(state.request.tenant, 0) + need <= self.guaranteed.get(
            state.request.tenant, 0
        ):
            self.within.append(state)
        return decision
