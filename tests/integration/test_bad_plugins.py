"""A plugin that returns nonsense gets a one-line error naming it, and the
runtime's own state is unchanged."""

import importlib

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from sagellm_core.errors import PluginError
from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.runtime import Runtime
from sagellm_core.types import Request

CONFIG = """
[prefix_cache]
plugin = "{cache}"
block_size = 4
[kv_pool]
plugin = "{pool}"
num_blocks = 6
[eviction]
plugin = "{eviction}"
[lifetime]
plugin = "{lifetime}"
"""


def runtime(cache="radix", pool="paged", eviction="lru", lifetime="stat"):
    text = CONFIG.format(cache=cache, pool=pool, eviction=eviction, lifetime=lifetime)
    return Runtime(settings_from_toml(text), hook_timing=False)


def request(rid, tokens):
    return Request(request_id=rid, prompt_token_ids=tokens, output_tokens=2)


def fill_cache(rt):
    """Cache 4 blocks (two finished requests), leaving 2 free."""
    for rid, base in (("a", 0), ("b", 100)):
        state = rt.arrive(request(rid, list(range(base, base + 9))))
        assert rt.admit(state, 64) == 9
        state.num_computed_tokens = 9
        rt.finish(state)
    assert len(rt.evictable()) == 4 and rt.pool_usage().num_free_blocks == 2


def snapshot(rt):
    return (set(rt.ledger.in_use), set(rt.ledger.cached), dict(rt.ledger.active), rt.pool_usage(), len(rt.evictable()))


def admit_fails(rt, match):
    state = rt.arrive(request("c", list(range(500, 517))))  # needs 5 blocks: must evict
    before = snapshot(rt)
    with pytest.raises(PluginError) as err:
        rt.admit(state, 64)
    message = str(err.value)
    assert "\n" not in message
    assert match in message, message
    assert snapshot(rt) == before
    assert state.block_ids == [] and state.num_computed_tokens == 0
    rt.check_invariants()


@pytest.mark.parametrize(
    "eviction, match",
    [
        (
            "stranger",
            "eviction plugin 'stranger' (sagellm-bad-plugins 0.0.1) sagellm_select_victims returned victims that are not evictable candidates: [10000]",
        ),
        (
            "greedy",
            "eviction plugin 'greedy' (sagellm-bad-plugins 0.0.1) sagellm_select_victims returned 4 victims, asked for at most 3",
        ),
        ("not-a-decision", "sagellm_select_victims returned [1, 2, 3], not an EvictionDecision"),
    ],
)
def test_bad_victims(bad_plugins, eviction, match):
    rt = runtime(eviction=eviction)
    fill_cache(rt)
    admit_fails(rt, match)


def test_more_blocks_than_asked(bad_plugins):
    rt = runtime(pool="generous")
    state = rt.arrive(request("a", list(range(9))))
    before = snapshot(rt)
    with pytest.raises(
        PluginError,
        match=r"^kv_pool plugin 'generous' \(sagellm-bad-plugins 0.0.1\) sagellm_allocate_blocks returned 4 blocks, asked for 3",
    ):
        rt.admit(state, 64)
    assert snapshot(rt)[:3] == before[:3]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=7),
        st.floats(allow_nan=True),
        st.booleans(),
        st.text(max_size=4),
        st.lists(st.integers(0, 6), max_size=2),
    )
)
def test_a_bad_reserved_block_count_is_named_and_nothing_is_taken(bad_plugins, answer):
    importlib.import_module("bad_plugins").MiscountingPool.answer = answer
    rt = runtime(pool="miscounting")
    state = rt.arrive(request("a", list(range(9))))
    before = snapshot(rt)
    with pytest.raises(PluginError) as err:
        rt.admit(state, 64)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(
        "kv_pool plugin 'miscounting' (sagellm-bad-plugins 0.0.1) sagellm_reserved_blocks returned"
    ), message
    assert message.endswith("not a block count in 0..6")
    assert snapshot(rt)[:3] == before[:3] and state.block_ids == []


def test_allocation_from_blocks_in_use(bad_plugins):
    rt = runtime(pool="reusing")
    first = rt.arrive(request("a", list(range(9))))
    assert rt.admit(first, 64) == 9
    second = rt.arrive(request("b", list(range(100, 105))))
    before = snapshot(rt)
    with pytest.raises(
        PluginError,
        match=r"kv_pool plugin 'reusing' .* sagellm_allocate_blocks returned blocks already in use: \[0, 1\]",
    ):
        rt.admit(second, 64)
    assert snapshot(rt)[:3] == before[:3]
    assert second.block_ids == []


def test_prefix_cache_claiming_uncached_blocks(bad_plugins):
    rt = runtime(cache="over-matching")
    state = rt.arrive(request("a", list(range(9))))
    before = snapshot(rt)
    with pytest.raises(
        PluginError,
        match=r"^prefix_cache plugin 'over-matching' .* sagellm_acquire_prefix matched blocks that are not cached: \(900, 901\)$",
    ):
        rt.admit(state, 64)
    assert snapshot(rt) == before
    rt.check_invariants()  # the lock the plugin took was rolled back


