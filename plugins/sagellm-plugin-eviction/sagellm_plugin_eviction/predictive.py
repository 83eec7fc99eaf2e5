"""Predictive eviction: learn, online, how likely a cached block is to be hit
again and how soon, from the reuse distances observed so far, and evict the
blocks with the least expected hits per unit of cache space-time (the *hit
density* of Beckmann et al., "LHD: Improving Cache Hit Rate by Maximizing
Hit Density", NSDI'18, adapted to KV blocks and prefix chains).

A block's class is how often its content was used (cached, then each hit;
a content key evicted and cached again keeps its count, as ARC's ghosts
remember it) and how deep in its chain it lies (before block 4, before
block 16, deeper: on the Mooncake trace 36%, 29% and 22% of the blocks first
seen at those depths are used again, ``benchmarks/mooncake_study.py``). Per
class, histograms over the age (seconds since the block was last released)
count the hits that came at each age and the evictions that ended a block's
life at each age, decayed so that the model follows the workload. From
them, for every class and age::

    density(class, age) = hits after age / (expected remaining life × blocks alive at age)

so a block that is old for its class (its reuse is unlikely to come any
more) or of a class that is rarely reused goes first, and a block that is
young in a class whose reuses come at a typical interval (the next turn of a
conversation) stays until that interval has passed. Victims are the lowest
density among ``samples`` evictable blocks drawn at random (LHD's sampling),
so choosing costs O(samples), not O(cache).

Prefix chains: only leaves are sampled (evictable blocks with no cached
child). Evicting an inner block would drop its descendants with it, more
blocks than asked for, however dense they are; a chain instead shrinks from
its leaf, and its parent becomes a leaf in turn.
"""

from __future__ import annotations

import numpy
from attrs import define, field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import CachedBlock, EvictionCandidates, EvictionDecision
from sagellm_plugin_eviction.ages import AGE_BINS, AGE_UNIT_S, age_bin, bin_age
from sagellm_plugin_eviction.chains import ChainRecord, LeafChains


@frozen
class PredictiveSettings:
    #: Evictable blocks sampled per victim choice.
    samples: int = field(default=512, validator=[validators.instance_of(int), validators.gt(0)])
    #: Use counts beyond this share the top class (per depth band).
    classes: int = field(default=6, validator=[validators.instance_of(int), validators.gt(1)])
    #: Events (hits and evictions) between two refits of the density table;
    #: each refit first decays the histograms by ``decay``.
    refit_every: int = field(default=4096, validator=[validators.instance_of(int), validators.gt(0)])
    decay: float = field(default=0.9, validator=[validators.instance_of(float), validators.gt(0), validators.le(1)])
    seed: int = field(default=0, validator=validators.instance_of(int))


@define(slots=True, eq=False)
class ClassedRecord(ChainRecord):
    #: The block's class (use count and depth band).
    cls: int = 0


