"""What loading a KV store's blocks costs against recomputing them, as the
torch engine measures it (``sagellm_core.types.LoadCosts``): with
``[kv_stores] load_or_recompute`` (the default) the runtime loads a run of
blocks from a store only where its expected load time is below the
expected time to compute its tokens.

* A store's load: latency plus a time per block, fitted to the engine's
  last loads from that store, each timed by the runtime from the store's
  read to the blocks' copy into the pool, their checksums checked on the
  way (:meth:`MeasuredCosts.loaded`). The fit is Theil-Sen's (the median of
  the slopes between pairs of loads, the median intercept): one load
  stalled by the machine moves it little. Before its first load a store's
  cost is unknown, and the load is taken: it is how the store is measured.
  A store asked about ``remeasure_after`` times since its last load
  (every run lost to recompute) is loaded from once more, so that one slow
  read (a cold disk) does not rule it out for good.
* Recompute: the seconds per token of the engine's last steps with a
  prompt chunk (a step's time over the tokens it computed), the median
  token's: each step weighs as many tokens as it computed, so a few steps
  of three tokens, whose fixed overhead makes each token dear, do not set
  the price of a 2,000-token prefill. The overhead left in it leans
  towards loading. Linear in tokens: the attention's share that grows
  with the cached context is not modelled.
  Before the first prefill step it is unknown, and every run is loaded.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from statistics import median

from attrs import define, field

#: Loads kept per store, and prefill steps kept.
LOAD_WINDOW, STEP_WINDOW = 16, 32


def weighted_median(values: Iterable[tuple[float, int]]) -> float:
    """The value at which half the total weight of ``(value, weight)`` pairs lies below."""
    ordered = sorted(values)
    half, below = sum(w for _, w in ordered) / 2, 0
    for value, weight in ordered:
        below += weight
        if below >= half:
            return value
    raise ValueError("no weight")


@define
class LinearFit:
    """``seconds = fixed_s + per_unit_s * units``, fitted to observations."""

    fixed_s: float = 0.0
    per_unit_s: float = 0.0

    @classmethod
    def of(cls, points: Sequence[tuple[int, float]]) -> LinearFit:
        """Theil-Sen over ``(units, seconds)`` points (units > 0), both
        coefficients kept non-negative; with one size of observation, all
        per unit."""
        slopes = [(sj - si) / (uj - ui) for i, (ui, si) in enumerate(points) for uj, sj in points[i + 1 :] if uj != ui]
        if not slopes:
            return cls(0.0, median([s / u for u, s in points]))
        slope = max(0.0, median(slopes))
        return cls(max(0.0, median([s - slope * u for u, s in points])), slope)

    def at(self, units: int) -> float:
        return self.fixed_s + self.per_unit_s * units


@define
class MeasuredCosts:
    """The torch engine's :class:`~sagellm_core.types.LoadCosts`."""

    #: Asks about a store since its last load past which it is loaded from again.
    remeasure_after: int = 64
    #: Loads take their own time: a prefetch is ready when its copy is done.
    simulated = False
    _loads: dict[str, deque[tuple[int, float]]] = field(factory=dict)
    _load_fits: dict[str, LinearFit] = field(factory=dict)
    _asks: dict[str, int] = field(factory=dict)
    _steps: deque[tuple[float, int]] = field(factory=lambda: deque(maxlen=STEP_WINDOW))
    _token_s: float | None = None

    def load_s(self, tier: str, num_blocks: int) -> float:
        fit = self._load_fits.get(tier)
        if fit is None:
            return 0.0  # not measured: load it, and measure it
        asks = self._asks[tier] = self._asks[tier] + 1
        if asks > self.remeasure_after:
            return 0.0  # not measured lately: the same
        return fit.at(num_blocks)

    def recompute_s(self, num_tokens: int, num_cached_tokens: int) -> float:
        if self._token_s is None:
            return math.inf  # not measured yet: every run is loaded
        return self._token_s * num_tokens

    def loaded(self, tier: str, num_blocks: int, seconds: float) -> None:
        points = self._loads.setdefault(tier, deque(maxlen=LOAD_WINDOW))
        points.append((num_blocks, seconds))
        self._load_fits[tier] = LinearFit.of(list(points))
        self._asks[tier] = 0

    def prefilled(self, num_tokens: int, seconds: float) -> None:
        """A step that computed ``num_tokens`` tokens, a prompt chunk among
        them, took ``seconds`` (the model's run, synchronised)."""
        if num_tokens > 0:
            self._steps.append((seconds / num_tokens, num_tokens))
            self._token_s = weighted_median(self._steps)

    def figures(self) -> dict[str, float]:
        """The current estimates: each store's latency and seconds a block,
        the seconds a recomputed token (for reports and benchmarks)."""
        out = {f"{tier} latency_s": fit.fixed_s for tier, fit in self._load_fits.items()}
        out.update({f"{tier} block_s": fit.per_unit_s for tier, fit in self._load_fits.items()})
        if self._token_s is not None:
            out["token_s"] = self._token_s
        return out
