"""Cost-aware eviction: GreedyDual-Size-Frequency (Cherkasova, "Improving
WWW Proxies Performance with Greedy-Dual-Size-Frequency Caching Policy",
1998) with a KV block's recompute cost.

A block's priority, set each time it is released, is::

    priority = clock + uses * cost(depth)
    cost(depth) = 1 + context_cost * block_size * (depth + 1/2)

``uses`` is how often its content was used (cached, then each hit; content
evicted and cached again keeps its count, as ARC's ghosts remember it): the
expected reuse. ``cost`` is the prefill FLOPs of recomputing the block,
relative to a block with no context: every token of it goes through the
weights (1) and attends to the ``depth * block_size`` tokens before it
(``context_cost`` per token of context, the ratio of attention FLOPs per
(query, key) pair to weight FLOPs per token: ``2 * layers * heads *
head_dim / params``, 3.3e-5 for Llama-3.1-8B). So a deep block, whose loss
costs more to make good, outlasts a shallow one used as often. The victim is
the lowest priority; ``clock`` rises to each victim's priority, so blocks
not used for a while age out however often they were used before (LFU's
pollution, which plain LFU suffers on the Mooncake trace).

Prefix chains: only leaves are victims (evictable blocks with no cached
child), as in the predictive policy: a chain shrinks from its leaf.
Choosing k victims is O(k log n) on a heap of the evictable leaves.
"""

from __future__ import annotations

import heapq

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import CachedBlock, EvictionCandidates, EvictionDecision
from sagellm_plugin_eviction.chains import LeafChains


@frozen
class CostSettings:
    #: Attention FLOPs per token of context over weight FLOPs per token
    #: (``2 * layers * heads * head_dim / params``); 0 weighs every block alike.
    context_cost: float = field(default=3.3e-5, converter=float, validator=validators.ge(0))


class CostAwareEviction(LeafChains):
    """``[eviction] plugin = "cost"``"""

    Settings = CostSettings

    def __init__(self, settings: CostSettings, context: PluginContext):
        super().__init__(context)  # a record's value: the block's priority (chains.py)
        self.settings = settings
        self.block_size = context.block_size
        self.clock = 0.0
        # (priority, push number, block): the evictable leaves, and stale
        # entries, told apart by their push number.
        self._heap: list[tuple[float, int, int]] = []
        self._pushed: dict[int, int] = {}  # block -> its live entry's push number
        self._pushes = 0

    def cost(self, depth: int) -> float:
        return 1.0 + self.settings.context_cost * self.block_size * (depth + 0.5)

    def _leaf(self, block_id: int) -> None:
        """Push the block if it is an evictable leaf."""
        meta = self._meta[block_id]
        if not meta.held and meta.children == 0:
            self._pushes += 1
            self._pushed[block_id] = self._pushes
            heapq.heappush(self._heap, (meta.value, self._pushes, block_id))
            if len(self._heap) > 2 * len(self._pushed) + 1024:
                # Stale entries above the victims would stay forever: compact.
                self._heap = [e for e in self._heap if self._pushed.get(e[2]) == e[1]]
                heapq.heapify(self._heap)

    def _not_leaf(self, block_id: int) -> None:
        self._pushed.pop(block_id, None)  # its heap entry goes stale

    # -------------------------------------------------------- observations --

    @hookimpl
    def sagellm_blocks_cached(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            self._cache(block, 0.0)

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            meta = self._meta.get(block.block_id)
            if meta is not None:
                meta.uses += 1
                meta.held = True
                self._not_leaf(block.block_id)

    @hookimpl
    def sagellm_blocks_released(self, blocks: tuple[CachedBlock, ...]) -> None:
        self._release(blocks, lambda meta: self.clock + meta.uses * self.cost(meta.depth))

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            meta = self._forget(block.block_id)
            if meta is not None:
                self.clock = max(self.clock, meta.value)

    # ------------------------------------------------------------ decision --

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision:
        heap, pushed = self._heap, self._pushed
        victims: list[int] = []
        kept: list[tuple[float, int, int]] = []  # live entries looked at, to put back
        while heap and len(victims) < num_blocks:
            entry = heapq.heappop(heap)
            if pushed.get(entry[2]) != entry[1]:
                continue  # stale: dropped for good
            kept.append(entry)
            if entry[2] in candidates:
                victims.append(entry[2])
        for entry in kept:  # choosing changes nothing: the runtime reports evictions
            heapq.heappush(heap, entry)
        return EvictionDecision(tuple(victims))
