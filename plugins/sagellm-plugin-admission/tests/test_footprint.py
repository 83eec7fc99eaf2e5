"""The footprint rule on its own."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sagellm_plugin_admission.footprint import FootprintAdmission, FootprintSettings

from sagellm_core import PluginContext
from sagellm_core.types import Admission, LifetimePrediction, Request, SequenceState

BLOCK = 4


def rule(**kw) -> FootprintAdmission:
    return FootprintAdmission(FootprintSettings(**kw), PluginContext("footprint", block_size=BLOCK, num_blocks=100))


def predicted(output: float, spread: float = 0.0) -> LifetimePrediction:
    return LifetimePrediction(output, max(0.0, output - spread), output + spread, 0.9)


def state(name: str, prompt: int, prediction=None, arrival_s: float = 0.0, blocks: int = 0) -> SequenceState:
    s = SequenceState(request=Request(name, list(range(prompt)), 1000, arrival_s=arrival_s), prediction=prediction)
    s.block_ids = list(range(blocks))
    return s


def ask(r, s, running, available, now_s=1.0):
    decision = r.sagellm_admit_request(state=s, now_s=now_s, running=running, available_blocks=available)
    return Admission.ADMIT if decision is None else decision.verdict


def test_a_request_is_admitted_when_it_and_the_running_requests_growth_fit():
    r = rule()
    running = [state("r", 8, predicted(24), blocks=2)]  # 8 + 24 tokens: 8 blocks, 6 to grow
    new = state("n", 16, predicted(16))  # 8 blocks
    assert ask(r, new, running, available=13) is Admission.DEFER
    assert ask(r, new, running, available=14) is Admission.ADMIT
    assert (r.admitted, r.deferred) == (1, 1)


def test_the_quantile_is_the_margin():
    spread = predicted(20, spread=20)  # 10th percentile 0, median 20, 90th 40
    running = [state("r", 4, predicted(0), blocks=1)]  # a token at least: one block to grow
    new = state("n", 4, spread)
    assert ask(rule(quantile=0.5), new, running, available=7) is Admission.ADMIT  # 4 + 20 tokens: 6 blocks
    assert ask(rule(quantile=0.9), new, running, available=7) is Admission.DEFER  # 4 + 40 tokens: 11 blocks


def test_a_request_past_its_margin_is_predicted_from_what_it_generated():
    r = rule(quantile=0.9)
    s = state("r", 4, predicted(20, spread=10), blocks=10)  # margin: 30 tokens
    assert r.predicted_tokens(s) == 34
    s.num_output_tokens = 36
    assert r.predicted_tokens(s) > 4 + 36  # the distribution past 36 tokens


def test_greedy_with_nothing_running_and_one_request_after_max_wait_without_admissions():
    r = rule(max_wait_s=5.0, default_output_tokens=8)
    big, other = state("big", 400, predicted(400), arrival_s=0.0), state("other", 400, predicted(400))
    assert ask(r, big, [], available=0, now_s=1.0) is Admission.ADMIT  # nothing runs: never deferred into a rejection
    running = [state("r", 4, predicted(4), blocks=2)]
    assert ask(r, big, running, available=10, now_s=5.9) is Admission.DEFER  # 4.9 s since the last admission
    assert ask(r, big, running, available=10, now_s=6.0) is Admission.ADMIT  # nothing admitted for 5 s
    assert ask(r, other, running, available=10, now_s=6.0) is Admission.DEFER  # one, then the clock starts again
    assert ask(r, other, running, available=10, now_s=11.0) is Admission.ADMIT
    assert r.fallbacks == 3
    assert r.predicted_tokens(state("none", 4)) == 12  # the default output length


def test_growth_is_summed_once_a_step_until_an_admission_changes_running():
    r = rule(demand="sum")
    running = [state("r", 8, predicted(24), blocks=2)]
    ask(r, state("a", 4, predicted(4)), running, available=100)
    running[0].block_ids = list(range(8))  # (the running list's states change only between steps)
    ask(r, state("b", 4, predicted(4)), running, available=100)
    assert r._growth == 6  # the same step: the growth summed at its first decision
    running.append(state("a", 4, predicted(4), blocks=1))  # an admission in the step
    ask(r, state("c", 4, predicted(4)), running, available=100)
    assert r._growth == 1  # summed again: r holds its 8, a grows by 1


# ------------------------------------------------------------------ peak demand --


def test_sum_is_the_demand_the_setting_names():
    r = rule(demand="sum")
    running = [state("r", 8, predicted(24), blocks=2)]
    assert ask(r, state("n", 16, predicted(16)), running, available=13) is Admission.DEFER
    assert r.sagellm_report_figures()["footprint"]["demand"] == "sum"


def test_a_request_ending_before_another_grows_returns_its_blocks():
    # "short" holds 10 blocks and ends next step; "long" holds 1 and grows 7 blocks over 28 steps.
    running = [state("short", 39, predicted(1), blocks=10), state("long", 4, predicted(28), blocks=1)]
    new = state("n", 8, predicted(8))  # 4 blocks in the end, its end after both
    # sum: long's 7 blocks of growth beside 4 = 11; the peak: 1 block (long's next, at short's end),
    # and at long's end short has freed its 10: 7 - 10.
    assert ask(rule(demand="sum"), new, running, available=8) is Admission.DEFER
    assert ask(rule(demand="peak"), new, running, available=8) is Admission.ADMIT
    assert rule().peak_profile(running) == ([1, 28], [0, 1, 1])
    assert ask(rule(demand="peak"), new, running, available=4) is Admission.DEFER  # 1 beside 4


def test_the_peak_before_an_early_end_counts():
    # "a" ends after 2 steps; "b" grows 5 blocks over 20 steps; the candidate ends at step 1.
    running = [state("a", 8, predicted(2), blocks=2), state("b", 4, predicted(20), blocks=1)]
    new = state("n", 3, predicted(1))  # 1 block
    # at a's end (the first at or after the candidate's): a grows 1 (10 tokens), b reaches 6 tokens: 1 more;
    # at b's end a has freed 2 and b grew 5: 3, after the candidate has ended.
    r = rule()
    assert r.peak_profile(running) == ([2, 20], [0, 2, 3])
    assert ask(r, new, running, available=2) is Admission.DEFER  # 2 beside 1
    assert ask(rule(), new, running, available=3) is Admission.ADMIT
    assert ask(rule(demand="sum"), new, running, available=3) is Admission.DEFER  # 1 + 5 beside 1


def test_a_running_peak_that_cannot_fit_defers_even_a_request_ending_first():
    running = [state("a", 8, predicted(2), blocks=2), state("b", 4, predicted(20), blocks=1)]  # peak 3
    new = state("n", 3, predicted(1))
    assert ask(rule(), new, running, available=2) is Admission.DEFER


def test_the_peak_is_computed_once_a_step_and_only_where_the_sum_does_not_fit():
    r = rule()
    running = [state("r", 8, predicted(24), blocks=2)]  # 6 blocks to grow
    ask(r, state("a", 4, predicted(4)), running, available=100)
    assert r._profile is None  # the sum fits: so does the peak
    ask(r, state("b", 4, predicted(4)), running, available=7)  # 2 beside 6: the peak is needed
    profile = r._profile
    assert profile == ([24], [0, 6])
    running[0].block_ids = list(range(8))
    ask(r, state("c", 4, predicted(4)), running, available=7)
    assert r._profile is profile  # the same step
    running.append(state("a", 4, predicted(4), blocks=1))
    ask(r, state("d", 4, predicted(4)), running, available=2)
    assert r._profile == ([4, 24], [0, 1, 1])  # an admission in the step: computed again


def test_a_bad_demand_is_refused():
    with pytest.raises(ValueError, match="demand"):
        rule(demand="max")


def test_a_request_deferred_after_hold_s_holds_back_those_after_it_in_its_step():
    r = rule()  # hold_s = 2.0
    running = [state("r", 8, predicted(24), blocks=2)]  # 6 blocks to grow
    big, small = state("big", 40, predicted(40), arrival_s=0.0), state("small", 4, predicted(4), arrival_s=0.5)
    assert ask(r, big, running, available=10, now_s=1.9) is Admission.DEFER  # waited 1.9 s: no hold
    assert ask(r, small, running, available=10, now_s=1.9) is Admission.ADMIT
    assert ask(r, big, running, available=10, now_s=2.0) is Admission.DEFER  # waited 2 s: it holds the step
    assert ask(r, small, running, available=10, now_s=2.0) is Admission.DEFER
    assert ask(r, small, running, available=10, now_s=2.1) is Admission.ADMIT  # the next step, big not asked first
    assert ask(r, big, running, available=26, now_s=2.2) is Admission.ADMIT  # 20 beside 6
    assert ask(r, small, running, available=26, now_s=2.2) is Admission.ADMIT  # an admitted request holds nothing


def test_without_hold_s_a_long_wait_holds_nothing_back():
    r = rule(hold_s=float("inf"))
    running = [state("r", 8, predicted(24), blocks=2)]
    big, small = state("big", 40, predicted(40), arrival_s=0.0), state("small", 4, predicted(4), arrival_s=0.5)
    assert ask(r, big, running, available=10, now_s=9.0) is Admission.DEFER
    assert ask(r, small, running, available=10, now_s=9.0) is Admission.ADMIT


def truthful_peak(running, new, size):
    """The largest occupancy beyond the blocks held, stepping a token at a time, requests freeing at their ends."""
    members = [(s.num_tokens, t, len(s.block_ids)) for s, t in running] + [(new[0].num_tokens, new[1], 0)]
    horizon = max(t - now for now, t, _ in members)
    peak = 0
    for step in range(horizon + 1):
        occupancy = 0
        for now, total, held in members:
            if step <= total - now:
                occupancy += max(0, -(-min(now + step, total) // size) - held)
            else:
                occupancy -= held
        peak = max(peak, occupancy)
    return peak


requests = st.tuples(st.integers(1, 60), st.integers(1, 60), st.integers(0, 20))


@settings(max_examples=300, deadline=None)
@given(st.lists(requests, min_size=1, max_size=8), st.tuples(st.integers(1, 60), st.integers(1, 60)), st.data())
def test_peak_admits_what_sum_admits_and_nothing_whose_truthful_peak_cannot_fit(running_spec, new_spec, data):
    """With the predictions exact: the peak rule admits whatever the sum rule
    admits, and never a request whose true peak occupancy cannot fit."""
    running = []
    for i, (prompt, output, generated) in enumerate(running_spec):
        s = state(f"r{i}", prompt, predicted(float(output + generated)))
        s.num_output_tokens = min(generated, output + generated - 1)
        s.block_ids = list(range(-(-s.num_tokens // BLOCK)))
        running.append(s)
    new = state("n", new_spec[0], predicted(float(new_spec[1])))
    available = data.draw(st.integers(0, 120))
    peak_rule, sum_rule = rule(hold_s=data.draw(st.sampled_from([0.0, 1.0, float("inf")]))), rule(demand="sum")
    by_peak = ask(peak_rule, new, running, available)
    by_sum = ask(sum_rule, new, running, available)
    if by_sum is Admission.ADMIT:
        assert by_peak is Admission.ADMIT
    totals = [(s, peak_rule.predicted_tokens(s)) for s in running]
    if truthful_peak(totals, (new, peak_rule.predicted_tokens(new)), BLOCK) > available:
        assert by_peak is Admission.DEFER
