"""SLO-aware eviction: LRU, except that the cached prefix of a waiting
request that can still meet its deadline (``Request.deadline_s``, its TTFT
SLO) is kept while anything else can go.

A waiting request's cached prefix (the arrival lookup, ``match`` in
``sagellm_request_arrived``) is what it will hit once admitted: evicting it
turns a hit into prefill, spent just when the request has least time to
spare, and LRU evicts exactly these blocks under load, since a request
queues longest when memory is tightest. Protection ends when the request
finishes (its blocks are held while it runs) or its deadline passes (it can
no longer be met; its blocks compete as LRU's). When only protected blocks
are left, those guarding the latest deadline (the most slack) go first.
Requests without a deadline are served as by LRU.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from itertools import islice
from typing import Sequence

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import (
    CachedBlock,
    EvictionCandidates,
    EvictionDecision,
    LifetimePrediction,
    PreemptionDecision,
    PrefixMatch,
    Request,
    RequestOutcome,
    SequenceState,
)


class SLOEviction:
    """``[eviction] plugin = "slo"``"""

    def __init__(self, settings, context: PluginContext):
        # Evictable blocks, least recently released first: those no waiting
        # request will hit (LRU's queue), and those held back for one.
        self._queue: OrderedDict[int, None] = OrderedDict()
        self._held_back: OrderedDict[int, None] = OrderedDict()
        self._guards: dict[int, dict[str, float]] = {}  # block -> {waiting request: deadline}
        self._guarded: dict[str, tuple[int, ...]] = {}  # waiting request -> its cached prefix
        self._deadlines: list[tuple[float, str]] = []  # heap of the guarding requests' deadlines
        self._now = 0.0

    def _unguard(self, request_id: str, *, expired: bool) -> None:
        # Blocks go back leaf before parent: appended deepest first, or put
        # at the head root first (so the deepest ends up first).
        prefix = self._guarded.pop(request_id, ())
        for block_id in prefix if expired else reversed(prefix):
            guard = self._guards.get(block_id)
            if guard is None:
                continue
            guard.pop(request_id, None)
            if guard:
                continue
            del self._guards[block_id]
            if self._held_back.pop(block_id, 0) is None:
                self._queue[block_id] = None
                if expired:  # held back since long ago: as old as LRU has it
                    self._queue.move_to_end(block_id, last=False)
                # else: the request finished, so its blocks were just released

    def _expire(self) -> None:
        """End the guards whose deadline has passed."""
        heap = self._deadlines
        while heap and heap[0][0] < self._now:
            _, request_id = heapq.heappop(heap)
            self._unguard(request_id, expired=True)

    def deadline(self, block_id: int) -> float | None:
        """The earliest deadline not yet passed among the waiting requests
        that will hit the block, or ``None`` when it guards none."""
        live = [d for d in self._guards.get(block_id, {}).values() if d >= self._now]
        return min(live) if live else None

    # -------------------------------------------------------- observations --

    @hookimpl
    def sagellm_request_arrived(self, request: Request, prediction: LifetimePrediction | None,
                                match: PrefixMatch) -> None:
        self._now = max(self._now, request.arrival_s)
        if request.deadline_s is None or not match.blocks or request.deadline_s < self._now:
            return
        self._unguard(request.request_id, expired=False)  # a re-arrival replaces its guard
        self._guarded[request.request_id] = match.block_ids
        heapq.heappush(self._deadlines, (request.deadline_s, request.request_id))
        for block_id in reversed(match.block_ids):  # deepest first, as released
            self._guards.setdefault(block_id, {})[request.request_id] = request.deadline_s
            if self._queue.pop(block_id, 0) is None:
                self._held_back[block_id] = None

    @hookimpl
    def sagellm_request_finished(self, outcome: RequestOutcome) -> None:
        self._unguard(outcome.request.request_id, expired=False)

    @hookimpl
    def sagellm_blocks_released(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        self._now = max(self._now, now_s)
        for block in reversed(blocks):  # deepest first: leaves go before parents
            (self._held_back if block.block_id in self._guards else self._queue)[block.block_id] = None

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        self._now = max(self._now, now_s)
        for block in blocks:
            self._queue.pop(block.block_id, None)
            self._held_back.pop(block.block_id, None)

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            self._queue.pop(block.block_id, None)
            self._held_back.pop(block.block_id, None)
            self._guards.pop(block.block_id, None)  # the guarded requests will miss it

    # ------------------------------------------------------------ decision --

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision:
        self._expire()
        victims = list(islice((b for b in self._queue if b in candidates), num_blocks))
        if len(victims) < num_blocks:
            # Only held-back blocks are left: the most slack first (the sort
            # is stable, so LRU order, leaves first, within one deadline).
            held = [(self.deadline(b) or 0.0, b) for b in self._held_back if b in candidates]
            held.sort(key=lambda item: -item[0])
            victims.extend(b for _, b in held[: num_blocks - len(victims)])
        return EvictionDecision(tuple(victims))

    @hookimpl
    def sagellm_select_preemption(self, running: Sequence[SequenceState]) -> PreemptionDecision:
        # vLLM's FCFS rule, as LRU.
        return PreemptionDecision(running[-1].request_id)
