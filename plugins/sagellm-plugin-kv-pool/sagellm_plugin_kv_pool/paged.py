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
        self._is_free = bytearray(b"\x01") * self.num_blocks
        self._free_runs = 1 if self.num_blocks else 0

    def _neighbours_free(self, block_id: int) -> int:
        left = block_id > 0 and self._is_free[block_id - 1]
        right = block_id + 1 < self.num_blocks and self._is_free[block_id + 1]
        return int(left) + int(right)

    @hookimpl
    def sagellm_allocate_blocks(self, num_blocks: int, request: Request | None) -> BlockAllocation:
        if num_blocks > len(self._free):
            return _NO_BLOCKS
        popleft = self._free.popleft
        ids = tuple(popleft() for _ in range(num_blocks))
        for block_id in ids:
            self._is_free[block_id] = 0
            # Taking a block out of a run of k splits it into (up to) two.
            self._free_runs += self._neighbours_free(block_id) - 1
        return BlockAllocation(ids)

    @hookimpl
    def sagellm_free_blocks(self, block_ids: Sequence[int]) -> bool:
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block {block_id} is out of range 0..{self.num_blocks - 1}")
            if self._is_free[block_id]:
                raise ValueError(f"block {block_id} is freed twice")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"blocks {list(block_ids)} contain duplicates")
        for block_id in block_ids:
            self._free_runs += 1 - self._neighbours_free(block_id)
            self._is_free[block_id] = 1
        self._free.extend(block_ids)
        return True

    @hookimpl
    def sagellm_pool_usage(self) -> PoolUsage:
        return PoolUsage(self.num_blocks, len(self._free), self._free_runs)
