"""Predictions as quantiles of the output length, learned with the pinball
(quantile) loss in log space: the median quantile minimises the absolute
error, and the others give the interval and the distribution that
:meth:`~sagellm_core.types.LifetimePrediction.remaining_tokens` conditions on
as decoding proceeds."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from sagellm_core.types import QUANTILE_LEVELS, LifetimePrediction

#: Confidence is the predicted chance of an output within this share of
#: the predicted median.
CONFIDENCE_TOLERANCE = 0.5
MEDIAN = QUANTILE_LEVELS.index(0.5)


def prediction(
    log_quantiles: Sequence[float], predictor: str, trust: float = 1.0, log_median: float | None = None
) -> LifetimePrediction:
    """A prediction from quantiles of ``log1p(output tokens)`` at
    :data:`QUANTILE_LEVELS` (sorted here, since separately learned quantiles
    may cross), moved as a whole to ``log_median`` where one is given (a
    near-duplicate prompt's reply). ``confidence`` is ``trust`` (how much
    the predictor has learned, 0..1) times the predicted chance that the
    output lies within ±50% of the predicted median."""
    log_quantiles = sorted(log_quantiles)
    if log_median is not None:
        shift = log_median - log_quantiles[MEDIAN]
        log_quantiles = [q + shift for q in log_quantiles]
    tokens = [math.expm1(max(0.0, min(20.0, q))) for q in log_quantiles]
    median = tokens[MEDIAN]
    shape = LifetimePrediction(median, tokens[0], tokens[-1], 0.0, predictor, tuple(tokens))
    near = shape.cdf(median * (1 + CONFIDENCE_TOLERANCE)) - shape.cdf(median * (1 - CONFIDENCE_TOLERANCE))
    return attrs.evolve(shape, confidence=max(0.0, min(1.0, trust)) * near)
