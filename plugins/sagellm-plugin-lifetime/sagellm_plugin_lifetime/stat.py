"""The statistical baseline: per tenant, the median output length of the last
``window`` finished requests, with the 10th and 90th percentiles as the
interval. Learns online from ``sagellm_request_finished``; before a tenant
has history it falls back to all tenants', then to ``prior_tokens``."""

from __future__ import annotations

import bisect
from collections import deque

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import QUANTILE_LEVELS, LifetimePrediction, Request, RequestOutcome


@frozen
class StatSettings:
    window: int = field(default=256, validator=[validators.instance_of(int), validators.gt(0)])
    prior_tokens: int = field(default=256, validator=[validators.instance_of(int), validators.gt(0)])


class _Window:
    """The last ``size`` values, kept sorted for O(size) quantiles."""

    def __init__(self, size: int):
        self.recent: deque[int] = deque()
        self.ordered: list[int] = []
        self.size = size

    def add(self, value: int) -> None:
        if len(self.recent) == self.size:
            old = self.recent.popleft()
            del self.ordered[bisect.bisect_left(self.ordered, old)]
        self.recent.append(value)
        bisect.insort(self.ordered, value)

    def quantile(self, q: float) -> float:
        return float(self.ordered[min(len(self.ordered) - 1, int(q * len(self.ordered)))])


class StatLifetime:
    """``[lifetime] plugin = "stat"``"""

    Settings = StatSettings

    def __init__(self, settings: StatSettings, context: PluginContext):
        self.settings = settings
        self._all = _Window(settings.window)
        self._by_tenant: dict[str, _Window] = {}

    @hookimpl
    def sagellm_predict_lifetime(self, request: Request) -> LifetimePrediction:
        window = self._by_tenant.get(request.tenant)
        if window is None or not window.ordered:
            window = self._all
        if not window.ordered:
            prior = float(self.settings.prior_tokens)
            return LifetimePrediction(prior, 1.0, 4 * prior, 0.0, "stat")
        quantiles = tuple(window.quantile(q) for q in QUANTILE_LEVELS)
        return LifetimePrediction(
            window.quantile(0.5),
            quantiles[0],
            quantiles[-1],
            len(window.ordered) / self.settings.window,
            "stat",
            quantiles,
        )

    @hookimpl
    def sagellm_request_finished(self, outcome: RequestOutcome) -> None:
        tenant = outcome.request.tenant
        if tenant not in self._by_tenant:
            self._by_tenant[tenant] = _Window(self.settings.window)
        self._by_tenant[tenant].add(outcome.num_output_tokens)
        self._all.add(outcome.num_output_tokens)
