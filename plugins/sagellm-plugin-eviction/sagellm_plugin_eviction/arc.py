"""ARC (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement
Cache", FAST'03), adapted to prefix chains.

Two classes of cached blocks: *T1*, not hit since it was cached, and *T2*,
hit at least once more. Two ghost lists remember the content keys of blocks
recently evicted from each (B1, B2; each up to the cache's size). A target
``p`` for T1's size adapts: a block cached again while its key is in B1 (T1
gave it up too soon) raises ``p``; one whose key is in B2 lowers it; either
way the block starts in T2. A victim comes from T1 while T1 holds more than
``p`` blocks (or T2 has nothing evictable), else from T2; within a class,
least recently released first.

Prefix chains: as in the LRU plugin, only evictable blocks are queued, a
request's blocks released deepest first, so a chain goes from its leaf up;
a hit takes a block out of its queue (it is held) and into T2.
"""

from __future__ import annotations

from collections import OrderedDict

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import CachedBlock, EvictionCandidates, EvictionDecision


class ARCEviction:
    """``[eviction] plugin = "arc"``"""

    def __init__(self, settings, context: PluginContext):
        self.capacity = context.num_blocks
        self.target_t1 = 0.0  # ARC's p
        self._class: dict[int, int] = {}  # block -> 1 or 2, every cached block
        self._size = [0, 0, 0]  # blocks per class (index 1 and 2)
        self._queue = {1: OrderedDict(), 2: OrderedDict()}  # evictable blocks, oldest release first
        self._ghost = {1: OrderedDict(), 2: OrderedDict()}  # content keys
        self._key: dict[int, int] = {}

    def _join(self, block_id: int, cls: int) -> None:
        old = self._class.get(block_id)
        if old is not None:
            self._size[old] -= 1
        self._class[block_id] = cls
        self._size[cls] += 1

    @hookimpl
    def sagellm_blocks_cached(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            b1, b2 = self._ghost[1], self._ghost[2]
            if block.key in b1:
                self.target_t1 = min(self.capacity, self.target_t1 + max(len(b2) / len(b1), 1.0))
                del b1[block.key]
                cls = 2
            elif block.key in b2:
                self.target_t1 = max(0.0, self.target_t1 - max(len(b1) / len(b2), 1.0))
                del b2[block.key]
                cls = 2
            else:
                cls = 1
            self._join(block.block_id, cls)
            self._key[block.block_id] = block.key

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            b = block.block_id
            cls = self._class.get(b)
            if cls is None:
                continue
            self._queue[cls].pop(b, None)
            if cls == 1:
                self._join(b, 2)

    @hookimpl
    def sagellm_blocks_released(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in reversed(blocks):  # deepest first: leaves go before parents
            cls = self._class.get(block.block_id)
            if cls is not None:
                self._queue[cls][block.block_id] = None

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            b = block.block_id
            cls = self._class.pop(b, None)
            if cls is None:
                continue
            self._size[cls] -= 1
            self._queue[cls].pop(b, None)
            ghost = self._ghost[cls]
            ghost[self._key.pop(b)] = None
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision:
        # Simulate ARC's REPLACE num_blocks times without changing anything:
        # the victims leave when their eviction is observed.
        offered = {cls: (b for b in self._queue[cls] if b in candidates) for cls in (1, 2)}
        size_t1 = self._size[1]
        chosen: list[int] = []
        pending: dict[int, int | None] = {1: None, 2: None}

        def peek(cls: int) -> int | None:
            if pending[cls] is None:
                pending[cls] = next(offered[cls], None)
            return pending[cls]

        while len(chosen) < num_blocks:
            first, second = peek(1), peek(2)
            if first is None and second is None:
                break
            cls = 1 if first is not None and (size_t1 > self.target_t1 or second is None) else 2
            chosen.append(pending[cls])
            pending[cls] = None
            if cls == 1:
                size_t1 -= 1
        return EvictionDecision(tuple(chosen))
