"""The hook timer keeps constant memory: exact counts and totals, a bounded
uniform sample for percentiles."""

import pytest

from sagellm_core.parts.timing import RESERVOIR, HookStats


def test_counts_and_totals_are_exact_and_the_sample_is_bounded():
    stats = HookStats()
    n = 3 * RESERVOIR
    for i in range(n):
        stats.calls += 1
        stats.add(1e-6 * (i % 100))
    assert len(stats.durations_s) == RESERVOIR
    assert stats.calls == n
    assert stats.total_s == pytest.approx(sum(1e-6 * (i % 100) for i in range(n)))
    # Uniform over all calls: the sampled median is that of 0..99 us.
    assert 40 <= stats.percentile_us(0.5) <= 60


def test_below_the_bound_every_duration_is_kept():
    stats = HookStats()
    for i in range(10):
        stats.calls += 1
        stats.add(float(i))
    assert list(stats.durations_s) == [float(i) for i in range(10)]
