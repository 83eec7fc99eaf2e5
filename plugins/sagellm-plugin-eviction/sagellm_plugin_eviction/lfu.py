"""LFU over the evictable blocks, least recently released first among equals.

A block's count (``uses``, kept by the base) starts at 1 when cached and grows
by one per prefix hit. Every hit on a block also hits its ancestors, so a
parent's count is never below its children's and, with the deeper block
first on ties (the base's order within a release), chains are evicted from
the leaf up. The base's heap answers k victims in O(k log n).
"""

from __future__ import annotations

from sagellm_core.kit.eviction import PriorityEviction
from sagellm_core.types import CachedBlock


class LFUEviction(PriorityEviction):
    """``[eviction] plugin = "lfu"``"""

    def priority(self, block: CachedBlock, now_s: float) -> int:
        return self.uses[block.block_id]
