"""Scheduling passes. Each is one plugin; the config lists them in order and
each refines the ScheduleIR that the previous one left (sorts are stable, so
a later pass's key wins and earlier passes break its ties)."""

from __future__ import annotations

from operator import attrgetter

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import ScheduleIR

_arrival = attrgetter("request.arrival_s")
_priority_arrival = attrgetter("request.priority", "request.arrival_s")


class FCFSPass:
    """``passes = ["fcfs"]``: waiting requests in arrival order (vLLM's
    default ``RequestQueue``)."""

    def __init__(self, settings, context: PluginContext):
        pass

    @hookimpl
    def sagellm_schedule_pass(self, ir: ScheduleIR) -> None:
        ir.waiting.sort(key=_arrival)


@frozen
class PrefixAwareSettings:
    #: Above this many waiting requests the pass leaves the order alone, as
    #: SGLang's ``lpm`` policy does: sorting a long queue costs more than it saves.
    max_queue: int = field(default=128, validator=[validators.instance_of(int), validators.gt(0)])


class PrefixAwarePass:
    """``passes = ["prefix-aware"]``: longest cached prefix first (SGLang's
    ``lpm``), so requests that reuse the cache run while it still holds their
    prefix. Uses each request's cached-token hint from the last lookup."""

    Settings = PrefixAwareSettings

    def __init__(self, settings: PrefixAwareSettings, context: PluginContext):
        self.max_queue = settings.max_queue

    @hookimpl
    def sagellm_schedule_pass(self, ir: ScheduleIR) -> None:
        if len(ir.waiting) <= self.max_queue:
            ir.waiting.sort(key=lambda state: -state.cached_tokens_hint)


class PriorityPass:
    """``passes = ["priority"]``: lower ``priority`` value first (vLLM's
    priority scheduling), arrival order among equals. Running requests are
    ordered the same way, so the default preemption rule (the tail of
    ``running``) preempts the lowest priority, latest arrival first, as vLLM
    does."""

    def __init__(self, settings, context: PluginContext):
        pass

    @hookimpl
    def sagellm_schedule_pass(self, ir: ScheduleIR) -> None:
        ir.waiting.sort(key=_priority_arrival)
        ir.running.sort(key=_priority_arrival)


@frozen
class ShortestPredictedSettings:
    #: Waiting earns this many tokens of head start per second, so a request
    #: predicted ``d`` tokens longer than a newer one waits at most
    #: ``d / aging_tokens_per_s`` seconds behind it: nothing starves.
    aging_tokens_per_s: float = field(default=20.0, validator=[validators.instance_of(float), validators.gt(0)])
    #: Predictions less confident than this are ignored: the request is
    #: ranked as if ``default_tokens`` long.
    min_confidence: float = field(
        default=0.0, validator=[validators.instance_of(float), validators.ge(0), validators.le(1)]
    )
    default_tokens: float = field(default=256.0, validator=[validators.instance_of(float), validators.gt(0)])
    #: Also order ``running`` shortest remaining first, so the default
    #: preemption rule (the tail) preempts the request furthest from done.
    order_running: bool = field(default=True, validator=validators.instance_of(bool))


class ShortestPredictedPass:
    """``passes = ["sjf"]``: shortest predicted job first, with aging. The
    rank of a waiting request is its predicted remaining output (the
    lifetime prediction conditioned on the tokens already generated, for a
    preempted request) minus ``aging_tokens_per_s`` times its wait. Short
    requests overtake long ones, which cuts mean latency when most of it is
    queueing; the aging term bounds how long anything waits."""

    Settings = ShortestPredictedSettings

    def __init__(self, settings: ShortestPredictedSettings, context: PluginContext):
        self.settings = settings

    def _remaining(self, state) -> float:
        prediction = state.prediction
        if prediction is None or prediction.confidence < self.settings.min_confidence:
            return max(1.0, self.settings.default_tokens - state.num_output_tokens)
        return prediction.remaining_tokens(state.num_output_tokens)

    @hookimpl
    def sagellm_schedule_pass(self, ir: ScheduleIR) -> None:
        aging = self.settings.aging_tokens_per_s
        ir.waiting.sort(key=lambda state: self._remaining(state) - aging * (ir.now_s - state.request.arrival_s))
        if self.settings.order_running:
            ir.running.sort(key=self._remaining)


@frozen
class EarliestDeadlineSettings:
    #: Requests already past their deadline go after those that can still
    #: meet theirs: their deadline is lost either way, and serving the others
    #: first saves more. Under sustained overload they can wait long (the
    #: report's longest wait shows it). False: plain earliest deadline first.
    late_last: bool = field(default=True, validator=validators.instance_of(bool))


class EarliestDeadlinePass:
    """``passes = ["edf"]``: earliest TTFT deadline first
    (``Request.deadline_s``, from ``[workload] ttft_slo_s``). Requests whose
    first token is out (preempted ones) go first, their deadline settled;
    requests without a deadline go last, in arrival order."""

    Settings = EarliestDeadlineSettings

    def __init__(self, settings: EarliestDeadlineSettings, context: PluginContext):
        self.late_last = settings.late_last

    @hookimpl
    def sagellm_schedule_pass(self, ir: ScheduleIR) -> None:
        now, late_last = ir.now_s, self.late_last

        def rank(state) -> tuple[int, float]:
            deadline = state.request.deadline_s
            if state.first_token_s is not None:
                return (0, state.request.arrival_s)
            if deadline is None:
                return (3, state.request.arrival_s)
            return (2 if late_last and deadline < now else 1, deadline)

        ir.waiting.sort(key=rank)
