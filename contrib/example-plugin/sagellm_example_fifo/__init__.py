"""FIFO eviction: cached blocks leave in the order they entered the cache,
whatever their reuse. A baseline from the caching literature, and the example
of a plugin built outside the sagellm repository: it knows the core's
hookspecs and value types, nothing else.

Config::

    [eviction]
    plugin = "fifo"
    leaf_first = true
"""

from collections import OrderedDict

from attrs import frozen

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import EvictionDecision


@frozen
class FIFOSettings:
    #: Within one insertion, evict the chain's deepest block first (a block is
    #: useless once its parent is gone).
    leaf_first: bool = True


class FIFOEviction:
    Settings = FIFOSettings

    def __init__(self, settings: FIFOSettings, context: PluginContext):
        self.leaf_first = settings.leaf_first
        self._order: OrderedDict[int, bool] = OrderedDict()  # block -> evictable

    @hookimpl
    def sagellm_blocks_cached(self, blocks):
        for block in reversed(blocks) if self.leaf_first else blocks:
            self._order[block.block_id] = False

    @hookimpl
    def sagellm_blocks_released(self, blocks):
        for block in blocks:
            if block.block_id in self._order:
                self._order[block.block_id] = True

    @hookimpl
    def sagellm_blocks_touched(self, blocks):
        for block in blocks:
            if block.block_id in self._order:
                self._order[block.block_id] = False

    @hookimpl
    def sagellm_blocks_evicted(self, blocks):
        for block in blocks:
            self._order.pop(block.block_id, None)

    @hookimpl
    def sagellm_select_victims(self, num_blocks, candidates):
        # O(n) in the worst case (locked blocks at the head); fine for an
        # example, and why first-party policies keep only evictable blocks.
        victims = []
        for block_id, evictable in self._order.items():
            if evictable and block_id in candidates:
                victims.append(block_id)
                if len(victims) == num_blocks:
                    break
        return EvictionDecision(tuple(victims))
