"""FIFO eviction: cached blocks leave in the order they entered the cache,
whatever their reuse. A baseline from the caching literature, and the example
of a plugin built outside the sagellm repository: it knows the core's
hookspecs, value types and plugin kit, nothing else.

Config::

    [eviction]
    plugin = "fifo"
    leaf_first = true
"""

import math

from attrs import frozen

from sagellm_core import PluginContext, hookimpl
from sagellm_core.kit.eviction import PriorityEviction


@frozen
class FIFOSettings:
    #: Within one insertion, evict the chain's deepest block first (a block is
    #: useless once its parent is gone).
    leaf_first: bool = True


class FIFOEviction(PriorityEviction):
    """The base keeps the evictable blocks and picks the lowest priority:
    here a block's place in the order blocks were cached, which the base
    does not know, so this policy extends its ``blocks_cached`` and
    ``blocks_evicted`` observations (calling ``super()``, marked with
    ``@hookimpl`` again)."""

    Settings = FIFOSettings

    def __init__(self, settings: FIFOSettings, context: PluginContext):
        super().__init__(settings, context)
        self.leaf_first = settings.leaf_first
        self._cached: dict[int, int] = {}  # block -> its place in cache order
        self._count = 0

    @hookimpl
    def sagellm_blocks_cached(self, blocks):
        super().sagellm_blocks_cached(blocks)
        for block in reversed(blocks) if self.leaf_first else blocks:
            self._count += 1
            self._cached[block.block_id] = self._count

    @hookimpl
    def sagellm_blocks_evicted(self, blocks):
        super().sagellm_blocks_evicted(blocks)
        for block in blocks:
            self._cached.pop(block.block_id, None)

    def priority(self, block, now_s):
        return self._cached.get(block.block_id, math.inf)  # (not seen cached: last)
