"""A paged free-list allocator: O(1) per block to allocate and free, as
vLLM's ``BlockPool`` and LMDeploy's ``LogicalAllocator``.

Free blocks are handed out lowest id first at start, then in the order they
were freed (a FIFO), which keeps recently freed blocks out of reuse longest.
A bitmap catches double frees, and the number of runs of consecutive free ids
is kept up to date in O(1) per block, for the fragmentation figure.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import BlockAllocation, PoolUsage, Request

_NO_BLOCKS = BlockAllocation(())


class PagedPool:
    """``[kv_pool] plugin = "paged"``"""

    def __init__(self, settings, context: PluginContext):
        self.num_blocks = context.num_blocks
        self._free = deque(range(self.num_blocks))
        # Block b's flag is at index b + 1, between two flags that are never
        # set: a block's neighbours are read without a bounds test.
        self._is_free = bytearray(1) + bytearray(b"\x01") * self.num_blocks + bytearray(1)
        self._free_runs = 1 if self.num_blocks else 0
        self._usage: PoolUsage | None = None  # the answer until the pool changes

    @hookimpl
    def sagellm_allocate_blocks(self, num_blocks: int, request: Request | None) -> BlockAllocation:
        if num_blocks > len(self._free):
            return _NO_BLOCKS
        popleft, is_free = self._free.popleft, self._is_free
        ids = tuple([popleft() for _ in range(num_blocks)])
        runs = self._free_runs
        for block_id in ids:
            is_free[block_id + 1] = 0
            # Taking a block out of a run of k splits it into (up to) two.
            runs += is_free[block_id] + is_free[block_id + 2] - 1
        self._free_runs = runs
        self._usage = None
        return BlockAllocation(ids)

    @hookimpl
    def sagellm_free_blocks(self, block_ids: Sequence[int]) -> bool:
        num_blocks, is_free = self.num_blocks, self._is_free
        for block_id in block_ids:
            if not 0 <= block_id < num_blocks:
                raise ValueError(f"block {block_id} is out of range 0..{num_blocks - 1}")
            if is_free[block_id + 1]:
                raise ValueError(f"block {block_id} is freed twice")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"blocks {list(block_ids)} contain duplicates")
        runs = self._free_runs
        for block_id in block_ids:
            runs += 1 - is_free[block_id] - is_free[block_id + 2]
            is_free[block_id + 1] = 1
        self._free_runs = runs
        self._free.extend(block_ids)
        self._usage = None
        return True

    @hookimpl
    def sagellm_pool_usage(self) -> PoolUsage:
        usage = self._usage
        if usage is None:
            usage = self._usage = PoolUsage(self.num_blocks, len(self._free), self._free_runs)
        return usage
