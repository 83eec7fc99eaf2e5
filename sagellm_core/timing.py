"""The hook timer: every checked hook call timed and its outcome counted.

The checked calls (:mod:`sagellm_core.plugin_host`) time the whole call, all
implementations of the hook, and count its outcome (answered, passed with
``None``, raised). No timing code lives in plugins.

Memory is constant: each hook keeps its call count and total time exactly,
and a uniform sample of at most ``RESERVOIR`` durations for its
percentiles, so a server that runs for days or a replay of millions of
requests holds the same few megabytes. The sample is kept by Li's
Algorithm L (seeded), which draws the gap to the next kept call instead of
a random number per call: after the first ``RESERVOIR`` calls, recording a
call is an addition and a comparison.
"""

from __future__ import annotations

import inspect
import math
import random
from array import array

import attrs

from sagellm_core import hookspecs

#: Durations kept per hook for percentiles.
RESERVOIR = 16384


@attrs.define
class HookStats:
    calls: int = 0
    answered: int = 0
    errors: int = 0
    total_s: float = 0.0
    #: A uniform sample of the calls' durations (all of them up to RESERVOIR).
    durations_s: array[float] = attrs.field(factory=lambda: array("d"))
    _rng: random.Random = attrs.field(factory=lambda: random.Random(0), repr=False)
    #: Algorithm L's state: the running weight, and the call number kept next.
    _weight: float = attrs.field(default=1.0, repr=False)
    _next_kept: int = attrs.field(default=RESERVOIR, repr=False)

    def record(self, seconds: float, answer: object) -> None:
        """One call that took ``seconds`` and answered ``answer``."""
        self.calls += 1
        # (``answer != []`` costs an attrs answer's __ne__ and __eq__ calls.)
        if answer is not None and (type(answer) is not list or answer):
            self.answered += 1
        self.total_s += seconds
        if self.calls <= RESERVOIR:
            self.durations_s.append(seconds)
            if self.calls == RESERVOIR:
                self._skip()
        elif self.calls == self._next_kept:
            self.durations_s[self._rng.randrange(RESERVOIR)] = seconds
            self._skip()

    def _skip(self) -> None:
        rng = self._rng
        self._weight *= math.exp(math.log(1.0 - rng.random()) / RESERVOIR)
        self._next_kept += int(math.log(1.0 - rng.random()) / math.log1p(-self._weight)) + 1

    def percentile_us(self, q: float) -> float:
        if not self.durations_s:
            return 0.0
        ordered = sorted(self.durations_s)
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6)

    def summary(self) -> dict[str, float]:
        return {
            "calls": self.calls,
            "answered": self.answered,
            "errors": self.errors,
            "total_ms": round(self.total_s * 1e3, 3),
            "mean_us": round(self.total_s / self.calls * 1e6, 2) if self.calls else 0.0,
            "p50_us": round(self.percentile_us(0.50), 2),
            "p99_us": round(self.percentile_us(0.99), 2),
        }


HOOK_NAMES = tuple(
    name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("sagellm_")
)


class HookTimer:
    """Per-hook statistics, one :class:`HookStats` for every hook."""

    def __init__(self) -> None:
        self.stats = {name: HookStats() for name in HOOK_NAMES}


def summarise(timer: HookTimer) -> dict[str, dict[str, float]]:
    return {name: s.summary() for name, s in timer.stats.items() if s.calls}
