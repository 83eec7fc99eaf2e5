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
