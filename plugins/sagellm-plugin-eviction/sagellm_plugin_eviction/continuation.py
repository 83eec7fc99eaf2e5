"""Continuation-aware eviction: keep the prefixes whose conversation is likely
to send its next turn soon, with the likelihood learned online.

On a conversation trace, a released chain is used again almost only by the
next turn of its conversation, whose prompt extends it; and the whole gap
between LRU and the offline optimum is blocks that are never used again
(``benchmarks/mooncake_study.py``). Recency says little about which those
are: a next turn comes a median 123 s after the last one, one in ten within
42 s, so the hazard of reuse rises with idle time before it falls. What
does tell ended conversations apart, if weakly, is the conversation itself:
how many turns it has had, how many blocks its last turn added, how long it
is, and how long its user took before the last turn.

Every release of a chain (a request's blocks losing their last reference)
opens a *turn* with those features and its release time. A later release
whose chain passes through a pending turn's last block, or, where the
engine caches output too, hits at least half of its chain, continues that
turn: a positive label, and its gap joins a histogram. A turn not continued within
``label_after_s`` is a negative label. A logistic regression learns
``p = P(continued)`` from the labels by stochastic gradient steps, and the
histogram gives ``S(a) = P(gap > a | continued)``. A turn's blocks are worth,
at age ``a``, the chance that its next turn comes within the next
``reuse_window_s`` (``H``) given that none came so far::

    alive(a) = p S(a) / (1 - p + p S(a))        (Bayes: still to come at age a)
    value(a) = alive(a) × (1 - S(a + H) / S(a))

so an ended conversation loses value as it outstays the gaps seen, a turn
of a conversation that keeps coming back keeps it, and one released a moment
ago is not yet worth much when next turns never come that fast. A turn older
than ``label_after_s`` is worth nothing; such turns go first, oldest first,
in LRU's order (ranking them by ``p`` instead lost hits on Mooncake in
exploratory runs).

A chain that ends inside others' (a shared system prompt) is reused by every
prompt that extends it; it is not a conversation's turn and is not
labelled, and a prompt that branches off a pending turn's last block does
not continue it.

Victims are the blocks of the turns with the least value, each turn's chain
shrunk from its leaves: evicting an inner block would drop its descendants
with it, and a hit takes only the leading run of cached blocks, so a
conversation kept in part still hits that part.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy
from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import CachedBlock, EvictionCandidates, EvictionDecision
from sagellm_plugin_eviction.ages import AGE_BINS, AGE_UNIT_S, age_bin, bin_age
from sagellm_plugin_eviction.chains import LeafChains


@frozen
class ContinuationSettings:
    #: H: how soon a next turn must come to be worth keeping a turn's blocks for.
    reuse_window_s: float = field(default=100.0, validator=[validators.instance_of(float), validators.gt(0)])
    #: A turn not continued within this long is labelled ended.
    label_after_s: float = field(default=600.0, validator=[validators.instance_of(float), validators.gt(0)])
    #: Step size of the logistic regression's gradient steps.
    learning_rate: float = field(default=0.05, validator=[validators.instance_of(float), validators.ge(0)])


class Turn:
    """A released chain: what its conversation looked like, and its leaves."""

    __slots__ = ("features", "released_at", "opened", "turns", "end_key", "end_depth", "leaves", "slot", "labelled")

    def __init__(self, features, released_at: float, opened: int, turns: int, end_key: int, end_depth: int):
        self.features = features
        self.released_at = released_at
        self.opened = opened  # turns opened before it: the order among equal release times
        self.turns = turns
        self.end_key = end_key
        self.end_depth = end_depth
        self.leaves: set[int] = set()  # its blocks that are evictable leaves now
        self.slot = -1  # its row in the policy's arrays while it has leaves
        self.labelled = False  # its chain ended at a leaf: a conversation's turn, to be labelled


def turn_features(turns: int, new_blocks: int, blocks: int, previous_gap_s: float | None):
    """Bias, log turns so far, log blocks the turn added, log chain length,
    log gap before this turn (0 with a flag on a first turn)."""
    first = previous_gap_s is None
    return numpy.array(
        [
            1.0,
            math.log(turns),
            math.log1p(new_blocks),
            math.log1p(blocks),
            0.0 if first else math.log1p(previous_gap_s),
            float(first),
        ]
    )


class ContinuationEviction(LeafChains):
    """``[eviction] plugin = "continuation"``"""

    Settings = ContinuationSettings

    def __init__(self, settings: ContinuationSettings, context: PluginContext):
        super().__init__(context)  # a record's value: its turn, None until released (chains.py)
        self.settings = settings
        self.weights = numpy.zeros(6)
        # Gaps are observed only within the label window: a pseudo-count in
        # each of its bins is the prior, a uniform gap on the log scale.
        self.gaps = numpy.array([1.0 if bin_age(b) <= settings.label_after_s else 0.0 for b in range(AGE_BINS)])
        # S's table: gaps at or past each bin edge (counts are whole, so
        # kept exactly by adding 1 up to a gap's bin), S and its slopes there.
        self._gaps_from = numpy.append(numpy.cumsum(self.gaps[::-1])[::-1], 0.0)
        self._tail = numpy.zeros(AGE_BINS + 1)
        self._slopes = numpy.zeros(AGE_BINS + 1)  # the last 0: past the last edge, S stays 0
        self._table_stale = True
        self._pending: OrderedDict[int, Turn] = OrderedDict()  # last block's key -> turn, oldest first
        self._leaf_turn: dict[int, Turn] = {}  # evictable leaf -> its turn
        # The turns with evictable leaves, in rows of arrays, so a choice
        # values them all in a few vectorised steps.
        self._with_leaves: list[Turn] = []
        self._features = numpy.zeros((256, 6))
        self._released_at = numpy.zeros(256)
        self._opened = numpy.zeros(256, dtype=numpy.int64)
        self._scratch = numpy.zeros(512)  # values(): the ages, then S, of twice the rows
        self._turns_opened = 0
        self._now = 0.0
        self._latest_release = -math.inf  # no turn's release is later

    # -------------------------------------------------------------- model --

    def continuation_probability(self, features) -> numpy.ndarray:
        if features.ndim == 1:
            return 1.0 / (1.0 + numpy.exp(-(features @ self.weights)))
        p = features @ self.weights  # the same steps, in place
        numpy.negative(p, out=p)
        numpy.exp(p, out=p)
        numpy.add(p, 1.0, out=p)
        return numpy.divide(1.0, p, out=p)

    def _learn(self, turn: Turn, continued: bool) -> None:
        p = float(self.continuation_probability(turn.features))
        self.weights += self.settings.learning_rate * (float(continued) - p) * turn.features

    def _survival_table(self) -> tuple[numpy.ndarray, numpy.ndarray]:
        """S at the bin edges 0, 1, ..., AGE_BINS (the last 0), and the slope
        from each edge to the next (the last 0), redone when a gap was seen."""
        if self._table_stale:
            numpy.divide(self._gaps_from, self._gaps_from[0], out=self._tail)
            # numpy.interp's slopes, (S[j + 1] - S[j]) / (edge[j + 1] - edge[j]), edges 1 apart
            numpy.subtract(self._tail[1:], self._tail[:-1], out=self._slopes[:-1])
            self._table_stale = False
        return self._tail, self._slopes

    def _count_gap(self, gap_s: float) -> None:
        b = age_bin(gap_s)
        self.gaps[b] += 1.0
        self._gaps_from[: b + 1] += 1.0
        self._table_stale = True

    def _survival(self, ages: numpy.ndarray) -> numpy.ndarray:
        """S(age) = P(gap > age | continued), from the histogram, linear
        between bin edges on the bins' log scale: bins are a factor of √2
        wide, too coarse to step S by a window of ``reuse_window_s``.
        Overwrites ``ages``."""
        tail, slopes = self._survival_table()
        position = ages
        numpy.divide(position, AGE_UNIT_S, out=position)
        numpy.add(position, 1.0, out=position)
        numpy.log2(position, out=position)
        numpy.multiply(position, 2.0, out=position)  # bin b spans [b, b + 1)
        # numpy.interp(position, edges, tail) to the bit, as an index and a
        # step (edges are 0, 1, ..., AGE_BINS; past the last, S is 0): its
        # binary search per point was a third of a choice's cost
        edge = position.astype(numpy.intp)
        numpy.minimum(edge, AGE_BINS, out=edge)
        numpy.subtract(position, edge, out=position)  # the step past the edge
        numpy.multiply(position, slopes[edge], out=position)
        numpy.add(position, tail[edge], out=position)
        return numpy.maximum(position, 1e-9, out=position)

    def _expire(self, now_s: float) -> None:
        horizon = now_s - self.settings.label_after_s
        pending = self._pending
        while pending:
            turn = next(iter(pending.values()))
            if turn.released_at >= horizon and len(pending) <= self.ghost_limit:
                break
            pending.popitem(last=False)
            if turn.released_at < horizon:
                self._learn(turn, continued=False)

    # -------------------------------------------------------- bookkeeping --

    def _leaf(self, block_id: int) -> None:
        meta = self._meta[block_id]
        turn = meta.value
        if turn is not None and not meta.held and meta.children == 0 and block_id not in self._leaf_turn:
            self._leaf_turn[block_id] = turn
            turn.leaves.add(block_id)
            if turn.slot < 0:
                row = turn.slot = len(self._with_leaves)
                if row == len(self._released_at):
                    self._features = numpy.resize(self._features, (2 * row, 6))
                    self._released_at = numpy.resize(self._released_at, 2 * row)
                    self._opened = numpy.resize(self._opened, 2 * row)
                    self._scratch = numpy.zeros(4 * row)
                self._with_leaves.append(turn)
                self._features[row] = turn.features
                self._released_at[row] = turn.released_at
                self._opened[row] = turn.opened

    def _not_leaf(self, block_id: int) -> None:
        turn = self._leaf_turn.pop(block_id, None)
        if turn is not None:
            turn.leaves.discard(block_id)
            if not turn.leaves:  # the last row fills its place
                row, last = turn.slot, self._with_leaves.pop()
                turn.slot = -1
                if last is not turn:
                    self._with_leaves[row] = last
                    last.slot = row
                    self._features[row] = self._features[len(self._with_leaves)]
                    self._released_at[row] = self._released_at[len(self._with_leaves)]
                    self._opened[row] = self._opened[len(self._with_leaves)]

    def _previous(self, end: CachedBlock) -> tuple[Turn | None, int, bool]:
        """The turn this chain continues, the depth of the last block they
        share, and whether that turn is pending (continued within the label
        window), or ``(None, -1, False)``.

        A next turn's prompt extends its previous turn's: it passes through
        that turn's last block (found by content key, so also when the block
        was evicted and this request cached it again), unless that block is
        a branch point, as a system prompt that other prompts extend is. Where
        the engine caches a turn's output too, the next prompt leaves the
        chain before its end: then the turn that last released the deepest
        block this request hit, if the hit covers at least half of its
        chain (a prompt that only shares a system prompt covers little)."""
        meta = self._meta.get(end.block_id)
        hit = None
        while meta is not None:
            turn = self._pending.get(meta.key)
            if turn is not None:
                return (turn, meta.depth, True) if meta.children <= 1 else (None, -1, False)
            if hit is None and meta.value is not None:
                hit = meta
            meta = self._meta.get(meta.parent) if meta.parent is not None else None
        if hit is not None:
            turn = hit.value
            if turn.labelled and 2 * (hit.depth + 1) >= turn.end_depth + 1:
                return turn, hit.depth, self._pending.get(turn.end_key) is turn
        return None, -1, False

    # -------------------------------------------------------- observations --

    @hookimpl
    def sagellm_blocks_cached(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        self._now = now_s
        for block in blocks:
            self._cache(block, None)

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        self._now = now_s
        for block in blocks:
            meta = self._meta.get(block.block_id)
            if meta is not None:
                meta.held = True
                self._not_leaf(block.block_id)

    @hookimpl
    def sagellm_blocks_released(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        self._now = now_s
        if not blocks:
            return
        self._expire(now_s)
        self._latest_release = max(self._latest_release, now_s)
        end = blocks[-1]  # chain order: the request's deepest block
        previous, shared_depth, pending = self._previous(end)
        self._turns_opened += 1
        if previous is None:
            turn = Turn(
                turn_features(1, end.depth + 1, end.depth + 1, None), now_s, self._turns_opened, 1, end.key, end.depth
            )
        else:
            gap = now_s - previous.released_at
            if pending:
                del self._pending[previous.end_key]
                self._learn(previous, continued=True)
                self._count_gap(gap)
            new_blocks = max(0, end.depth - shared_depth)  # 0: the same prompt again
            turn = Turn(
                turn_features(previous.turns + 1, new_blocks, end.depth + 1, gap),
                now_s,
                self._turns_opened,
                previous.turns + 1,
                end.key,
                end.depth,
            )
        end_meta = self._meta.get(end.block_id)
        if end_meta is not None and end_meta.children == 0:
            # A chain that ends inside others' (a shared system prompt) is
            # reused by every prompt that extends it: that says nothing about
            # conversations ending, and its blocks are not leaves to weigh.
            self._pending[end.key] = turn
            turn.labelled = True
        self._release(blocks, lambda meta: turn)

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        self._now = now_s
        for block in blocks:
            self._forget(block.block_id)

    # ------------------------------------------------------------ decision --

    def values(self) -> numpy.ndarray:
        """value(a) now of each turn with leaves, by row (the module's
        docstring). Computed in place, each step as the formula writes it,
        so the figures are the formula's to the bit: a choice is overhead
        bound at a few hundred rows."""
        n = len(self._with_leaves)
        both = self._scratch[: 2 * n]
        ages = both[:n]
        numpy.subtract(self._now, self._released_at[:n], out=ages)
        if self._now < self._latest_release:  # a clock that went back (not a replay's)
            numpy.maximum(ages, 0.0, out=ages)
        numpy.add(ages, self.settings.reuse_window_s, out=both[n:])
        self._survival(both)  # one pass for S(a) and S(a + H)
        still, later = both[:n], both[n:]
        p = self.continuation_probability(self._features[:n])
        alive = numpy.multiply(p, still)
        numpy.subtract(1.0, p, out=p)
        numpy.add(p, alive, out=p)  # 1 - p + p S(a)
        numpy.divide(alive, p, out=alive)
        numpy.divide(later, still, out=later)
        numpy.subtract(1.0, later, out=later)
        return numpy.multiply(alive, later, out=alive)

    def _by_value(self, n: int, wanted: int):
        """Rows least value first, then the oldest. Most choices take all
        their victims from the first turn: it is found alone when its value
        is the only least one; the lowest ``wanted`` values (and their ties)
        are sorted next, the rest only if those turns do not hold enough
        victims (a full sort of thousands of turns per choice cost most of it)."""
        if not n:
            return
        values, released, opened = self.values(), self._released_at[:n], self._opened[:n]
        first = int(values.argmin())
        skip = 0
        if numpy.count_nonzero(values == values[first]) == 1:
            yield first  # the order's first row, found in two passes
            skip = 1
        # (rows as ints, one at a time: few are taken, and ties can make thousands)
        if n <= 2 * wanted:
            yield from map(int, numpy.lexsort((opened, released, values))[skip:])
            return
        low = values <= numpy.partition(values, wanted - 1)[wanted - 1]
        rows = numpy.flatnonzero(low)
        yield from map(int, rows[numpy.lexsort((opened[rows], released[rows], values[rows]))][skip:])
        rows = numpy.flatnonzero(~low)  # seldom reached: the lowest turns hold enough
        yield from map(int, rows[numpy.lexsort((opened[rows], released[rows], values[rows]))])

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision:
        turns, n = self._with_leaves, len(self._with_leaves)  # by row, as the values are
        records = self._meta
        victims: list[int] = []
        chosen: set[int] = set()
        children_taken: dict[int, int] = {}
        for i in self._by_value(n, num_blocks):
            turn = turns[i]
            stack = sorted(turn.leaves)
            while stack:
                block = stack.pop()
                if block in chosen or block not in candidates:
                    continue
                victims.append(block)
                chosen.add(block)
                if len(victims) == num_blocks:
                    return EvictionDecision(tuple(victims))
                # Its parent is next if this turn owns it and nothing else hangs from it.
                parent = records[block].parent
                meta = records.get(parent) if parent is not None else None
                if meta is not None:
                    taken = children_taken[parent] = children_taken.get(parent, 0) + 1
                    if meta.value is turn and not meta.held and meta.children == taken:
                        stack.append(parent)
        return EvictionDecision(tuple(victims))
