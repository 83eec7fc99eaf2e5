"""The dead-block predictor learns from the past which blocks Belady would
not keep and evicts them first; it never reads the future."""

import math
import random

import hypothesis.strategies as st
from hypothesis import given, settings
from sagellm_plugin_eviction.adaptive import AdaptiveEviction, AdaptiveSettings, ShadowCache, _Expert
from sagellm_plugin_eviction.hawkeye import HawkeyeEviction, HawkeyeSettings

from sagellm_core import PluginContext
from sagellm_core.types import CachedBlock

CAPACITY = 150


def no_future():
    raise AssertionError("an online policy read the future requests")


def context(capacity=CAPACITY):
    # the future is there to be read, and reading it fails the test
    return PluginContext("p", block_size=16, num_blocks=capacity, future_requests=no_future)


def replay(policy_or_name, trace, capacity=CAPACITY):
    driver = (
        _Expert.named(policy_or_name, context(capacity))
        if isinstance(policy_or_name, str)
        else _Expert("under test", policy_or_name)
    )
    cache = ShadowCache(driver, capacity)
    return sum(cache.play(keys, float(t)) for t, keys in enumerate(trace))


def one_shot_documents(seed=0, requests=1500):
    """Two kinds of prompts behind two headers: a hot set of 10 chat chains
    of 10 blocks (two thirds of the cache), used again and again, and a
    batch tenant's documents of 12 blocks, each sent once. LRU lets the
    documents push the chats out between their uses; every document block
    is dead on arrival."""
    rng = random.Random(seed)
    chats = [[1] + [1_000 + c * 100 + i for i in range(9)] for c in range(10)]
    trace, unique = [], 10_000_000
    for _ in range(requests):
        if rng.random() < 0.3:
            trace.append(rng.choice(chats))
        else:
            trace.append([2] + [unique + i for i in range(11)])
            unique += 100
    return trace


def test_learns_to_evict_the_dead_class_first_and_beats_lru():
    trace = one_shot_documents()
    # Hawkeye's own order: every block predicted dead before any live one
    policy = HawkeyeEviction(HawkeyeSettings(demotion=math.inf), context())
    lru, mine = replay("lru", trace), replay(policy, trace)
    assert mine > 1.5 * lru
    # what it learnt: a document block, released after its one use, is dead
    document = policy.signature(CachedBlock(-1, 5, None, key=10_000_000 + 5), from_end=6, length=12)
    assert policy.is_dead(document)
    assert policy.trained[0] > 0 and policy.trained[1] > 0


def test_with_its_defaults_it_beats_lru_on_the_dead_class_trace_too():
    # demoted, not first: a wrong prediction still leaves a block some time
    trace = one_shot_documents(seed=2)
    assert replay(HawkeyeEviction(HawkeyeSettings(), context()), trace) > 1.05 * replay("lru", trace)


def test_before_any_evidence_it_is_lru():
    ctx = PluginContext("p", block_size=16, num_blocks=100)
    mine, lru = _Expert.named("hawkeye", ctx), _Expert.named("lru", ctx)
    blocks = [CachedBlock(i, i % 4, None if i % 4 == 0 else i - 1, key=i) for i in range(40)]
    for expert in (mine, lru):
        expert.tell("sagellm_blocks_cached", tuple(blocks), 0.0)
        for i in range(0, 40, 4):
            expert.tell("sagellm_blocks_released", tuple(blocks[i : i + 4]), 0.0)
    candidates = set(range(0, 40, 3))
    assert mine.select(7, candidates).victim_ids == lru.select(7, candidates).victim_ids


def test_as_an_expert_of_adaptive_it_takes_the_lead_where_it_is_better():
    trace = one_shot_documents(seed=1)
    policy = AdaptiveEviction(AdaptiveSettings(experts=("lru", "hawkeye")), context())
    mine, lru = replay(policy, trace), replay("lru", trace)
    assert policy.leader_name == "hawkeye"
    assert mine > 1.05 * lru


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(3, 40),
    trace=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 12)), min_size=1, max_size=80),
    asks=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 2**16)), min_size=1, max_size=5),
)
def test_victims_are_distinct_candidates_and_at_most_asked(capacity, trace, asks):
    policy = HawkeyeEviction(HawkeyeSettings(sampled_blocks=8, window=2.0), context(capacity))
    cache = ShadowCache(_Expert("under test", policy), capacity)
    for t, (root, length) in enumerate(trace):
        cache.play([root * 100 + i for i in range(length)], float(t))
        assert len(cache.nodes) <= capacity
    evictable = set(cache.evictable)
    for k, mask in asks:
        candidates = {b for b in evictable if (mask >> (b % 16)) & 1}
        victims = policy.sagellm_select_victims(k, candidates).victim_ids
        assert len(victims) == len(set(victims)) <= k
        assert set(victims) <= candidates
        assert len(victims) == min(k, len(candidates))  # every evictable block is in its order
