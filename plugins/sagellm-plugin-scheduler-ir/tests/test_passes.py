import pytest
from sagellm_plugin_scheduler_ir.passes import FCFSPass, PrefixAwarePass, PrefixAwareSettings, PriorityPass

from sagellm_core import PluginContext
from sagellm_core.types import Request, ScheduleIR, SequenceState

CTX = PluginContext("p", block_size=16, num_blocks=100)


def ir(states):
    return ScheduleIR(0.0, 0, list(states), [], 100, 8, 16, 100, 0)


def state(rid, arrival, cached=0, priority=0):
    s = SequenceState(Request(rid, [1, 2], 1, arrival_s=arrival, priority=priority))
    s.cached_tokens_hint = cached
    return s


def ids(states):
    return [s.request_id for s in states]


def test_fcfs_orders_by_arrival():
    x = ir([state("b", 2.0), state("a", 1.0), state("c", 3.0)])
    FCFSPass(None, CTX).sagellm_schedule_pass(ir=x)
    assert ids(x.waiting) == ["a", "b", "c"]


def test_prefix_aware_puts_longest_match_first_with_fcfs_ties():
    x = ir([state("c", 3.0, 32), state("a", 1.0, 0), state("b", 2.0, 32), state("d", 4.0, 64)])
    FCFSPass(None, CTX).sagellm_schedule_pass(ir=x)
    PrefixAwarePass(PrefixAwareSettings(), CTX).sagellm_schedule_pass(ir=x)
    assert ids(x.waiting) == ["d", "b", "c", "a"]


def test_prefix_aware_leaves_long_queues_alone():
    x = ir([state("a", 1.0, 0), state("b", 2.0, 32)])
    PrefixAwarePass(PrefixAwareSettings(max_queue=1), CTX).sagellm_schedule_pass(ir=x)
    assert ids(x.waiting) == ["a", "b"]


def test_priority():
    x = ir([state("a", 1.0, priority=1), state("b", 2.0, priority=0), state("c", 0.5, priority=1)])
    PriorityPass(None, CTX).sagellm_schedule_pass(ir=x)
    assert ids(x.waiting) == ["b", "c", "a"]


def test_settings_validate():
    with pytest.raises(ValueError):
        PrefixAwareSettings(max_queue=0)
