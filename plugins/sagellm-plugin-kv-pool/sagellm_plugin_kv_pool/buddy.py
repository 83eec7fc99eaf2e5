"""A buddy allocator over the block ids: the free blocks as aligned
power-of-two blocks (a block of order ``k`` is ``2**k`` adjacent ids starting
at a multiple of ``2**k``), as Linux's page allocator keeps physical pages.

* At start the pool is cut into the largest aligned blocks that fit, lowest
  id first (a pool of 12 blocks: 0-7 and 8-11).
* An allocation of ``n`` blocks is served as the powers of two of ``n``'s
  binary digits, largest first (``n = 13``: 8, 4 and 1 adjacent ids), each
  from the lowest-addressed free block of the smallest order that holds it,
  split in halves down to the size asked (the upper halves go back free).
  When no free block is that large the largest free block is taken and the
  rest asked again: all or nothing, never more pieces than the free blocks
  force. A request's allocation first continues the blocks it was given
  last while the ids right after its last block are free (a free block
  starts there then), so that a decoding request grows in place.
* A free cuts each run of freed ids into aligned blocks and joins each with
  its buddy (the block of the same order it was split from) while the buddy
  is free, order by order: when every block is free again the pool is the
  blocks it started with.

Allocation and free are O(log n) per buddy block taken or freed.
"""

from __future__ import annotations

from collections.abc import Sequence

from sortedcontainers import SortedList

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import BlockAllocation, PoolUsage, Request

from .tails import RequestTails

_NO_BLOCKS = BlockAllocation(())


def aligned_blocks(start: int, end: int) -> list[tuple[int, int]]:
    """``start .. end - 1`` as the largest aligned power-of-two blocks, in
    order: ``(start, order)``."""
    blocks = []
    while start < end:
        order = (start & -start).bit_length() - 1 if start else (end - start).bit_length() - 1
        while start + (1 << order) > end:
            order -= 1
        blocks.append((start, order))
        start += 1 << order
    return blocks


class BuddyPool:
    """``[kv_pool] plugin = "buddy"``"""

    def __init__(self, settings, context: PluginContext):
        n = self.num_blocks = context.num_blocks
        # Block b's flag is at index b + 1, between two flags that are never
        # set: a block's neighbours are read without a bounds test.
        self._is_free = bytearray(1) + bytearray(b"\x01") * n + bytearray(1)
        self._order: dict[int, int] = {}  # free block's start -> its order
        self._free: list[SortedList] = [SortedList() for _ in range(max(1, n.bit_length()))]  # by order: starts
        for start, order in aligned_blocks(0, n):
            self._order[start] = order
            self._free[order].add(start)
        self._num_free = n
        self._free_runs = 1 if n else 0
        self._tails = RequestTails()
        self._usage: PoolUsage | None = None

    # ------------------------------------------------------- buddy blocks --

    def _take(self, start: int, want: int) -> range:
        """Take the first ``2**want`` ids of the free block at ``start``,
        giving the upper halves split off back to the free lists."""
        order = self._order.pop(start)
        self._free[order].remove(start)
        while order > want:
            order -= 1
            upper = start + (1 << order)
            self._order[upper] = order
            self._free[order].add(upper)
        size = 1 << want
        is_free = self._is_free
        # Taking a run of ids out of the free space splits the free run around it in (up to) two.
        self._free_runs += is_free[start] + is_free[start + size + 1] - 1
        is_free[start + 1 : start + size + 1] = bytes(size)
        self._num_free -= size
        return range(start, start + size)

    def _put(self, start: int, order: int) -> None:
        """A free block back, joined with its buddy while the buddy is free."""
        orders, free = self._order, self._free
        while orders.get(buddy := start ^ (1 << order)) == order:
            del orders[buddy]
            free[order].remove(buddy)
            start &= ~(1 << order)
            order += 1
        orders[start] = order
        free[order].add(start)

    # ---------------------------------------------------------------- hooks --

    @hookimpl
    def sagellm_allocate_blocks(self, num_blocks: int, request: Request | None) -> BlockAllocation:
        if num_blocks > self._num_free:
            return _NO_BLOCKS
        ids: list[int] = []
        need = num_blocks
        tail = None if request is None else self._tails.of(request.request_id)
        while tail is not None and need and (order := self._order.get(tail + 1)) is not None:  # grow in place
            ids.extend(self._take(tail + 1, min(order, need.bit_length() - 1)))
            need, tail = num_blocks - len(ids), ids[-1]
        free = self._free
        while need:
            want = need.bit_length() - 1
            order = next((k for k in range(want, len(free)) if free[k]), None)
            if order is None:  # nothing that large is free: the largest there is
                order = want = next(k for k in range(want - 1, -1, -1) if free[k])
            ids.extend(self._take(free[order][0], want))
            need = num_blocks - len(ids)
        if request is not None and ids:
            self._tails.set(request.request_id, ids[-1])
        self._usage = None
        return BlockAllocation(tuple(ids))

    @hookimpl
    def sagellm_free_blocks(self, block_ids: Sequence[int]) -> bool:
        num_blocks, is_free = self.num_blocks, self._is_free
        for block_id in block_ids:
            if not (type(block_id) is int and 0 <= block_id < num_blocks):
                raise ValueError(f"block {block_id!r} is out of range 0..{num_blocks - 1}")
            if is_free[block_id + 1]:
                raise ValueError(f"block {block_id} is freed twice")
        ordered = sorted(block_ids)
        if any(a == b for a, b in zip(ordered, ordered[1:])):
            raise ValueError(f"blocks {list(block_ids)} contain duplicates")
        self._tails.forget(ordered)
        i = 0
        while i < len(ordered):
            j = i + 1
            while j < len(ordered) and ordered[j] == ordered[j - 1] + 1:
                j += 1
            start, end = ordered[i], ordered[j - 1] + 1
            self._free_runs += 1 - is_free[start] - is_free[end + 1]
            is_free[start + 1 : end + 1] = b"\x01" * (end - start)
            self._num_free += end - start
            for block_start, order in aligned_blocks(start, end):
                self._put(block_start, order)
            i = j
        self._usage = None
        return True

    @hookimpl
    def sagellm_pool_usage(self) -> PoolUsage:
        usage = self._usage
        if usage is None:
            usage = self._usage = PoolUsage(self.num_blocks, self._num_free, self._free_runs)
        return usage

    def free_blocks_by_order(self) -> dict[int, int]:
        """Order -> free buddy blocks of that order (where any)."""
        return {order: len(starts) for order, starts in enumerate(self._free) if starts}