def test_prefix_cache_adopting_a_block_it_was_not_given(bad_plugins):
    rt = runtime(cache="adopting-strangers")
    state = rt.arrive(request("a", list(range(9))))
    assert rt.admit(state, 64) == 9
    state.num_computed_tokens = 9
    before = set(rt.ledger.cached)
    with pytest.raises(
        PluginError,
        match=r"^prefix_cache plugin 'adopting-strangers' .* sagellm_insert_prefix adopted \[0, 1, 777\] .* it was not given or that were cached$",
    ):
        rt.cache(state)
    assert rt.ledger.cached == before  # nothing recorded as cached


def test_plugin_that_raises_is_named(bad_plugins):
    rt = runtime(lifetime="crashing")
    with pytest.raises(PluginError) as err:
        rt.arrive(request("a", [1, 2, 3]))
    assert str(err.value) == (
        "lifetime plugin 'crashing' (sagellm-bad-plugins 0.0.1) raised in sagellm_predict_lifetime: ZeroDivisionError: no data"
    )


def test_a_multi_line_plugin_message_is_one_line(bad_plugins):
    rt = runtime(lifetime="multi-line")
    with pytest.raises(PluginError) as err:
        rt.arrive(request("a", [1, 2, 3]))
    assert str(err.value).endswith("RuntimeError: first line second line third") and "\n" not in str(err.value)


def test_nonsense_prediction_is_rejected(bad_plugins):
    rt = runtime(lifetime="negative")
    with pytest.raises(
        PluginError,
        match=r"lifetime plugin 'negative' .* sagellm_predict_lifetime returned LifetimePrediction\(output_tokens=-5.0",
    ):
        rt.arrive(request("a", [1, 2, 3]))


def test_pass_that_drops_a_request_is_named(bad_plugins):
    from sagellm_core.replay import session

    text = CONFIG.format(cache="radix", pool="paged", eviction="lru", lifetime="stat")
    text = text.replace("num_blocks = 6", "num_blocks = 600") + '[scheduler]\npasses = ["fcfs", "dropping"]\n'
    with pytest.raises(
        PluginError,
        match=r"scheduler plugin 'fcfs' .* / scheduler plugin 'dropping' \(sagellm-bad-plugins 0.0.1\) sagellm_schedule_pass changed the set of waiting requests \(1 -> 0\); passes may only reorder",
    ):
        session.run(settings_from_toml(text))


def test_pass_that_stalls_a_running_request_is_named(bad_plugins):
    from sagellm_core.replay import session

    text = CONFIG.format(cache="radix", pool="paged", eviction="lru", lifetime="stat")
    text = text.replace("num_blocks = 6", "num_blocks = 600") + '[scheduler]\npasses = ["fcfs", "stalling"]\n'
    with pytest.raises(
        PluginError,
        match=r"scheduler plugin 'fcfs' .* / scheduler plugin 'stalling' \(sagellm-bad-plugins 0.0.1\) sagellm_schedule_pass set the chunk limit of '[\w-]+' to 0; it is an integer of at least 1 \(it runs\)$",
    ):
        session.run(settings_from_toml(text))


FALLBACK_RUN = """
[engine]
name = "replay"
mode = "timed"
[workload]
source = "generator"
tenants = 2
sessions_per_tenant = 4
turns = 2
[prefix_cache]
plugin = "radix"
[kv_pool]
plugin = "paged"
num_blocks = 2000
[eviction]
plugin = "lru"
[lifetime]
plugin = "{lifetime}"
fallback = "stat"
[scheduler]
passes = ["sjf"]
"""


@pytest.mark.parametrize("lifetime, failures", [("crashing", 16), ("garbage", 8)])
def test_failing_predictor_falls_back_without_losing_requests(bad_plugins, lifetime, failures):
    from sagellm_core.replay import session

    result = session.run(settings_from_toml(FALLBACK_RUN.format(lifetime=lifetime)))
    report = result.report
    assert report["requests"] == 16 and report["rejected"] == 0
    assert report["lifetime_fallbacks"] == failures
    assert report["lifetime_failure"].startswith(f"lifetime plugin {lifetime!r} (sagellm-bad-plugins 0.0.1)")
    # Every finished request was predicted, by the plugin or its fallback.
    assert result.runtime.counters.lifetime_predictions == 16
    result.runtime.check_invariants()


def test_without_fallback_a_failing_predictor_stops_the_run(bad_plugins):
    from sagellm_core.replay import session

    text = FALLBACK_RUN.format(lifetime="garbage").replace('fallback = "stat"\n', "")
    with pytest.raises(
        PluginError, match=r"^lifetime plugin 'garbage' .* returned 'about 300 tokens': it is not a LifetimePrediction$"
    ):
        session.run(settings_from_toml(text))


def test_fallback_must_be_another_installed_predictor(bad_plugins):
    from sagellm_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"\[lifetime\] fallback = 'stat': a plugin other than the one picked"):
        settings_from_toml(FALLBACK_RUN.format(lifetime="stat"))
    text = FALLBACK_RUN.format(lifetime="crashing").replace('fallback = "stat"', 'fallback = "nope"')
    with pytest.raises(ConfigError, match=r"\[lifetime\] fallback: unknown lifetime plugin 'nope'"):
        Runtime(settings_from_toml(text), hook_timing=False)
