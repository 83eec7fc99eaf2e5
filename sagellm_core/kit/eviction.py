"""A base for eviction policies that are one priority function.

SGLang's radix cache keeps its evictable leaves in a heap ordered by
``EvictionStrategy.get_priority(node)``: a policy there is a priority and
nothing else. :class:`PriorityEviction` is that for sagellm: a policy states a
block's priority, and the base keeps the order up to date from the block
observations and answers the victim choice.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from itertools import islice, repeat
from operator import attrgetter
from typing import Any, ClassVar

from sagellm_core.hookspecs import hookimpl
from sagellm_core.registry import PluginContext
from sagellm_core.types import CachedBlock, EvictionCandidates, EvictionDecision

_block_id = attrgetter("block_id")


class PriorityEviction:
    """An eviction policy written as :meth:`priority`: the lowest goes first.

    A complete policy (least used first, then least recently released)::

        class LFUEviction(PriorityEviction):
            def priority(self, block, now_s):
                return self.uses[block.block_id]

    The base keeps the evictable blocks (released, and not touched or evicted
    since), each with the priority :meth:`priority` gave it when it was
    released, and answers ``sagellm_select_victims(k, candidates)`` with the
    k lowest among ``candidates`` (an engine may offer fewer blocks than are
    evictable: LMDeploy leaves pinned ones out). It also counts uses, as
    SGLang's nodes count hits: ``self.uses[block_id]`` is 1 when a block is
    cached and grows by one per hit.

    * **Ties** go in release order, and within one release the deepest block
      first, so a chain is evicted from its leaf up (vLLM's free queue). A
      constant priority is LRU.
    * **A priority is fixed** from the block's release to its next hit. Say
      time as a fixed key (the release time, GreedyDual's clock plus value),
      not as an age that would have to be recomputed.
    * **Cost**: a heap with lazy deletion (a hit or an eviction forgets the
      block; its stale entry is dropped when it surfaces), O(log n) per
      released block and O(k log n) per choice. A policy whose priorities
      never decrease from one release to the next (LRU's) sets ``monotone =
      True``: release order is then its order, kept in an insertion-ordered
      dict, O(1) per block and O(k) per choice; :meth:`priority` is not
      called and ``uses`` not counted.
    * **More observations**: implement any other hook as usual. To extend
      one of the four block observations, override it, call ``super()``, and
      mark the override with ``@hookimpl`` again (pluggy calls only marked
      methods).
    """

    monotone: ClassVar[bool] = False

    def __init__(self, settings: Any, context: PluginContext):
        self.uses: dict[int, int] = {}
        self._queue: OrderedDict[int, None] = OrderedDict()  # monotone: evictable blocks, in order
        self._heap: list[tuple[Any, int, int]] = []  # otherwise: (priority, release number, block)
        self._live: dict[int, int] = {}  # evictable block -> the release number of its live entry
        self._released = 0

    def priority(self, block: CachedBlock, now_s: float) -> Any:
        """The priority of ``block``, released at ``now_s``: the lower, the
        sooner it is evicted. Any values that compare with each other."""
        raise NotImplementedError

    @hookimpl
    def sagellm_blocks_cached(self, blocks: tuple[CachedBlock, ...]) -> None:
        if self.monotone:
            return  # no priority to ask for, no uses to count
        for block in blocks:
            self.uses[block.block_id] = 1

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...]) -> None:
        if self.monotone:  # (the map()s run at C speed: no Python step per block)
            deque(map(self._queue.pop, map(_block_id, blocks), repeat(None)), maxlen=0)
            return
        uses, live = self.uses, self._live
        for block in blocks:
            uses[block.block_id] = uses.get(block.block_id, 0) + 1
            live.pop(block.block_id, None)

    @hookimpl
    def sagellm_blocks_released(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        if self.monotone:  # deepest first: leaves go before parents
            self._queue.update(zip(map(_block_id, reversed(blocks)), repeat(None)))
            return
        heap, live, uses = self._heap, self._live, self.uses
        for block in reversed(blocks):
            uses.setdefault(block.block_id, 1)  # (a block not seen cached)
            self._released += 1
            live[block.block_id] = self._released
            heapq.heappush(heap, (self.priority(block, now_s), self._released, block.block_id))
        if len(heap) > 2 * len(live) + 1024:  # stale entries that may never surface
            self._heap = [entry for entry in heap if live.get(entry[2]) == entry[1]]
            heapq.heapify(self._heap)

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...]) -> None:
        if self.monotone:
            deque(map(self._queue.pop, map(_block_id, blocks), repeat(None)), maxlen=0)
            return
        uses, order = self.uses, self._live
        for block in blocks:
            uses.pop(block.block_id, None)
            order.pop(block.block_id, None)

    @hookimpl
    def sagellm_blocks_moved(self, moves: tuple[tuple[int, int], ...]) -> None:
        """A compacting pool moved evictable blocks: the same order under the
        new ids (O(evictable blocks), once a compaction round)."""
        moved = dict(moves)
        if self.monotone:
            self._queue = OrderedDict((moved.get(b, b), None) for b in self._queue)
            return
        self._heap = [(p, n, moved.get(b, b)) for p, n, b in self._heap]  # the same order: ids only break no ties
        self._live = {moved.get(b, b): n for b, n in self._live.items()}
        self.uses = {moved.get(b, b): n for b, n in self.uses.items()}

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision:
        if self.monotone:
            return EvictionDecision(tuple(islice(filter(candidates.__contains__, self._queue), num_blocks)))
        heap, live = self._heap, self._live
        victims: list[int] = []
        looked_at: list[tuple[Any, int, int]] = []
        while heap and len(victims) < num_blocks:
            entry = heapq.heappop(heap)
            if live.get(entry[2]) != entry[1]:
                continue  # stale: hit or evicted since its release, dropped for good
            looked_at.append(entry)
            if entry[2] in candidates:
                victims.append(entry[2])
        for entry in looked_at:  # choosing changes nothing: the evictions are observed
            heapq.heappush(heap, entry)
        return EvictionDecision(tuple(victims))
