"""Age bins on a log scale, shared by the policies that learn from the ages
at which blocks are reused (``predictive``'s hit and eviction histograms,
``continuation``'s gaps between turns)."""

from __future__ import annotations

import math

#: Age bins: bin b holds ages up to ``AGE_UNIT_S * (2 ** (b / 2) - 1)``.
AGE_BINS = 48
AGE_UNIT_S = 0.05


def age_bin(age_s: float) -> int:
    return min(AGE_BINS - 1, int(2.0 * math.log2(1.0 + max(0.0, age_s) / AGE_UNIT_S)))


def bin_age(b: int) -> float:
    """The middle of bin ``b``, in seconds."""
    return AGE_UNIT_S * (2.0 ** ((b + 0.5) / 2.0) - 1.0)
