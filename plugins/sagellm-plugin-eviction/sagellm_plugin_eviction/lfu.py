"""LFU over the evictable blocks, least recently released first among equals.

A block's count starts at 1 when cached and grows by one per prefix hit. Every
hit on a block also hits its ancestors, so a parent's count is never below its
children's and, with the deeper block first on ties, chains are evicted from
the leaf up. A heap with lazy deletion answers k victims in O(k log n): stale
entries (the block was hit or evicted since) are skipped and dropped.
"""

from __future__ import annotations

import heapq
from itertools import count

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import CachedBlock, EvictionCandidates, EvictionDecision


class LFUEviction:
    """``[eviction] plugin = "lfu"``"""

    def __init__(self, settings, context: PluginContext):
        self._heap: list[tuple[int, int, int, int]] = []  # (count, tick, -depth, block)
        self._count: dict[int, int] = {}
        self._entry: dict[int, tuple[int, int, int, int]] = {}  # the live heap entry
        self._tick = count()

    @hookimpl
    def sagellm_blocks_cached(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            self._count[block.block_id] = 1

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            self._count[block.block_id] = self._count.get(block.block_id, 0) + 1
            self._entry.pop(block.block_id, None)

    @hookimpl
    def sagellm_blocks_released(self, blocks: tuple[CachedBlock, ...]) -> None:
        tick = next(self._tick)
        for block in blocks:
            entry = (self._count.get(block.block_id, 1), tick, -block.depth, block.block_id)
            self._entry[block.block_id] = entry
            heapq.heappush(self._heap, entry)

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            self._count.pop(block.block_id, None)
            self._entry.pop(block.block_id, None)

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision:
        heap, live = self._heap, self._entry
        chosen, passed = [], []
        while heap and len(chosen) < num_blocks:
            entry = heapq.heappop(heap)
            if live.get(entry[3]) is entry:
                # A live entry the engine does not offer now is passed over.
                (chosen if entry[3] in candidates else passed).append(entry)
        # Choosing changes nothing: the entries go back and are dropped when
        # the eviction is observed.
        for entry in chosen + passed:
            heapq.heappush(heap, entry)
        return EvictionDecision(tuple(entry[3] for entry in chosen))
