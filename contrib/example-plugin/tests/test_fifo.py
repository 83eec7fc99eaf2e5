from sagellm_example_fifo import FIFOEviction, FIFOSettings

from sagellm_core import PluginContext
from sagellm_core.types import CachedBlock


def test_first_cached_first_evicted_and_only_evictable():
    fifo = FIFOEviction(FIFOSettings(), PluginContext("fifo", 16, 10))
    a = (CachedBlock(0, 0, None), CachedBlock(1, 1, 0))
    b = (CachedBlock(5, 0, None),)
    fifo.sagellm_blocks_cached(blocks=a)
    fifo.sagellm_blocks_cached(blocks=b)
    fifo.sagellm_blocks_released(blocks=b, now_s=0.0)
    assert fifo.sagellm_select_victims(num_blocks=3, candidates={0, 1, 5}).victim_ids == (5,)
    fifo.sagellm_blocks_released(blocks=a, now_s=1.0)
    assert fifo.sagellm_select_victims(num_blocks=3, candidates={0, 1, 5}).victim_ids == (1, 0, 5)
    # a hit takes a block out until it is released again, in its old place
    fifo.sagellm_blocks_touched(blocks=a[:1])
    assert fifo.sagellm_select_victims(num_blocks=3, candidates={0, 1, 5}).victim_ids == (1, 5)
    fifo.sagellm_blocks_released(blocks=a[:1], now_s=2.0)
    assert fifo.sagellm_select_victims(num_blocks=3, candidates={0, 1, 5}).victim_ids == (1, 0, 5)


def test_only_blocks_the_caller_offers_and_root_first_when_asked():
    fifo = FIFOEviction(FIFOSettings(leaf_first=False), PluginContext("fifo", 16, 10))
    a = (CachedBlock(0, 0, None), CachedBlock(1, 1, 0), CachedBlock(2, 2, 1))
    fifo.sagellm_blocks_cached(blocks=a)
    fifo.sagellm_blocks_released(blocks=a, now_s=0.0)
    assert fifo.sagellm_select_victims(num_blocks=3, candidates={0, 1, 2}).victim_ids == (0, 1, 2)
    assert fifo.sagellm_select_victims(num_blocks=3, candidates={2, 1}).victim_ids == (1, 2)
    fifo.sagellm_blocks_evicted(blocks=a[1:])
    assert fifo.sagellm_select_victims(num_blocks=3, candidates={0, 1, 2}).victim_ids == (0,)
