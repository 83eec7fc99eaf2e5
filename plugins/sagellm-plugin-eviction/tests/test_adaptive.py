"""The adaptive policy follows the expert that hits most, judged on shadow
caches; the shadow cache itself keeps a prefix cache's invariants."""

import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from sagellm_plugin_eviction.adaptive import AdaptiveEviction, AdaptiveSettings, ShadowCache, _Expert

from sagellm_core import PluginContext

CAPACITY = 200


def replay(policy_or_name, trace, capacity=CAPACITY):
    """Hit blocks of a trace of key chains on a cache of ``capacity``."""
    context = PluginContext("p", block_size=16, num_blocks=capacity)
    if isinstance(policy_or_name, str):
        driver = _Expert.named(policy_or_name, context)
    else:
        driver = _Expert("under test", policy_or_name)
    cache = ShadowCache(driver, capacity)
    return sum(cache.play(keys, float(t)) for t, keys in enumerate(trace))


def chains(first_key, count, length):
    return [[first_key + c * 1000 + i for i in range(length)] for c in range(count)]


def recency_trace(seed=0):
    """Phases, each re-using its own 12 chains of 10 blocks (fits the cache)
    in random order: the blocks of earlier phases are hit often and never
    again, so frequency keeps the wrong ones."""
    rng = random.Random(seed)
    trace = []
    for phase in range(8):
        working = chains(phase * 100_000, 12, 10)
        for _ in range(150):
            trace.append(rng.choice(working))
    return trace


def frequency_trace(seed=0):
    """A hot set of 10 chains of 10 blocks (half the cache) used again and
    again among scans of chains used once: the scans push recency's hot set
    out between uses."""
    rng = random.Random(seed)
    hot = chains(0, 10, 10)
    trace, unique = [], 10_000_000
    for _ in range(1200):
        if rng.random() < 0.25:
            trace.append(rng.choice(hot))
        else:
            trace.append([unique + i for i in range(10)])
            unique += 1000
    return trace


def adaptive(experts=("lru", "lfu"), capacity=CAPACITY):
    context = PluginContext("p", block_size=16, num_blocks=capacity)
    return AdaptiveEviction(AdaptiveSettings(experts=experts), context)


@pytest.mark.parametrize("trace_of, better", [(recency_trace, "lru"), (frequency_trace, "lfu")])
def test_tracks_the_better_expert(trace_of, better):
    trace = trace_of()
    lru, lfu = replay("lru", trace), replay("lfu", trace)
    hits = {"lru": lru, "lfu": lfu}
    worse = min(hits, key=hits.get)
    assert max(hits.values()) > 1.2 * hits[worse]  # the trace does favour one
    policy = adaptive()
    mine = replay(policy, trace)
    assert policy.leader_name == better
    assert mine >= 0.95 * hits[better]
    assert mine > hits[worse]


def test_where_lru_is_best_it_is_lru_block_for_block():
    trace = recency_trace(seed=3)
    policy = adaptive()
    assert replay(policy, trace) == replay("lru", trace)
    assert policy.switches == []


def test_a_later_change_of_workload_moves_the_lead():
    policy = adaptive()
    replay(policy, frequency_trace() + recency_trace())
    assert [name for _, name in policy.switches] == ["lfu", "lru"]


@pytest.mark.parametrize(
    "experts, message",
    [
        (("lru",), "two or more"),
        ("lru", "two or more"),
        (("lru", "lru"), "distinct"),
        (("lru", "belady"), "belady unknown"),
    ],
)
def test_bad_experts_are_refused_naming_them(experts, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveSettings(experts=experts)


@settings(max_examples=60, deadline=None)
@given(
    expert=st.sampled_from(["lru", "arc", "s3fifo", "lfu", "continuation", "predictive", "cost"]),
    capacity=st.integers(3, 40),
    trace=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 12)), min_size=1, max_size=60),
)
def test_shadow_cache_keeps_a_prefix_caches_invariants(expert, capacity, trace):
    context = PluginContext("p", block_size=16, num_blocks=capacity)
    cache = ShadowCache(_Expert.named(expert, context), capacity)
    cached: dict[int, int] = {}  # what the cache must hold at least: nothing it was not given
    for t, (root, length) in enumerate(trace):
        keys = [root * 100 + i for i in range(length)]
        before = {k for k in keys if k in cache.by_key}
        hits = cache.play(keys, float(t))
        # a hit is the leading run of cached keys
        assert hits == next((i for i, k in enumerate(keys) if k not in before), len(keys))
        assert len(cache.nodes) <= capacity
        assert len(cache.by_key) == len(cache.nodes)
        assert not cache.held
        for block_id, node in cache.nodes.items():
            assert cache.by_key[node.block.key] == block_id
            parent = node.block.parent_id
            assert parent is None or block_id in cache.nodes[parent].children  # no orphan
        for key in keys:
            cached[key] = t
    assert set(cache.by_key) <= set(cached)
