"""LRU over the evictable blocks: the policy vLLM and SGLang ship.

As vLLM's ``FreeKVCacheBlockQueue``: blocks join the queue when their last
reference goes, a request's blocks tail first (so a chain is evicted from its
leaf up), leave it when a request hits them, and the head is evicted first.
The queue holds exactly the evictable blocks, so choosing k victims is O(k).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from typing import Sequence

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import CachedBlock, EvictionCandidates, EvictionDecision, PreemptionDecision, SequenceState


class LRUEviction:
    """``[eviction] plugin = "lru"``"""

    def __init__(self, settings, context: PluginContext):
        self._queue: OrderedDict[int, None] = OrderedDict()

    @hookimpl
    def sagellm_blocks_released(self, blocks: tuple[CachedBlock, ...]) -> None:
        queue = self._queue
        for block in reversed(blocks):  # deepest first: leaves go before parents
            queue[block.block_id] = None

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...]) -> None:
        pop = self._queue.pop
        for block in blocks:
            pop(block.block_id, None)

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...]) -> None:
        pop = self._queue.pop
        for block in blocks:
            pop(block.block_id, None)

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision:
        # The queue is exactly the cache's evictable blocks; an engine may
        # offer fewer (blocks it cannot free now), so skip what is not offered.
        return EvictionDecision(tuple(islice((b for b in self._queue if b in candidates), num_blocks)))

    @hookimpl
    def sagellm_select_preemption(self, running: Sequence[SequenceState]) -> PreemptionDecision:
        # vLLM's FCFS rule: preempt the request scheduled last.
        return PreemptionDecision(running[-1].request_id)
