"""The footprint rule on its own."""

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
    r = rule()
    running = [state("r", 8, predicted(24), blocks=2)]
    ask(r, state("a", 4, predicted(4)), running, available=100)
    running[0].block_ids = list(range(8))  # (the running list's states change only between steps)
    ask(r, state("b", 4, predicted(4)), running, available=100)
    assert r._growth == 6  # the same step: the growth summed at its first decision
    running.append(state("a", 4, predicted(4), blocks=1))  # an admission in the step
    ask(r, state("c", 4, predicted(4)), running, available=100)
    assert r._growth == 1  # summed again: r holds its 8, a grows by 1
