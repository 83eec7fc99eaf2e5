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
  another tenant arriving mid-step waits for a short step, not a long one;
* **a tenant yields to the guaranteed ones** where ``contended_caps``
  names it (a tenant without a share): in a step in which a tenant with a
  share asks for prefill tokens, its cap is its contended cap (0: none,
  but for a running prefill's floor of one token). Prefill is
  compute-bound, so a capped tenant's chunk riding in a step of decodes
  costs little, but in the step that computes another tenant's prompt it
  adds its whole compute time to that prompt's first token; this keeps it
  out of exactly those steps. The price: while guaranteed tenants prefill
  in every step, the yielding tenant's waiting requests get nothing.

A request's ask is its uncomputed tokens: for a running request, those of
its prompt (and output, after a preemption) not yet computed; for a
waiting one, the same less its cached-prefix hint from the last lookup
(the runtime matches again at admission). A hint may be stale: blocks it
counted may be evicted by the time the request is admitted, and the
request then computes more than it asked for. So a capped tenant's
waiting request is limited to what it is given even when that covers its
ask: its cap holds whatever admission finds. Within a tenant, its tokens go to
its requests in the step's order. The tokens a request is given but does
not use (deferred by admission, refused by memory) are not handed on
within the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import compress, count
from operator import attrgetter
from typing import Any

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
    #: Tenant (without a share) -> its cap in a step in which a tenant with
    #: a share asks for prefill tokens (a tenant not named: its cap).
    contended_caps: dict = field(factory=dict, validator=_fractions)

    def __attrs_post_init__(self) -> None:
        if sum(self.shares.values()) > 1:
            raise ValueError(f"shares = {self.shares!r}: they add up to more than the step (1.0)")
        for tenant, share in self.shares.items():
            if share > self.caps.get(tenant, 1.0):
                raise ValueError(f"shares: tenant {tenant!r} is guaranteed {share}, more than its cap")
        for tenant, cap in self.contended_caps.items():
            if self.shares.get(tenant):
                raise ValueError(f"contended_caps: tenant {tenant!r} has a share; only a tenant without one yields")
            if cap > self.caps.get(tenant, 1.0):
                raise ValueError(f"contended_caps: tenant {tenant!r} may take {cap} contended, more than its cap")


_tenant = attrgetter("request.tenant")
_request_id = attrgetter("request.request_id")


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
        self.contended_caps = dict(settings.contended_caps)
        self.sharing = {t for t, share in settings.shares.items() if share > 0}
        # The tenants whose waiting requests are held to what they are given.
        self.capped = settings.caps.keys() | settings.contended_caps.keys()
        #: Steps in which a tenant with a share asked for prefill tokens, and
        #: of those, the steps each yielding tenant had requests to prefill in.
        self.contended_steps = 0
        self.yielded_steps: dict[str, int] = {}

    @hookimpl
    def sagellm_schedule_pass(self, ir: ScheduleIR) -> None:
        running, waiting = ir.running, ir.waiting
        budget = ir.token_budget - len(running)  # a decode's token, or a running prefill's floor, each
        prefills = [state for state in running if state.in_prefill]
        if budget <= 0 or not (prefills or waiting):
            return
        # The asks are the running prefills', then the waiting requests', in
        # order; only those that a share or the leftover reaches are read one
        # by one (the waiting queue's tenants are read at C speed), so a long
        # queue of requests that get nothing costs a dict update, not a loop.
        num_prefills = len(prefills)
        tenants = [state.request.tenant for state in prefills]
        tenants += map(_tenant, waiting)
        asks: dict[int, int] = {}  # position -> tokens asked (read when first needed)

        def ask(i: int) -> int:
            tokens = asks.get(i)
            if tokens is None:
                if i < num_prefills:
                    state = prefills[i]
                    tokens = state.num_tokens - state.num_computed_tokens - 1
                else:
                    state = waiting[i - num_prefills]
                    tokens = max(1, state.num_tokens - state.cached_tokens_hint)
                asks[i] = tokens
            return tokens

        contended = self._contended(tenants, num_prefills, ask)
        if contended:
            self.contended_steps += 1
            for tenant in self.contended_caps.keys() & set(tenants):
                self.yielded_steps[tenant] = self.yielded_steps.get(tenant, 0) + 1
        given = self._divide(tenants, ask, budget, contended)
        limits = ir.chunk_limits
        for i in range(num_prefills):  # a running prefill keeps its floor of one token
            tokens = given.get(i, 0)
            if tokens < ask(i):
                request_id = prefills[i].request_id
                limits[request_id] = min(limits.get(request_id, 1 + tokens), 1 + tokens)
        # A waiting request that no share or leftover reached asks for a token
        # at least and is given none: held back (0), all of them at once.
        held = dict.fromkeys(map(_request_id, waiting), 0)
        capped = self.capped
        for i, tokens in asks.items():
            if i >= num_prefills:
                request = waiting[i - num_prefills].request
                if given.get(i, 0) < tokens or request.tenant in capped:
                    held[request.request_id] = given.get(i, 0)
                else:
                    del held[request.request_id]
        for request_id in limits.keys() & held.keys():  # an earlier pass's cap stands where it is lower
            held[request_id] = min(limits[request_id], held[request_id])
        limits.update(held)

    @hookimpl
    def sagellm_report_figures(self) -> dict[str, Any] | None:
        if not self.contended_caps:
            return None
        yielded = dict(sorted(self.yielded_steps.items()))
        return {"tenant-shares": {"contended_steps": self.contended_steps, "yielded_steps": yielded}}

    def _contended(self, tenants: list[str], num_prefills: int, ask: Callable[[int], int]) -> bool:
        """Whether a tenant with a share asks for prefill tokens this step
        (a waiting request asks for one at least; a running prefill may
        have only its floor left). Read only where a tenant yields."""
        if not self.contended_caps or not self.sharing:
            return False
        sharing = self.sharing
        for i in compress(count(), map(sharing.__contains__, tenants)):
            if i >= num_prefills or ask(i) > 0:
                return True
        return False

    def _divide(self, tenants: list[str], ask: Callable[[int], int], budget: int, contended: bool) -> dict[int, int]:
        """Position -> the tokens it is given, where any: the guaranteed
        tenants' shares first, each tenant's in order, then what is left in
        order, every tenant within its cap (its contended cap in a
        contended step)."""
        # A capped tenant's room; an uncapped one's never binds (it is at
        # least what is left of the step). A contended cap may be 0.
        room = {t: max(1, _fraction(cap, budget)) for t, cap in self.caps.items()}
        if contended:
            room.update({t: _fraction(cap, budget) for t, cap in self.contended_caps.items()})
        owed = {t: n for t, share in self.shares.items() if (n := min(_fraction(share, budget), room.get(t, budget)))}
        given: dict[int, int] = {}  # position -> tokens given, where any
        # The positions of the tenants a phase concerns are picked at C speed
        # (``compress`` over a lazy ``map``, which sees the sets as they shrink).
        if owed:  # the guaranteed shares, each tenant's to its requests in order
            for i in compress(count(), map(owed.__contains__, tenants)):
                tenant = tenants[i]
                left_owed = owed[tenant]
                own = min(ask(i), left_owed)
                if own:
                    given[i] = own
                    if tenant in room:
                        room[tenant] -= own
                if own == left_owed:
                    del owed[tenant]
                    if not owed:
                        break
                else:
                    owed[tenant] = left_owed - own
        left = budget - sum(given.values())
        open_tenants = {t for t in set(tenants) if room.get(t, left) > 0}
        for i in compress(count(), map(open_tenants.__contains__, tenants)):  # what is left, to every request in order
            if left <= 0:
                break
            tenant = tenants[i]
            more = min(ask(i) - given.get(i, 0), room.get(tenant, left), left)
            if more > 0:
                given[i] = given.get(i, 0) + more
                left -= more
                if tenant in room:
                    room[tenant] -= more
                    if room[tenant] <= 0:  # at its cap: its requests' asks are not read
                        open_tenants.discard(tenant)
        return given
