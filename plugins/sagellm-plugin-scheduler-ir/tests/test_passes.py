import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sagellm_plugin_scheduler_ir.passes import (
    EarliestDeadlinePass,
    EarliestDeadlineSettings,
    FCFSPass,
    PrefixAwarePass,
    PrefixAwareSettings,
    PriorityPass,
    ShortestPredictedPass,
    ShortestPredictedSettings,
)

from sagellm_core import PluginContext
from sagellm_core.types import LifetimePrediction, Request, ScheduleIR, SequenceState

CTX = PluginContext("p", block_size=16, num_blocks=100)


def ir(states):
    return ScheduleIR(0.0, list(states), [], 100, 8)


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


# --- sjf: shortest predicted job first, with aging ----------------------------


def predicted(rid, arrival, tokens, confidence=1.0, generated=0):
    s = SequenceState(Request(rid, [1, 2], 1, arrival_s=arrival))
    s.prediction = LifetimePrediction(tokens, tokens / 2, tokens * 2, confidence, "test")
    s.num_output_tokens = generated
    return s


def sjf(**kw):
    return ShortestPredictedPass(ShortestPredictedSettings(**kw), CTX)


def test_sjf_puts_shortest_prediction_first():
    x = ir([predicted("long", 0.0, 900), predicted("short", 0.1, 50), predicted("mid", 0.2, 300)])
    sjf().sagellm_schedule_pass(ir=x)
    assert ids(x.waiting) == ["short", "mid", "long"]


def test_sjf_aging_lets_a_long_wait_overtake():
    # 1000 tokens longer, but it has waited 60 s at 20 tokens/s of aging: 1200 tokens of head start.
    x = ir([predicted("new-short", 60.0, 100), predicted("old-long", 0.0, 1100)])
    x.now_s = 60.0
    sjf(aging_tokens_per_s=20.0).sagellm_schedule_pass(ir=x)
    assert ids(x.waiting) == ["old-long", "new-short"]


def test_sjf_ignores_predictions_below_min_confidence():
    x = ir([predicted("unsure-short", 0.0, 10, confidence=0.1), predicted("sure", 0.0, 200)])
    sjf(min_confidence=0.5, default_tokens=256.0).sagellm_schedule_pass(ir=x)
    assert ids(x.waiting) == ["sure", "unsure-short"]


def test_sjf_ranks_a_preempted_request_by_what_remains():
    # Predicted 600 (300..1200), 1000 generated: the distribution
    # conditioned on 1000 leaves about 175 to go, less than a fresh 300.
    x = ir([predicted("fresh", 0.0, 300), predicted("resumed", 0.0, 600, generated=1000)])
    sjf().sagellm_schedule_pass(ir=x)
    assert ids(x.waiting) == ["resumed", "fresh"]


def test_sjf_orders_running_so_the_tail_is_furthest_from_done():
    x = ir([])
    x.running = [predicted("a", 0.0, 900), predicted("b", 0.0, 20), predicted("c", 0.0, 300)]
    sjf().sagellm_schedule_pass(ir=x)
    assert ids(x.running) == ["b", "c", "a"]
    sjf(order_running=False).sagellm_schedule_pass(ir=(y := ir([])))
    assert y.running == []


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 4000), min_size=1, max_size=40), aging=st.sampled_from([5.0, 20.0, 100.0]))
def test_sjf_never_starves(lengths, aging):
    """One request is served a second; a stream of short ones keeps coming.
    The long request at the head of time is served within the aging bound:
    (its length - the shortest) / aging seconds, plus the queue ahead of it."""
    victim = predicted("victim", 0.0, 5000)
    waiting = [victim] + [predicted(f"r{i}", 0.0, n) for i, n in enumerate(lengths)]
    shortest = 1
    bound = (5000 - shortest) / aging + len(lengths) + 1
    now, i = 0.0, 0
    while victim in waiting:
        x = ir(waiting)
        x.now_s = now
        sjf(aging_tokens_per_s=aging).sagellm_schedule_pass(ir=x)
        waiting = x.waiting[1:]  # serve the head
        now += 1.0
        waiting.append(predicted(f"n{i}", now, shortest))  # a newcomer every second
        i += 1
        assert now <= bound


def test_edf_serves_the_deadlines_that_can_still_be_met_first():
    def waiting(rid, arrival, deadline=None, started=False):
        s = SequenceState(Request(rid, [1, 2], 1, arrival_s=arrival, deadline_s=deadline))
        s.first_token_s = 9.0 if started else None
        return s

    states = [
        waiting("none", 0.0),
        waiting("late", 1.0, 4.0),
        waiting("soon", 3.0, 6.0),
        waiting("later", 2.0, 8.0),
        waiting("preempted", 5.0, 5.5, started=True),
    ]
    x = ScheduleIR(5.0, list(states), [], 100, 8)  # now = 5 s: "late" has missed its deadline
    EarliestDeadlinePass(EarliestDeadlineSettings(), CTX).sagellm_schedule_pass(ir=x)
    assert ids(x.waiting) == ["preempted", "soon", "later", "late", "none"]
    plain = ScheduleIR(5.0, list(states), [], 100, 8)
    EarliestDeadlinePass(EarliestDeadlineSettings(late_last=False), CTX).sagellm_schedule_pass(ir=plain)
    assert ids(plain.waiting) == ["preempted", "late", "soon", "later", "none"]
