"""Belady's MIN as an offline oracle: evict the block whose next use is
farthest in the future (never used again first, deepest first among equals).

It reads the future from its context (``PluginContext.future_requests``, the
requests the replay will send, in arrival order): for every full block of
every prompt, the chained content key
(:func:`sagellm_core.types.chain_key`) and the positions of the requests
that use it. The prefix cache reports each cached block's key, so the next use
of a block is a binary search. Requests are placed by arrival: exact in the
replay's cache-only mode, an approximation in timed mode (requests wait).

It is an upper bound to report beside online policies, not a policy to
deploy: it needs the whole trace in advance, and memory for one key per
distinct block of it.

``knows = "whether"`` is a weaker oracle: it knows only *whether* a block
will be used again, not when, and evicts the blocks never used again first,
then the others, each in LRU's order. It bounds what a perfect predictor of
which conversations return can add to LRU's order (what the policy suite's
gap to Belady is made of: docs/benchmarks/the-gap-to-belady.md).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import defaultdict

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import ROOT_KEY, CachedBlock, EvictionDecision, Request, chain_key

#: More releases than any replay makes (the "whether" order's two groups).
_RELEASES = float(2**50)


@frozen
class BeladySettings:
    #: "when": each block's next use (Belady's MIN); "whether": only whether
    #: it has one, LRU's order otherwise.
    knows: str = field(default="when", validator=validators.in_(("when", "whether")))


class BeladyEviction:
    """``[eviction] plugin = "belady"``"""

    Settings = BeladySettings

    def __init__(self, settings: BeladySettings, context: PluginContext):
        if context.future_requests is None:
            raise ValueError("belady needs the future requests, which only a replay knows (context.future_requests)")
        bs = context.block_size
        self._uses: dict[int, list[int]] = defaultdict(list)
        self._position: dict[str, int] = {}
        for i, request in enumerate(context.future_requests()):
            self._position[request.request_id] = i
            tokens, key = request.prompt_token_ids, ROOT_KEY
            for page in range(len(tokens) // bs):
                key = chain_key(key, tokens[page * bs : (page + 1) * bs].tobytes())
                self._uses[key].append(i)
        self.now = -1
        self._whether = settings is not None and settings.knows == "whether"
        self._released = 0
        self._next: dict[int, float] = {}  # evictable block -> position of its next use
        self._heap: list[tuple[float, int, int]] = []  # (-next use, -depth, block)

    def _next_use(self, key: int) -> float:
        uses = self._uses.get(key, ())
        i = bisect.bisect_right(uses, self.now)
        return uses[i] if i < len(uses) else math.inf

    @hookimpl
    def sagellm_request_arrived(self, request: Request) -> None:
        self.now = max(self.now, self._position.get(request.request_id, self.now))

    @hookimpl
    def sagellm_blocks_released(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in reversed(blocks) if self._whether else blocks:
            nxt = self._next_use(block.key)
            if self._whether:  # never used again first, then the rest; each oldest release first, leaves first
                self._released += 1
                nxt = (2 * _RELEASES if nxt == math.inf else _RELEASES) - self._released
            self._next[block.block_id] = nxt
            heapq.heappush(self._heap, (-nxt, -block.depth, block.block_id))

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            self._next.pop(block.block_id, None)

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            self._next.pop(block.block_id, None)

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates) -> EvictionDecision:
        heap, live = self._heap, self._next
        chosen, passed, seen = [], [], set()
        while heap and len(chosen) < num_blocks:
            # Stale entries (hit or evicted since) are dropped. An entry is
            # live when its next use is the block's: a block id the cache
            # reused may revive an older entry with the same next use, which
            # reorders only ties; the published figures (evicted blocks,
            # fragmentation) depend on it, so it stays.
            entry = heapq.heappop(heap)
            if live.get(entry[2]) == -entry[0] and entry[2] not in seen:
                seen.add(entry[2])
                (chosen if entry[2] in candidates else passed).append(entry)
        for entry in chosen + passed:  # choosing changes nothing; eviction is observed
            heapq.heappush(heap, entry)
        return EvictionDecision(tuple(entry[2] for entry in chosen))
