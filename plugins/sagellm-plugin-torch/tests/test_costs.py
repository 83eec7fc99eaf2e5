"""The torch engine's measured costs of loads against recompute: the fit
finds a store's latency and time per block, one stalled load moves it
little, an unmeasured store is loaded from (to measure it), and one not
loaded from for a while is loaded from again."""

import math

from hypothesis import given
from hypothesis import strategies as st
from sagellm_plugin_torch.costs import LinearFit, MeasuredCosts, weighted_median

latency = st.floats(0.0, 0.01)
per_block = st.floats(1e-6, 1e-3)
sizes = st.lists(st.integers(1, 64), min_size=2, max_size=16).filter(lambda s: len(set(s)) > 1)


@given(fixed=latency, slope=per_block, units=sizes)
def test_the_fit_finds_latency_and_time_per_block_on_exact_loads(fixed, slope, units):
    fit = LinearFit.of([(u, fixed + slope * u) for u in units])
    assert math.isclose(fit.per_unit_s, slope, rel_tol=1e-6)
    assert math.isclose(fit.fixed_s, fixed, rel_tol=1e-6, abs_tol=1e-12)


@given(fixed=latency, slope=per_block, units=st.lists(st.integers(1, 64), min_size=6, max_size=16, unique=True))
def test_one_stalled_load_moves_the_fit_little(fixed, slope, units):
    points = [(u, fixed + slope * u) for u in units]
    points[len(points) // 2] = (points[len(points) // 2][0], 10.0)  # stalled for 10 s
    fit = LinearFit.of(points)
    for u in units:
        assert fit.at(u) <= 3 * (fixed + slope * u) + 1e-9


@given(seconds=st.floats(1e-6, 10.0), units=st.integers(1, 64))
def test_loads_of_one_size_are_all_per_block(seconds, units):
    fit = LinearFit.of([(units, seconds)] * 3)
    assert fit.fixed_s == 0.0 and math.isclose(fit.at(units), seconds)


def test_the_fit_never_goes_negative():
    falling = LinearFit.of([(1, 0.5), (10, 0.1), (20, 0.05)])
    assert falling.per_unit_s == 0.0 and falling.fixed_s > 0
    steep = LinearFit.of([(1, 0.0), (2, 1.0), (3, 2.0)])
    assert steep.fixed_s == 0.0 and steep.per_unit_s == 1.0


def test_unmeasured_costs_take_every_load():
    costs = MeasuredCosts()
    assert costs.load_s("host", 100) == 0.0 and costs.recompute_s(1, 0) == math.inf
    costs.prefilled(0, 1.0)  # a step that computed nothing teaches nothing
    assert costs.recompute_s(1, 0) == math.inf


def test_recompute_is_the_median_token_s_seconds_in_prefill_steps():
    costs = MeasuredCosts()
    for tokens, seconds in ((2000, 2.0), (3, 0.3), (3, 0.3), (3, 0.3), (50, 50.0)):  # small steps dear, one stalled
        costs.prefilled(tokens, seconds)
    assert math.isclose(costs.recompute_s(16, 2000), 0.016)


@given(steps=st.lists(st.tuples(st.floats(1e-6, 10.0), st.integers(1, 4096)), min_size=1, max_size=32))
def test_the_weighted_median_has_half_the_weight_on_each_side(steps):
    value = weighted_median(steps)
    total = sum(w for _, w in steps)
    assert sum(w for v, w in steps if v <= value) >= total / 2
    assert sum(w for v, w in steps if v >= value) >= total / 2


def test_a_store_not_loaded_from_for_a_while_is_loaded_from_again():
    costs = MeasuredCosts(remeasure_after=3)
    costs.loaded("disk", 4, 2.0)
    assert [costs.load_s("disk", 8) for _ in range(4)] == [4.0, 4.0, 4.0, 0.0]  # the fourth ask: load, and measure
    costs.loaded("disk", 4, 0.004)
    assert costs.load_s("disk", 4) < 2.0
