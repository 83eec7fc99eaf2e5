"""SLO-aware eviction: LRU over the blocks no waiting request will hit;
the cached prefixes of waiting requests go last, those of requests that can
still meet their deadline (``Request.deadline_s``, a TTFT SLO) the very last,
the least slack kept longest.

A waiting request's cached prefix (the arrival lookup, ``match`` in
``sagellm_request_arrived``) is what it will hit once admitted: evicting it
turns a hit into prefill, spent just when the request has least time to
spare, and LRU evicts exactly these blocks under load, since a request
queues longest when memory is tightest. A prefix is held back from its
request's arrival until the request finishes (its blocks are held while it
runs). When only held-back blocks are left, those of requests without a
deadline, or past it (it can no longer be met), go first, then the most
slack first. Preemption is the runtime's default (the last running request,
vLLM's FCFS rule).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from itertools import islice

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import (
    CachedBlock,
    EvictionCandidates,
    EvictionDecision,
    LifetimePrediction,
    PrefixMatch,
    Request,
    RequestOutcome,
)


class SLOEviction:
    """``[eviction] plugin = "slo"``"""

    def __init__(self, settings, context: PluginContext):
        # Evictable blocks, least recently released first: those no waiting
        # request will hit (LRU's queue), and those held back for one.
        self._queue: OrderedDict[int, None] = OrderedDict()
        self._held_back: OrderedDict[int, None] = OrderedDict()
        self._guards: dict[int, dict[str, float]] = {}  # block -> {waiting request: deadline or inf}
        self._guarded: dict[str, tuple[int, ...]] = {}  # waiting request -> its cached prefix
        self._now = 0.0

    def _unguard(self, request_id: str) -> None:
        # The request finished, so its blocks were just released: back to
        # the queue's recent end, deepest first.
        for block_id in reversed(self._guarded.pop(request_id, ())):
            guard = self._guards.get(block_id)
            if guard is None:
                continue
            guard.pop(request_id, None)
            if guard:
                continue
            del self._guards[block_id]
            if self._held_back.pop(block_id, 0) is None:
                self._queue[block_id] = None

    def deadline(self, block_id: int) -> float | None:
        """The earliest deadline not yet passed among the waiting requests
        that will hit the block, or ``None`` when none can still be met."""
        live = [d for d in self._guards.get(block_id, {}).values() if self._now <= d < math.inf]
        return min(live) if live else None

    # -------------------------------------------------------- observations --

    @hookimpl
    def sagellm_request_arrived(
        self, request: Request, prediction: LifetimePrediction | None, match: PrefixMatch
    ) -> None:
        self._now = max(self._now, request.arrival_s)
        if not match.blocks:
            return
        self._unguard(request.request_id)  # a re-arrival replaces its guard
        self._guarded[request.request_id] = match.block_ids
        deadline = math.inf if request.deadline_s is None else request.deadline_s
        for block_id in reversed(match.block_ids):  # deepest first, as released
            self._guards.setdefault(block_id, {})[request.request_id] = deadline
            if self._queue.pop(block_id, 0) is None:
                self._held_back[block_id] = None

    @hookimpl
    def sagellm_request_finished(self, outcome: RequestOutcome) -> None:
        self._unguard(outcome.request.request_id)

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
            self._guards.pop(block.block_id, None)  # the waiting requests will miss it

    # ------------------------------------------------------------ decision --

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision:
        victims = list(islice((b for b in self._queue if b in candidates), num_blocks))
        if len(victims) < num_blocks:
            # Only held-back blocks are left: those no deadline depends on
            # first, then the most slack (the sort is stable: LRU order,
            # leaves first, among equals).
            held = [(self.deadline(b), b) for b in self._held_back if b in candidates]
            held.sort(key=lambda item: -math.inf if item[0] is None else -item[0])
            victims.extend(b for _, b in held[: num_blocks - len(victims)])
        return EvictionDecision(tuple(victims))
