import hypothesis.strategies as st
import pytest
from hypothesis import given
from sagellm_plugin_eviction.lfu import LFUEviction
from sagellm_plugin_eviction.lru import LRUEviction

from sagellm_core import PluginContext
from sagellm_core.types import CachedBlock

CTX = PluginContext("p", block_size=16, num_blocks=100)


def chain(first, n, start_depth=0, parent=None):
    blocks = []
    for i in range(n):
        blocks.append(CachedBlock(first + i, start_depth + i, parent))
        parent = first + i
    return tuple(blocks)


def test_lru_evicts_least_recently_released_leaf_first():
    lru = LRUEviction(None, CTX)
    a, b = chain(0, 3), chain(10, 2)
    lru.sagellm_blocks_released(blocks=a)
    lru.sagellm_blocks_released(blocks=b)
    assert lru.sagellm_select_victims(num_blocks=4, candidates=None).victim_ids == (2, 1, 0, 11)
    lru.sagellm_blocks_touched(blocks=a[:2])  # a hit on blocks 0 and 1
    assert lru.sagellm_select_victims(num_blocks=9, candidates=None).victim_ids == (2, 11, 10)
    lru.sagellm_blocks_released(blocks=a[:2])
    lru.sagellm_blocks_evicted(blocks=(a[2],))
    assert lru.sagellm_select_victims(num_blocks=9, candidates=None).victim_ids == (11, 10, 1, 0)


def test_selection_does_not_change_the_policy():
    for policy in (LRUEviction(None, CTX), LFUEviction(None, CTX)):
        policy.sagellm_blocks_cached(blocks=chain(0, 3)) if hasattr(policy, "sagellm_blocks_cached") else None
        policy.sagellm_blocks_released(blocks=chain(0, 3))
        first = policy.sagellm_select_victims(num_blocks=2, candidates=None).victim_ids
        assert policy.sagellm_select_victims(num_blocks=2, candidates=None).victim_ids == first


def test_lfu_keeps_frequently_hit_blocks():
    lfu = LFUEviction(None, CTX)
    hot, cold = chain(0, 2), chain(10, 2)
    lfu.sagellm_blocks_cached(blocks=hot + cold)
    lfu.sagellm_blocks_released(blocks=hot)
    lfu.sagellm_blocks_released(blocks=cold)
    for _ in range(3):
        lfu.sagellm_blocks_touched(blocks=hot)
        lfu.sagellm_blocks_released(blocks=hot)
    # Cold blocks go first, leaf before parent; hot ones last.
    assert lfu.sagellm_select_victims(num_blocks=4, candidates=None).victim_ids == (11, 10, 1, 0)
    lfu.sagellm_blocks_evicted(blocks=cold)
    assert lfu.sagellm_select_victims(num_blocks=4, candidates=None).victim_ids == (1, 0)


def test_lru_preempts_the_last_running_request():
    from sagellm_core.types import Request, SequenceState

    running = [SequenceState(Request(f"r{i}", [1], 1)) for i in range(3)]
    assert LRUEviction(None, CTX).sagellm_select_preemption(running=running).request_id == "r2"


@pytest.mark.parametrize("policy_cls", [LRUEviction, LFUEviction])
@given(ops=st.lists(st.tuples(st.sampled_from("crte"), st.integers(0, 7)), max_size=60), k=st.integers(1, 6))
def test_victims_are_always_evictable_and_distinct(policy_cls, ops, k):
    """Against a model of the evictable set built from the same observations."""
    policy = policy_cls(None, CTX)
    cached, evictable = set(), set()
    for op, i in ops:
        block = CachedBlock(i, 0, None)
        if op == "c" and i not in cached:
            cached.add(i)
            policy.sagellm_blocks_cached(blocks=(block,)) if hasattr(policy, "sagellm_blocks_cached") else None
        elif op == "r" and i in cached and i not in evictable:
            evictable.add(i)
            policy.sagellm_blocks_released(blocks=(block,))
        elif op == "t" and i in evictable:
            evictable.discard(i)
            policy.sagellm_blocks_touched(blocks=(block,))
        elif op == "e" and i in evictable:
            evictable.discard(i)
            cached.discard(i)
            policy.sagellm_blocks_evicted(blocks=(block,))
        victims = policy.sagellm_select_victims(num_blocks=k, candidates=evictable).victim_ids
        assert len(victims) == min(k, len(evictable))
        assert len(set(victims)) == len(victims) and set(victims) <= evictable
