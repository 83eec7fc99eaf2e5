"""The hook timer keeps constant memory: exact counts and totals, a bounded
uniform sample for percentiles."""

import pytest

from sagellm_core.timing import RESERVOIR, HookStats


def test_counts_and_totals_are_exact_and_the_sample_is_bounded():
    stats = HookStats()
    n = 3 * RESERVOIR
    for i in range(n):
        stats.record(1e-6 * (i % 100), None if i % 2 else 1)
    assert len(stats.durations_s) == RESERVOIR
    assert stats.calls == n
    assert stats.answered == n // 2
    assert stats.total_s == pytest.approx(sum(1e-6 * (i % 100) for i in range(n)))
    # Uniform over all calls: the sampled median is that of 0..99 us.
    assert 40 <= stats.percentile_us(0.5) <= 60


def test_the_sample_stays_uniform_over_a_long_run():
    # Durations that change half-way: a sample that stopped taking calls
    # (or took only late ones) would hold one value; a uniform one holds
    # each about half the time, and the middle tenth about a tenth.
    stats = HookStats()
    n = 20 * RESERVOIR
    for i in range(n):
        stats.record(float(i), 1)
    kept = list(stats.durations_s)
    assert len(kept) == RESERVOIR
    late = sum(1 for d in kept if d >= n / 2) / RESERVOIR
    middle = sum(1 for d in kept if 0.45 * n <= d < 0.55 * n) / RESERVOIR
    assert 0.47 <= late <= 0.53
    assert 0.08 <= middle <= 0.12
    assert max(kept) > 0.99 * n  # the last calls are reachable


def test_below_the_bound_every_duration_is_kept():
    stats = HookStats()
    for i in range(10):
        stats.record(float(i), [])
    assert list(stats.durations_s) == [float(i) for i in range(10)]
    assert stats.answered == 0  # an empty list of answers is no answer
