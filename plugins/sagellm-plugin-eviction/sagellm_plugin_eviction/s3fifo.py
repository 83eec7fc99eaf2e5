"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction",
SOSP'23), adapted to prefix chains.

Three queues: a small FIFO *S* (``small_share`` of the cache) where new blocks
start, a main FIFO *M*, and a ghost FIFO *G* of the content keys of blocks
recently evicted from S. Each block counts its hits (up to 3). Evicting from S
moves a block that was hit into M and drops one that was not (remembering its
key in G); evicting from M gives a block that was hit another round with one
hit fewer and drops one that was not. A block whose key is in G (it came back
soon after being dropped from S) starts in M.

Prefix chains: a request's new blocks enter S leaf first, so FIFO order drops
a chain from its tail; a block used by a running request is skipped, never
chosen. Choosing victims moves blocks between S and M and spends their hit
counts, as S3-FIFO's eviction does; the victims themselves leave when the
eviction is observed.
"""

from __future__ import annotations

from collections import OrderedDict

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import CachedBlock, EvictionDecision

_MAX_FREQ = 3


@frozen
class S3FIFOSettings:
    small_share: float = field(default=0.1, validator=[validators.gt(0), validators.lt(1)])
    #: Ghost entries, as a share of the cache.
    ghost_share: float = field(default=0.9, validator=[validators.ge(0)])


class S3FIFOEviction:
    """``[eviction] plugin = "s3fifo"``"""

    Settings = S3FIFOSettings

    def __init__(self, settings: S3FIFOSettings, context: PluginContext):
        self.small_cap = max(1, int(settings.small_share * context.num_blocks))
        self.ghost_cap = int(settings.ghost_share * context.num_blocks)
        self._small: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[int, None] = OrderedDict()  # content keys
        self._freq: dict[int, int] = {}
        self._key: dict[int, int] = {}

    @hookimpl
    def sagellm_blocks_cached(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in reversed(blocks):  # leaves first
            b = block.block_id
            self._freq[b] = 0
            self._key[b] = block.key
            if self._ghost.pop(block.key, "absent") is None:
                self._main[b] = None
            else:
                self._small[b] = None

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            b = block.block_id
            if b in self._freq:
                self._freq[b] = min(_MAX_FREQ, self._freq[b] + 1)

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            b = block.block_id
            if self._small.pop(b, "absent") is None and self.ghost_cap:
                self._ghost[block.key] = None
                while len(self._ghost) > self.ghost_cap:
                    self._ghost.popitem(last=False)
            self._main.pop(b, None)
            self._freq.pop(b, None)
            self._key.pop(b, None)

    def _scan_small(self, candidates, seen: set[int], promote: list[int]):
        """Victims from S, oldest first; blocks hit while in S are noted for
        promotion to M instead."""
        for b in self._small:
            if b in seen or b not in candidates:
                continue
            if self._freq[b] > 0:
                promote.append(b)
                continue
            yield b

    def _scan_main(self, candidates, seen: set[int], requeue: list[int]):
        """Victims from M, oldest first; a block with hits loses one and is
        noted to go round again."""
        for b in self._main:
            if b in seen or b not in candidates:
                continue
            if self._freq[b] > 0:
                self._freq[b] -= 1
                requeue.append(b)
                continue
            yield b

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates) -> EvictionDecision:
        chosen: list[int] = []
        seen: set[int] = set()
        # One scan of each queue per round; moves are applied between rounds
        # (an OrderedDict cannot change while it is iterated). Hit counts are
        # at most 3, so a few rounds always settle.
        for _ in range(_MAX_FREQ + 2):
            promote: list[int] = []
            requeue: list[int] = []
            small = self._scan_small(candidates, seen, promote)
            main = self._scan_main(candidates, seen, requeue)
            while len(chosen) < num_blocks:
                small_first = len(self._small) - len(promote) >= self.small_cap
                first, second = (small, main) if small_first else (main, small)
                victim = next(first, None)
                if victim is None:  # (block 0 is a valid victim: test with `is`)
                    victim = next(second, None)
                if victim is None:
                    break
                chosen.append(victim)
                seen.add(victim)
            small.close()
            main.close()
            for b in promote:
                del self._small[b]
                self._freq[b] = 0
                self._main[b] = None
            for b in requeue:
                self._main.move_to_end(b)
            if len(chosen) == num_blocks or not (promote or requeue):
                break
        return EvictionDecision(tuple(chosen))
