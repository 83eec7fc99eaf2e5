"""The predicted length distribution behind a
:class:`~sagellm_core.types.LifetimePrediction`: its CDF, its quantiles, and
the remaining length as decoding proceeds.

The quantiles (or the 80% interval) are read as a piecewise-linear CDF from
(0 tokens, 0), with an exponential tail above the top quantile whose mean is
the upper spread (top - median), so a request that outlives its prediction
is still expected to finish.
"""

from __future__ import annotations

import math

#: The levels of :attr:`LifetimePrediction.quantiles`.
QUANTILE_LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


class PredictedLengths:
    """The distribution methods :class:`LifetimePrediction` inherits."""

    output_tokens: float
    low_tokens: float
    high_tokens: float
    quantiles: tuple[float, ...]
    confidence: float

    def _points(self) -> list[tuple[float, float]]:
        if self.quantiles:
            return [(0.0, 0.0), *zip(QUANTILE_LEVELS, self.quantiles)]
        return [(0.0, 0.0), (0.1, self.low_tokens), (0.5, self.output_tokens), (0.9, self.high_tokens)]

    def _tail_mean(self, top: float) -> float:
        return max(1.0, top - self.output_tokens)

    def cdf(self, tokens: float) -> float:
        """The predicted probability that the output is at most ``tokens``."""
        points = self._points()
        top_level, top = points[-1]
        if tokens >= top:
            return 1.0 - (1.0 - top_level) * math.exp(-(tokens - top) / self._tail_mean(top))
        tokens = max(0.0, tokens)
        # The segment that ``tokens`` falls in, past any run of equal
        # quantiles at it (the CDF takes the highest level there).
        for (p0, x0), (p1, x1) in zip(points, points[1:]):
            if tokens < x1:
                return p0 + (p1 - p0) * (tokens - x0) / (x1 - x0)
        return top_level  # unreachable: tokens < top

    def quantile(self, level: float) -> float:
        """The inverse of :meth:`cdf`: the predicted length at ``level``."""
        points = self._points()
        top_level, top = points[-1]
        if level >= top_level:
            return top + self._tail_mean(top) * math.log((1.0 - top_level) / max(1e-12, 1.0 - level))
        for (p0, x0), (p1, x1) in zip(points, points[1:]):
            if level <= p1:
                return x1 if p1 == p0 else x0 + (x1 - x0) * (level - p0) / (p1 - p0)
        return top  # unreachable: level < top_level

    def remaining_tokens(self, generated_tokens: int) -> float:
        """The predicted median of the tokens still to come once
        ``generated_tokens`` have been generated: the median of the
        predicted distribution conditioned on exceeding ``generated_tokens``
        (at least 1)."""
        if generated_tokens <= 0:
            return self.output_tokens
        conditional_median = self.quantile((self.cdf(generated_tokens) + 1.0) / 2.0)
        return max(1.0, conditional_median - generated_tokens)

    def problem(self) -> str | None:
        """Why this prediction is unusable (not finite, negative, interval or
        quantiles out of order), or ``None`` when it is sound."""
        values = (self.low_tokens, self.output_tokens, self.high_tokens, *self.quantiles)
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values):
            return "has a negative or non-finite length"
        if not self.low_tokens <= self.output_tokens <= self.high_tokens:
            return "has low <= median <= high out of order"
        if not (isinstance(self.confidence, (int, float)) and 0.0 <= self.confidence <= 1.0):
            return f"has confidence {self.confidence!r} outside 0..1"
        if self.quantiles and (
            len(self.quantiles) != len(QUANTILE_LEVELS) or list(self.quantiles) != sorted(self.quantiles)
        ):
            return f"has {len(self.quantiles)} quantiles, not {len(QUANTILE_LEVELS)} in non-decreasing order"
        return None
