"""``[admission] plugin = "footprint"``: admit a request only when its
predicted footprint fits beside the running requests' predicted growth, so
that decoding does not run out of blocks and preempt (recompute) a request.

A request's predicted footprint is its prompt and generated tokens plus the
output the lifetime predictor gives at ``quantile`` (the predicted length
distribution conditioned on what it has generated, once it has outlived
that): the quantile is the safety margin. A running request's predicted
growth is its footprint less the blocks it holds. A waiting request is
admitted when its footprint and every running request's growth fit in the
blocks that are free or hold evictable cached KV (``available_blocks``);
otherwise it is deferred and the step scheduler asks the next one.

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

from collections.abc import Collection
from typing import Any

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


class FootprintAdmission:
    """The module's rule. Growth is summed once a step (and again after each
    admission in it), from per-request footprints kept until the request
    outlives them, so a decision is O(1) between admissions."""

    Settings = FootprintSettings

    def __init__(self, settings: FootprintSettings, context: PluginContext):
        self.quantile = settings.quantile
        self.max_wait_s = settings.max_wait_s
        self.default_output_tokens = settings.default_output_tokens
        self.block_size = context.block_size
        #: Request id -> (predicted total tokens, generated tokens it stays valid below).
        self._totals: dict[str, tuple[int, float]] = {}
        self._growth_key: tuple[float, int] | None = None
        self._growth = 0
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

    @hookimpl
    def sagellm_admit_request(
        self, state: SequenceState, now_s: float, running: Collection[SequenceState], available_blocks: int
    ) -> AdmissionDecision | None:
        if not running or now_s - max(self._last_admit_s, state.request.arrival_s) >= self.max_wait_s:
            self.fallbacks += 1
            self._last_admit_s = now_s
            return None
        key = (now_s, len(running))  # the step, and its admissions so far
        if key != self._growth_key:
            self._growth_key, self._growth = key, self.growth_blocks(running)
        need = -(-self.predicted_tokens(state) // self.block_size)
        if need + self._growth > available_blocks:
            self.deferred += 1
            return DEFER
        self.admitted += 1
        self._last_admit_s = now_s
        return None

    @hookimpl
    def sagellm_request_finished(self, outcome: RequestOutcome) -> None:
        self._totals.pop(outcome.request.request_id, None)

    @hookimpl
    def sagellm_report_figures(self) -> dict[str, Any]:
        return {"footprint": {"admitted": self.admitted, "deferred": self.deferred, "greedy": self.fallbacks}}
