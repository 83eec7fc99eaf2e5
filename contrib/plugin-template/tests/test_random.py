import hypothesis.strategies as st
from hypothesis import given
from sagellm_plugin_template import RandomEviction, RandomSettings

from sagellm_core import PluginContext
from sagellm_core.types import CachedBlock


@given(st.lists(st.tuples(st.sampled_from("rte"), st.integers(0, 9)), max_size=50), st.integers(1, 5))
def test_victims_are_distinct_evictable_blocks(ops, k):
    policy = RandomEviction(RandomSettings(seed=1), PluginContext("random", 16, 10))
    evictable = set()
    for op, i in ops:
        block = (CachedBlock(i, 0, None),)
        if op == "r":
            if i in evictable:
                continue  # released twice: the cache never says so
            evictable.add(i)
            policy.sagellm_blocks_released(blocks=block, now_s=0.0)
        elif op == "t":
            evictable.discard(i)
            policy.sagellm_blocks_touched(blocks=block)
        else:
            evictable.discard(i)
            policy.sagellm_blocks_evicted(blocks=block)
        victims = policy.sagellm_select_victims(num_blocks=k, candidates=evictable).victim_ids
        assert len(victims) == min(k, len(evictable)) == len(set(victims))
        assert set(victims) <= evictable


def test_victims_are_only_blocks_the_caller_offers():
    # An engine may hold back blocks the policy was told are evictable
    # (LMDeploy leaves pinned ones out of the candidates).
    policy = RandomEviction(RandomSettings(seed=1), PluginContext("random", 16, 10))
    policy.sagellm_blocks_released(blocks=tuple(CachedBlock(i, 0, None) for i in range(6)), now_s=0.0)
    for _ in range(20):
        victims = policy.sagellm_select_victims(num_blocks=4, candidates={1, 3, 5}).victim_ids
        assert sorted(victims) == [1, 3, 5]


def test_the_order_is_random_and_seeded():
    blocks = tuple(CachedBlock(i, 0, None) for i in range(50))

    def victims(seed):
        policy = RandomEviction(RandomSettings(seed=seed), PluginContext("random", 16, 50))
        policy.sagellm_blocks_released(blocks=blocks, now_s=0.0)
        return policy.sagellm_select_victims(num_blocks=10, candidates=set(range(50))).victim_ids

    assert victims(1) == victims(1) != victims(2)
    assert victims(1) != tuple(range(49, 39, -1))  # not release order
