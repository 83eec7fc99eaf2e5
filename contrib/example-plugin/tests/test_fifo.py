from sagellm_example_fifo import FIFOEviction, FIFOSettings

from sagellm_core import PluginContext
from sagellm_core.types import CachedBlock


def test_first_cached_first_evicted_and_only_evictable():
    fifo = FIFOEviction(FIFOSettings(), PluginContext("fifo", 16, 10))
    a = (CachedBlock(0, 0, None), CachedBlock(1, 1, 0))
    b = (CachedBlock(5, 0, None),)
    fifo.sagellm_blocks_cached(blocks=a)
    fifo.sagellm_blocks_cached(blocks=b)
    fifo.sagellm_blocks_released(blocks=b)
    assert fifo.sagellm_select_victims(num_blocks=3, candidates={0, 1, 5}).victim_ids == (5,)
    fifo.sagellm_blocks_released(blocks=a)
    assert fifo.sagellm_select_victims(num_blocks=3, candidates={0, 1, 5}).victim_ids == (1, 0, 5)
