"""``[admission] plugin = "footprint"``: admit a request only when its
predicted footprint fits beside the running requests' predicted growth, so
that decoding does not run out of blocks and preempt (recompute) a request.

A request's predicted footprint is its prompt and generated tokens plus the
output the lifetime predictor gives at ``quantile`` (the predicted length
distribution conditioned on what it has generated, once it has outlived
that): the quantile is the safety margin. A running request's predicted
growth is its footprint less the blocks it holds. What must fit in the
blocks that are free or hold evictable cached KV (``available_blocks``)
depends on ``demand``:

- ``"peak"`` (the default): the peak over time of the predicted occupancy.
  Each running request grows a token a step until its predicted end and
  then frees all its blocks, so a request that ends early returns blocks
  before a later one has grown into them. Once a step, the running
  requests are sorted by predicted end and the occupancy beyond what they
  hold now is taken at each end (just before that request frees its
  blocks), with its running maximum. A candidate is admitted when the
  running maximum up to the first end at or after its own, plus its own
  final footprint, fits (the candidate counted at its final footprint from
  the start, a bound on its own curve), and the running requests' peak
  after it has ended fits too.
- ``"sum"``: every running request at its final footprint at once, the
  candidate's footprint beside them (a bound on the peak, never smaller).

Otherwise it is deferred and the step scheduler asks the next one, unless
it has waited ``hold_s`` since its arrival: then the requests after it in
the step's order are deferred too, so that what the running requests free
goes to it (a large request is not passed by smaller ones for ever).

Greedy fallback, so that the queue never starves: with nothing running, a
request is admitted as without the plugin (memory permitting); and when
nothing has been admitted for ``max_wait_s``, one request that has waited
that long is: the first the passes' order reaches (the oldest, under
FCFS). A queue held back by pessimistic predictions still moves, and an
overloaded one, where every request has waited long, is not handed to
greedy admission whole.
Without a prediction (no ``[lifetime]`` plugin) the output is taken as
``default_output_tokens``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection
from typing import Any

import numpy
from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import Admission, AdmissionDecision, RequestOutcome, SequenceState

DEFER = AdmissionDecision(Admission.DEFER)


@frozen
class FootprintSettings:
    #: The level of the predicted output length taken as the footprint.
    quantile: float = field(default=0.5, validator=[validators.instance_of(float), validators.gt(0), validators.lt(1)])
    #: Admit one request greedily after this long without an admission (seconds of the engine's clock).
    max_wait_s: float = field(default=10.0, validator=[validators.instance_of(float), validators.ge(0)])
    #: The output length of a request without a prediction.
    default_output_tokens: int = field(default=256, validator=[validators.instance_of(int), validators.ge(0)])
    #: What the running requests are predicted to need: "peak" (the predicted occupancy's peak over
    #: time, requests freeing their blocks at their predicted ends) or "sum" (all at their final footprint).
    demand: str = field(default="peak", validator=validators.in_(("peak", "sum")))
    #: A request deferred after waiting this long (seconds since its arrival) holds back the requests
    #: after it in the step's order, so that what the running requests free goes to it first
    #: (``inf``: never).
    hold_s: float = field(default=2.0, validator=[validators.instance_of(float), validators.ge(0)])


class FootprintAdmission:
    """The module's rule. The running requests' demand is computed once a step
    (and again after each admission in it), from per-request footprints kept
    until the request outlives them, so a decision is O(1) (``sum``) or
    O(log n) (``peak``: a bisection into the step's predicted ends) between
    admissions."""

    Settings = FootprintSettings

    def __init__(self, settings: FootprintSettings, context: PluginContext):
        self.quantile = settings.quantile
        self.max_wait_s = settings.max_wait_s
        self.default_output_tokens = settings.default_output_tokens
        self.block_size = context.block_size
        self.demand = settings.demand
        self.hold_s = settings.hold_s
        self._held_at: float | None = None  # the step in which a request that waited hold_s was deferred
        #: Request id -> (predicted total tokens, generated tokens it stays valid below).
        self._totals: dict[str, tuple[int, float]] = {}
        self._growth_key: tuple[float, int] | None = None
        self._growth = 0
        #: ``peak``: the step's :meth:`peak_profile`, computed at the step's first decision the sum refuses.
        self._profile: tuple[list[int], list[int]] | None = None
        self._last_admit_s = 0.0
        self.admitted = self.deferred = self.fallbacks = 0

    def predicted_tokens(self, state: SequenceState) -> int:
        """Prompt plus predicted output, the output at ``quantile`` of its
        predicted length given what it has generated."""
        generated = state.num_output_tokens
        known = self._totals.get(state.request_id)
        if known is not None and generated < known[1]:
            return known[0]
        prediction = state.prediction
        if prediction is None:
            output, valid_below = float(max(self.default_output_tokens, generated + 1)), float("inf")
        else:
            output = prediction.quantile(self.quantile)
            if generated >= output:  # it outlived its margin: the distribution past what it generated
                done = prediction.cdf(generated)
                output = max(generated + 1.0, prediction.quantile(done + self.quantile * (1.0 - done)))
            valid_below = output
        total = state.request.num_prompt_tokens + int(output + 0.5)
        self._totals[state.request_id] = (total, valid_below)
        return total

    def growth_blocks(self, running: Collection[SequenceState]) -> int:
        """The blocks the running requests are predicted to take beyond what they hold."""
        size, growth = self.block_size, 0
        for state in running:
            growth += max(0, -(-self.predicted_tokens(state) // size) - len(state.block_ids))
        return growth

    def peak_profile(self, running: Collection[SequenceState]) -> tuple[list[int], list[int]]:
        """The running requests' predicted ends, ascending (in steps from now:
        a token a step), and the running maximum of their predicted occupancy
        beyond the blocks they hold: entry 0 is 0 (now), entry k + 1 the
        largest occupancy at or before the k-th end, each request counted
        at its blocks for the tokens it will have then, or freed (minus the
        blocks it holds) once its end has passed."""
        size = self.block_size
        rows = []
        for state in running:
            total, now = self.predicted_tokens(state), state.num_tokens
            rows.append((max(0, total - now), now, total, len(state.block_ids)))
        if not rows:
            return [], [0]
        rows.sort()
        ends, tokens, totals, held = (numpy.array(col, dtype=numpy.int64) for col in zip(*rows, strict=True))
        # occupancy[k, j]: request j's blocks beyond those it holds at the k-th end; freed (-held) once past its own.
        reached = numpy.minimum(tokens[None, :] + ends[:, None], totals[None, :])
        grown = numpy.maximum(-(-reached // size) - held[None, :], 0)
        n = len(rows)
        freed = numpy.tri(n, n, -1, dtype=bool)  # j before k in end order: freed (ties count as freed)
        occupancy = numpy.where(freed, -held[None, :], grown).sum(axis=1)
        peaks = numpy.maximum.accumulate(numpy.concatenate(([0], occupancy)))
        return ends.tolist(), peaks.tolist()

    def _fits(
        self, need: int, state: SequenceState, now_s: float, running: Collection[SequenceState], available: int
    ) -> bool:
        """``need`` blocks beside the running requests' demand."""
        key = (now_s, len(running))  # the step, and its admissions so far
        if key != self._growth_key:
            self._growth_key, self._growth, self._profile = key, self.growth_blocks(running), None
        if need + self._growth <= available:
            return True  # the sum bounds the peak
        return self.demand == "peak" and self._peak_fits(state, need, running, available)

    def _peak_fits(self, state: SequenceState, need: int, running: Collection[SequenceState], available: int) -> bool:
        """The candidate (``need`` blocks at its end) beside the running requests' peak up to the first
        running end at or after its own, and their peak after it has ended: both within ``available``."""
        if self._profile is None:
            self._profile = self.peak_profile(running)
        ends, peaks = self._profile
        first = bisect_left(ends, max(0, self.predicted_tokens(state) - state.num_tokens))
        return need + peaks[min(first + 1, len(ends))] <= available and peaks[-1] <= available

    @hookimpl
    def sagellm_admit_request(
        self, state: SequenceState, now_s: float, running: Collection[SequenceState], available_blocks: int
    ) -> AdmissionDecision | None:
        if not running or now_s - max(self._last_admit_s, state.request.arrival_s) >= self.max_wait_s:
            self.fallbacks += 1
            self._last_admit_s = now_s
            return None
        if self._held_at == now_s:
            self.deferred += 1
            return DEFER
        need = -(-self.predicted_tokens(state) // self.block_size)
        if need > available_blocks or not self._fits(need, state, now_s, running, available_blocks):
            self.deferred += 1
            if now_s - state.request.arrival_s >= self.hold_s:
                self._held_at = now_s
            return DEFER
        self.admitted += 1
        self._last_admit_s = now_s
        return None

    @hookimpl
    def sagellm_request_finished(self, outcome: RequestOutcome) -> None:
        self._totals.pop(outcome.request.request_id, None)

    @hookimpl
    def sagellm_report_figures(self) -> dict[str, Any]:
        return {
            "footprint": {
                "demand": self.demand,
                "hold_s": None if self.hold_s == float("inf") else self.hold_s,
                "admitted": self.admitted,
                "deferred": self.deferred,
                "greedy": self.fallbacks,
            }
        }