class PredictiveEviction(LeafChains):
    """``[eviction] plugin = "predictive"``"""

    Settings = PredictiveSettings
    Record = ClassedRecord

    def __init__(self, settings: PredictiveSettings, context: PluginContext):
        super().__init__(context)  # a record's value: its release time, in s (chains.py)
        self.settings = settings
        self.rng = numpy.random.default_rng(settings.seed)
        # The evictable leaves, for sampling: in arrays by position, the
        # block, its release time and its class (fixed while it is
        # evictable), so a choice ranks its sample in a few vectorised steps.
        self._count = 0
        self._position: dict[int, int] = {}  # block -> position
        self._block_at = numpy.zeros(1024, dtype=numpy.int64)
        self._released_at = numpy.zeros(1024)
        self._class_of = numpy.zeros(1024, dtype=numpy.intp)
        n = 3 * settings.classes
        self._hits = [[0.0] * AGE_BINS for _ in range(n)]
        self._ends = [[0.0] * AGE_BINS for _ in range(n)]
        self._events = 0
        self._now = 0.0
        # Until a refit, favour the recently released (LRU).
        self._density = numpy.array([[1.0 / (1.0 + bin_age(b)) for b in range(AGE_BINS)] for _ in range(n)])

    # -------------------------------------------------------- bookkeeping --

    def _class(self, uses: int, depth: int) -> int:
        band = 0 if depth < 4 else 1 if depth < 16 else 2
        return band * self.settings.classes + min(uses, self.settings.classes) - 1

    def _leaf(self, block_id: int) -> None:
        meta = self._meta[block_id]
        if not meta.held and meta.children == 0 and block_id not in self._position:
            index = self._count
            if index == len(self._block_at):
                self._block_at = numpy.resize(self._block_at, 2 * index)
                self._released_at = numpy.resize(self._released_at, 2 * index)
                self._class_of = numpy.resize(self._class_of, 2 * index)
            self._count += 1
            self._position[block_id] = index
            self._block_at[index] = block_id
            self._released_at[index] = meta.value
            self._class_of[index] = meta.cls

    def _not_leaf(self, block_id: int) -> None:
        index = self._position.pop(block_id, None)
        if index is None:
            return
        self._count -= 1
        last = self._count
        if index != last:  # the last one fills the gap
            moved = int(self._block_at[last])
            self._position[moved] = index
            self._block_at[index] = moved
            self._released_at[index] = self._released_at[last]
            self._class_of[index] = self._class_of[last]

    def _record(self, table: list[list[float]], cls: int, age_s: float) -> None:
        table[cls][age_bin(age_s)] += 1.0
        self._events += 1
        if self._events % self.settings.refit_every == 0:
            self._refit()

    def _refit(self) -> None:
        """Recompute density(class, age bin) from the decayed histograms."""
        decay = self.settings.decay
        for c in range(len(self._hits)):
            hits, ends = self._hits[c], self._ends[c]
            density = self._density[c]
            hits_above = alive_above = life_above = 0.0
            # From the oldest bin down: what happens to a block once it is this old.
            for b in range(AGE_BINS - 1, -1, -1):
                events = hits[b] + ends[b]
                hits_above += hits[b]
                alive_above += events
                life_above += events * bin_age(b)
                remaining = life_above - alive_above * bin_age(b) + alive_above * AGE_UNIT_S
                density[b] = hits_above / remaining if remaining > 0 else 0.0
                hits[b] *= decay
                ends[b] *= decay

    # -------------------------------------------------------- observations --

    @hookimpl
    def sagellm_blocks_cached(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        for block in blocks:
            meta = self._cache(block, now_s)
            meta.cls = self._class(meta.uses, meta.depth)

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        for block in blocks:
            meta = self._meta.get(block.block_id)
            if meta is None:
                continue
            self._record(self._hits, meta.cls, now_s - meta.value)
            meta.uses += 1
            meta.cls = self._class(meta.uses, meta.depth)
            meta.held = True
            self._not_leaf(block.block_id)

    @hookimpl
    def sagellm_blocks_released(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        self._now = now_s
        self._release(blocks, lambda meta: now_s)

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        for block in blocks:
            meta = self._forget(block.block_id)
            if meta is not None:
                self._record(self._ends, meta.cls, now_s - meta.value)

    # ------------------------------------------------------------ decision --

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision:
        n = self._count
        if n == 0:
            return EvictionDecision(())
        draws = self.settings.samples + num_blocks
        sample = numpy.unique(self.rng.integers(0, n, size=draws)) if draws < n else numpy.arange(n)
        # density of each sampled leaf: its class's table at its age
        ages = numpy.maximum(self._now - self._released_at[sample], 0.0)
        bins = numpy.minimum(AGE_BINS - 1, (2.0 * numpy.log2(1.0 + ages / AGE_UNIT_S)).astype(numpy.intp))
        density = self._density[self._class_of[sample], bins]
        blocks = self._block_at[sample]
        victims: list[int] = []
        for i in numpy.lexsort((blocks, density)):  # lowest density first, ties by block id
            block = int(blocks[i])
            if block in candidates:
                victims.append(block)
                if len(victims) == num_blocks:
                    break
        return EvictionDecision(tuple(victims))
