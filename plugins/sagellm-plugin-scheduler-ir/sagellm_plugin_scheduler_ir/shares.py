"""``passes = [..., "tenant-shares"]``: each tenant's share of a step's
prefill tokens.

KV quotas divide the pool, not the step: a tenant sending long prompts
fills every step's token budget with its prefill chunks (running requests
are packed before waiting ones), and another tenant's new request waits
behind them. This pass caps the chunks of the step's requests
(``ScheduleIR.chunk_limits``) so that:

* **a share is guaranteed**: a tenant named in ``shares`` whose requests
  ask for prefill tokens gets ``min(asked, share * budget)`` of them, the
  *budget* being the step's tokens less one for each decoding request
  (decodes are packed first and take one token each) and less one for each
  running prefill (a running request computes at least one token a step,
  so none holds its blocks without progress);
* **it is work-conserving**: what the guaranteed tenants do not ask for
  goes to every request in the step's order (running, then waiting), up to
  what each asks, so a tenant without a share gets whatever is left;
* **a cap bounds a tenant** named in ``caps``: its prefill tokens in a step
  are at most ``cap * budget`` (at least one), even when nobody else asks.
  A cap is not work-conserving: it keeps the step short, so a request of
  another tenant arriving mid-step waits for a short step, not a long one.

A request's ask is its uncomputed tokens: for a running request, those of
its prompt (and output, after a preemption) not yet computed; for a
waiting one, the same less its cached-prefix hint from the last lookup
(the runtime matches again at admission). Within a tenant, its tokens go to
its requests in the step's order. The tokens a request is given but does
not use (deferred by admission, refused by memory) are not handed on
within the step.
"""

from __future__ import annotations

import math

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import ScheduleIR

_fractions = validators.deep_mapping(
    key_validator=validators.instance_of(str),
    value_validator=[validators.instance_of((int, float)), validators.ge(0), validators.le(1)],
    mapping_validator=validators.instance_of(dict),
)


@frozen
class TenantSharesSettings:
    #: Tenant -> the share of each step's prefill tokens it is guaranteed
    #: when it asks for them (a tenant not named: none; what is left over).
    shares: dict = field(factory=dict, validator=_fractions)
    #: Tenant -> the most of each step's prefill tokens it may take, asked
    #: for by others or not (a tenant not named: no cap).
    caps: dict = field(factory=dict, validator=_fractions)

    def __attrs_post_init__(self) -> None:
        if sum(self.shares.values()) > 1:
            raise ValueError(f"shares = {self.shares!r}: they add up to more than the step (1.0)")
        for tenant, share in self.shares.items():
            if share > self.caps.get(tenant, 1.0):
                raise ValueError(f"shares: tenant {tenant!r} is guaranteed {share}, more than its cap")


def _fraction(share: float, tokens: int) -> int:
    # Whole tokens, down; the epsilon keeps 0.29 of 100 at 29 (0.29 * 100 is 28.999...).
    return math.floor(share * tokens + 1e-9)


class TenantSharesPass:
    """Guaranteed shares and caps of each step's prefill tokens per tenant
    (the module's docstring)."""

    Settings = TenantSharesSettings

    def __init__(self, settings: TenantSharesSettings, context: PluginContext):
        self.shares = dict(settings.shares)
        self.caps = dict(settings.caps)

    @hookimpl
    def sagellm_schedule_pass(self, ir: ScheduleIR) -> None:
        budget = ir.token_budget
        asks: list[tuple[str, str, int, int]] = []  # (request id, tenant, tokens asked, tokens it has anyway)
        for state in ir.running:
            budget -= 1  # a decode's token, or a running prefill's floor
            if state.in_prefill:
                left = state.num_tokens - state.num_computed_tokens
                asks.append((state.request_id, state.request.tenant, left - 1, 1))
        for state in ir.waiting:
            left = state.num_tokens - state.cached_tokens_hint
            asks.append((state.request_id, state.request.tenant, max(1, left), 0))
        if budget <= 0 or not asks:
            return
        given = self._divide(asks, budget)
        limits = ir.chunk_limits
        for (request_id, _, asked, floor), tokens in zip(asks, given):
            if tokens < asked:
                limits[request_id] = min(limits.get(request_id, floor + tokens), floor + tokens)

    def _divide(self, asks: list[tuple[str, str, int, int]], budget: int) -> list[int]:
        """Each ask's tokens: the guaranteed tenants' shares first, each
        tenant's in order, then what is left in order, every tenant within
        its cap."""
        asked: dict[str, int] = {}
        for _, tenant, tokens, _ in asks:
            asked[tenant] = asked.get(tenant, 0) + tokens
        room = {t: max(1, _fraction(self.caps[t], budget)) if t in self.caps else budget for t in asked}
        owed = {t: min(n, _fraction(self.shares.get(t, 0.0), budget), room[t]) for t, n in asked.items()}
        left = budget - sum(owed.values())
        given = []
        for _, tenant, tokens, _ in asks:
            own = min(tokens, owed[tenant])
            owed[tenant] -= own
            room[tenant] -= own
            given.append(own)
        for i, (_, tenant, tokens, _) in enumerate(asks):
            if left <= 0:
                break
            more = min(tokens - given[i], room[tenant], left)
            if more > 0:
                given[i] += more
                room[tenant] -= more
                left -= more
        return given
