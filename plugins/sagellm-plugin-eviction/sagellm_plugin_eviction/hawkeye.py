"""Dead-block prediction in the manner of Hawkeye (Jain and Lin, "Back to
the Future: Leveraging Belady's Algorithm for Improved Cache Replacement",
ISCA'16): learn from the past which blocks Belady would not have kept, and
evict the blocks predicted dead first.

Most of the gap between LRU and Belady on the policy suite is blocks kept
that are never used again: an oracle that knows only *whether* a block comes
back, and is LRU otherwise (``belady:knows=whether``), closes three quarters
of it (``docs/benchmarks/policy-suite.md``). This policy answers that
question online.

* **OPTgen** (the paper's): Belady's decisions on the past are computable
  from the past alone. A block's use is a hit under Belady at capacity C iff
  at every moment since its previous use fewer than C other blocks were
  being kept for a later use; keeping an *occupancy* count per moment of a
  window of recent history, each reuse is answered by one range check, and
  if it is a hit the range is incremented. It runs on a sample of the
  content keys (those whose hash falls in a share ``sampled_blocks / C`` of
  the key space) at the same share of the capacity, as the paper samples
  sets, so its cost does not grow with the cache.
* **The predictor**: each released block has a *signature*, a few features
  of how it was used (its chain's first block, whether this request hit it,
  how far from the chain's end it lies, how deep it is, how often it was
  hit, its tenant); each feature indexes a table whose entries count the
  Belady hits and misses of the sampled blocks released with it (halved
  past ``memory``, so the counts follow the workload). A sampled block's
  next use is a hit or a miss as OPTgen says; a block last used before a
  moment the sampled cache was full is a miss whenever it comes back, and
  one not back within the longest reuse seen (nor within LRU's eviction
  age) is taken for a miss, and corrected if it comes back a hit. A block
  is predicted dead when the miss shares of its signature's entries
  average above ``dead_share``; with no evidence an entry's share is 1/2,
  so before any evidence every block is live and the policy is LRU.
* **The order**: LRU's (release order, a chain's deepest block first, as
  vLLM's free queue), with a block predicted dead placed as if released
  ``demotion`` cache sizes of releases earlier (``inf``: before every live
  block, Hawkeye's order). A use of a block is a use of every block before
  it in its chain, so within a release, once a block is predicted dead
  every deeper one is too: evicting it would drop them anyway.

Cost: per released block, the feature hashes and table reads in Python;
per sampled access, a range maximum over at most ``window`` sampled cache
sizes of moments (numpy); choosing k victims is O(k), a merge of two
queues each already in order.
It uses no future: only the block observations (``future_requests`` is
never read).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from itertools import chain, islice

import numpy
from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import CachedBlock, EvictionCandidates, EvictionDecision

#: Entries per feature's table (feature hashes are folded into it).
TABLE_SIZE = 4096
#: The key space is cut in this many slices for sampling.
SAMPLE_SLICES = 1 << 16


@frozen
class HawkeyeSettings:
    #: OPTgen's sampled cache: about this many blocks of the capacity are
    #: simulated (all of it when the cache is smaller).
    sampled_blocks: int = field(default=4096, converter=int, validator=validators.gt(0))
    #: OPTgen's history, in sampled cache sizes of sampled accesses; a block
    #: not used again within it counts as a Belady miss.
    window: float = field(default=64.0, converter=float, validator=validators.gt(0))
    #: A block not used again within the time in which this share of the
    #: sampled reuses came back (rounded up to a power of 2) is taken for
    #: dead: where the cache is never full, OPTgen alone would wait for the
    #: window's end.
    patience: float = field(default=1.0, converter=float, validator=[validators.gt(0), validators.le(1)])
    #: A block predicted dead goes in LRU's order as if it had been released
    #: this many cache sizes of releases earlier; ``inf``: before every
    #: block predicted live (Hawkeye's order). Finite, a wrong prediction
    #: still leaves the block some time to be used.
    demotion: float = field(default=0.5, converter=float, validator=validators.ge(0))
    #: A block is predicted dead when its signature's entries' miss shares
    #: average above this.
    dead_share: float = field(default=0.55, converter=float, validator=[validators.gt(0), validators.lt(1)])
    #: A table entry's counts are halved when they pass this.
    memory: int = field(default=64, converter=int, validator=validators.gt(1))


def _bucket(n: int) -> int:
    """0, 1, 2-3, 4-7, ...: a log2 scale for counts and distances."""
    return n.bit_length()


class HawkeyeEviction:
    """``[eviction] plugin = "hawkeye"``"""

    Settings = HawkeyeSettings

    def __init__(self, settings: HawkeyeSettings | None, context: PluginContext):
        settings = settings if settings is not None else HawkeyeSettings()
        self.settings = settings
        rate = min(1.0, settings.sampled_blocks / max(1, context.num_blocks))
        self._sample_below = max(1, round(rate * SAMPLE_SLICES))
        self._capacity = max(1, int(rate * context.num_blocks))  # the sampled cache's
        self._window = max(2, round(settings.window * self._capacity))
        self._occupancy = numpy.zeros(self._window, dtype=numpy.int32)
        self._time = 0  # sampled accesses so far
        self._full = -1  # the latest moment at which the sampled cache was full
        #: reuses within the window by log2 of the time since the previous use
        self._reuse_spans = [0] * 64
        self._reuses = 0
        self._new_keys = 0  # sampled accesses to a key not in the history
        self._horizon = self._window
        #: sampled key -> [its last use's time, the signature of its release
        #: after it (None before), judged dead already], oldest use first
        self._history: OrderedDict[int, list] = OrderedDict()
        #: the sampled keys released and not judged yet, oldest use first
        self._unjudged: OrderedDict[int, None] = OrderedDict()
        # per feature, per entry: [Belady hits, misses] of its signatures
        self._counts = [[[0, 0] for _ in range(TABLE_SIZE)] for _ in range(5)]
        # evictable blocks -> their place in the order, each in release order
        self._dead: OrderedDict[int, float] = OrderedDict()  # predicted dead
        self._live: OrderedDict[int, float] = OrderedDict()
        self._releases = 0
        self._demotion = settings.demotion * context.num_blocks
        self._root: dict[int, int] = {}  # cached block -> its chain's first block's key
        self._hits: dict[int, int] = {}  # cached block -> hits so far
        self._hit_now: set[int] = set()  # hit since its last release
        # (tenant, namespace) -> a number: strings hash differently in each
        # process, and the tables' collisions would differ from run to run
        self._spaces: dict[tuple[str | None, str], int] = {}
        #: Trained outcomes, for tests and reports: [Belady hits, misses].
        self.trained = [0, 0]
        #: Released blocks predicted [dead, live].
        self.predicted = [0, 0]

    # ------------------------------------------------------------ OPTgen --

    def _sampled(self, key: int) -> bool:
        return key % SAMPLE_SLICES < self._sample_below

    def _train(self, signature: tuple[int, ...], hit: bool) -> None:
        side = 0 if hit else 1
        self.trained[side] += 1
        memory = self.settings.memory
        for table, index in zip(self._counts, signature):
            counts = table[index]
            counts[side] += 1
            if counts[0] + counts[1] > memory:  # forget half: the workload moves on
                counts[0] /= 2
                counts[1] /= 2

    def _access(self, key: int) -> None:
        """A use of sampled ``key`` now: OPTgen's answer for its previous use."""
        now, window, occupancy = self._time, self._window, self._occupancy
        history, unjudged = self._history, self._unjudged
        entry = history.get(key)
        if entry is not None:
            before, signature, judged = entry
            self._reuse_spans[(now - before).bit_length()] += 1
            self._reuses += 1
            if self._reuses % 64 == 0:
                self._horizon = self._patience_horizon()
            if signature is not None and not (judged and before <= self._full):
                # Uses are answered in the order they come, as OPTgen does.
                lo, hi = before % window, now % window
                span = occupancy[lo:hi] if lo < hi else numpy.concatenate((occupancy[lo:], occupancy[:hi]))
                peak = int(span.max()) if len(span) else 0
                hit = peak < self._capacity
                if hit:  # Belady kept it all along: it occupied every moment since
                    if peak + 1 >= self._capacity:  # and filled the cache at its last full moment
                        last = int(numpy.flatnonzero(span == peak)[-1])
                        self._full = max(self._full, before + last)
                    if lo < hi:
                        occupancy[lo:hi] += 1
                    else:
                        occupancy[lo:] += 1
                        occupancy[:hi] += 1
                if not judged or hit:  # (judged dead for its patience and back: corrected)
                    self._train(signature, hit)
            entry[0], entry[1], entry[2] = now, None, False
            history.move_to_end(key)
            unjudged.pop(key, None)
        else:
            history[key] = [now, None, False]
            self._new_keys += 1
        self._time = now + 1
        occupancy[self._time % window] = 0  # a new moment: the one a window ago is forgotten
        # A block last used at or before a full moment cannot be a Belady
        # hit whenever it comes back (Belady kept C others through it); one
        # not used again within the patience horizon is taken for dead too,
        # and corrected if it comes back a Belady hit.
        doomed = max(self._full, self._time - max(self._horizon, self._lru_age()))
        while unjudged:
            oldest = next(iter(unjudged))
            entry = history[oldest]
            if entry[0] > doomed:
                break
            unjudged.popitem(last=False)
            self._train(entry[1], False)
            entry[2] = True
        while history:  # out of the window: forgotten
            oldest = next(iter(history))
            if history[oldest][0] > self._time - window:
                break
            history.popitem(last=False)
            unjudged.pop(oldest, None)

    def _lru_age(self) -> int:
        """About how long LRU keeps a block (the time in which the sampled
        cache's size in new keys came): a block back within it hits under
        LRU's order anyway, so taking it for dead sooner can only lose."""
        return int(self._capacity * self._time / max(1, self._new_keys))

    def _patience_horizon(self) -> int:
        """The span within which ``patience`` of the reuses came back."""
        spans = self._reuse_spans
        wanted, seen = self.settings.patience * sum(spans), 0
        for bits, count in enumerate(spans):
            seen += count
            if seen >= wanted:
                return min(self._window, 1 << bits)
        return self._window

    # ------------------------------------------------------- observations --

    @hookimpl
    def sagellm_blocks_cached(self, blocks: tuple[CachedBlock, ...]) -> None:
        root, hits = self._root, self._hits
        for block in blocks:
            parent = block.parent_id
            root[block.block_id] = root.get(parent, block.key) if parent is not None else block.key
            hits[block.block_id] = 0
            if self._sampled(block.key):
                self._access(block.key)

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...]) -> None:
        dead, live, hits, hit_now = self._dead, self._live, self._hits, self._hit_now
        for block in blocks:
            block_id = block.block_id
            dead.pop(block_id, None)
            live.pop(block_id, None)
            hits[block_id] = hits.get(block_id, 0) + 1
            hit_now.add(block_id)
            if self._sampled(block.key):
                self._access(block.key)

    def signature(self, block: CachedBlock, from_end: int, length: int) -> tuple[int, ...]:
        """The table index per feature of ``block``, released ``from_end``
        blocks before the end of a chain of ``length``."""
        block_id = block.block_id
        hit = block_id in self._hit_now
        tail = _bucket(from_end)
        root = self._root.get(block_id, block.key)
        space = self._spaces.setdefault((block.tenant, block.namespace), len(self._spaces))
        return (
            hash((root, hit)) % TABLE_SIZE,
            hash((space, hit, tail)) % TABLE_SIZE,
            hash((_bucket(block.depth), _bucket(length), hit)) % TABLE_SIZE,
            hash((min(self._hits.get(block_id, 0), 8), tail)) % TABLE_SIZE,
            hash((root, tail)) % TABLE_SIZE,
        )

    def is_dead(self, signature: tuple[int, ...]) -> bool:
        share = 0.0
        for table, index in zip(self._counts, signature):
            hits, misses = table[index]
            share += (misses + 0.5) / (hits + misses + 1.0)  # 1/2 with no evidence
        return share > self.settings.dead_share * len(signature)

    @hookimpl
    def sagellm_blocks_released(self, blocks: tuple[CachedBlock, ...]) -> None:
        length, history, hit_now = len(blocks), self._history, self._hit_now
        fates = []
        dead = False
        for i, block in enumerate(blocks):  # root first: a dead block's descendants are dead too
            signature = self.signature(block, length - 1 - i, length)
            dead = dead or self.is_dead(signature)
            fates.append(dead)
            self.predicted[0 if dead else 1] += 1
            if self._sampled(block.key):
                entry = history.get(block.key)
                if entry is not None and entry[1] is None:
                    entry[1] = signature
                    self._unjudged[block.key] = None
            hit_now.discard(block.block_id)
        for block, is_dead in zip(reversed(blocks), reversed(fates)):  # leaves first
            self._releases += 1
            if is_dead:
                self._dead[block.block_id] = self._releases - self._demotion
            else:
                self._live[block.block_id] = self._releases

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            block_id = block.block_id
            self._dead.pop(block_id, None)
            self._live.pop(block_id, None)
            self._root.pop(block_id, None)
            self._hits.pop(block_id, None)
            self._hit_now.discard(block_id)

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision:
        order = chain(self._dead, self._live) if math.isinf(self._demotion) else self._merged()
        return EvictionDecision(tuple(islice(filter(candidates.__contains__, order), num_blocks)))

    def _merged(self) -> Iterator[int]:
        """The evictable blocks, lowest place first (both queues are in
        place order already)."""
        dead, live = iter(self._dead.items()), iter(self._live.items())
        d, v = next(dead, None), next(live, None)
        while d is not None and v is not None:
            if d[1] <= v[1]:
                yield d[0]
                d = next(dead, None)
            else:
                yield v[0]
                v = next(live, None)
        if d is not None:
            yield d[0]
            yield from (block_id for block_id, _ in dead)
        if v is not None:
            yield v[0]
            yield from (block_id for block_id, _ in live)

    @property
    def predicted_dead(self) -> int:
        """Evictable blocks predicted dead now."""
        return len(self._dead)
