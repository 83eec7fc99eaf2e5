"""LRU over the evictable blocks: the policy vLLM and SGLang ship.

As vLLM's ``FreeKVCacheBlockQueue``: blocks join the queue when their last
reference goes, a request's blocks tail first (so a chain is evicted from its
leaf up), leave it when a request hits them, and the head is evicted first.
On :class:`~sagellm_core.kit.eviction.PriorityEviction` that is every block
alike: release order decides, kept in an ordered dict, so choosing k victims
is O(k). Preemption is the runtime's default (the last running request,
vLLM's FCFS rule).
"""

from __future__ import annotations

from sagellm_core.kit.eviction import PriorityEviction
from sagellm_core.types import CachedBlock


class LRUEviction(PriorityEviction):
    """``[eviction] plugin = "lru"``"""

    monotone = True  # a constant never decreases: the queue is release order

    def priority(self, block: CachedBlock, now_s: float) -> int:
        return 0
