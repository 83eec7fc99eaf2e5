"""The predicted length distribution a LifetimePrediction describes: its CDF,
its quantiles, and the remaining length as decoding proceeds."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sagellm_core.types import QUANTILE_LEVELS, LifetimePrediction

# Token counts, to a thousandth of a token: two quantiles a few ulps apart
# (1.1754943508e-38 and 1.175494351e-38, which hypothesis found) make a
# segment so steep that no float CDF inverts it to 1e-9.
lengths = st.lists(
    st.floats(0, 5000).map(lambda v: round(v, 3)), min_size=len(QUANTILE_LEVELS), max_size=len(QUANTILE_LEVELS)
)


def from_quantiles(values):
    q = sorted(values)
    return LifetimePrediction(q[4], q[0], q[-1], 0.5, "test", q)


@given(lengths, st.floats(0, 20000), st.floats(0, 20000))
def test_cdf_is_a_distribution_function(values, a, b):
    p = from_quantiles(values)
    lo, hi = sorted((a, b))
    assert 0.0 <= p.cdf(lo) <= p.cdf(hi) <= 1.0  # 1.0 only by rounding, far in the tail
    assert p.cdf(hi) < 1.0 or hi > max(values) + 30


@given(lengths, st.floats(0.0, 0.999))
def test_quantile_inverts_cdf(values, level):
    p = from_quantiles(values)
    x = p.quantile(level)
    assert math.isfinite(x)
    # Flat stretches of the CDF (equal quantiles) make the inverse one-sided.
    assert p.cdf(x) >= level - 1e-9


@given(lengths, st.integers(0, 20000))
def test_remaining_tokens_is_at_least_one_and_beyond_generated(values, generated):
    p = from_quantiles(values)
    remaining = p.remaining_tokens(generated)
    assert remaining >= 1.0 or (generated == 0 and remaining == p.output_tokens)
    assert math.isfinite(remaining)


def test_remaining_tokens_conditions_on_what_was_generated():
    # Deciles of a request that is either short (about 50) or long (about 1000).
    p = LifetimePrediction(60, 40, 1100, 0.5, "test", (40, 45, 50, 55, 60, 900, 950, 1000, 1100))
    assert p.remaining_tokens(0) == 60
    # Past 100 tokens it is a long one: about 1000 - 100 to go, not 60 - 100.
    assert 800 < p.remaining_tokens(100) < 1000
    # Past every quantile, the exponential tail: its median, from the upper spread.
    assert p.remaining_tokens(5000) == pytest.approx((1100 - 60) * math.log(2))


def test_interval_only_prediction_reads_low_median_high():
    p = LifetimePrediction(100, 10, 300, 0.5)
    assert p.cdf(10) == pytest.approx(0.1) and p.cdf(100) == pytest.approx(0.5) and p.cdf(300) == pytest.approx(0.9)
    assert p.quantile(0.5) == pytest.approx(100)


@pytest.mark.parametrize(
    "prediction, problem",
    [
        (LifetimePrediction(float("nan"), 0, 1, 0.5), "negative or non-finite"),
        (LifetimePrediction(5, 6, 9, 0.5), "out of order"),
        (LifetimePrediction(5, 1, 9, 1.5), "confidence 1.5 outside 0..1"),
        (LifetimePrediction(5, 1, 9, 0.5, quantiles=(1, 2, 3)), "3 quantiles"),
        (LifetimePrediction(5, 1, 9, 0.5, quantiles=(9, 8, 7, 6, 5, 4, 3, 2, 1)), "non-decreasing"),
    ],
)
def test_problem_names_what_is_wrong(prediction, problem):
    assert problem in prediction.problem()


def test_sound_prediction_has_no_problem():
    assert LifetimePrediction(5, 1, 9, 0.5, quantiles=range(1, 10)).problem() is None
