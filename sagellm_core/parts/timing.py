"""Observability from pluggy itself: a wrapper plugin around every hook.

``HookTimer`` is generated from the hookspecs: one ``wrapper=True`` impl per
hook, which times the whole call (all implementations) and counts outcomes
(answered, passed with ``None``, raised). No timing code lives in plugins.

Memory is constant: each hook keeps its call count and total time exactly,
and a uniform sample of at most ``RESERVOIR`` durations (reservoir sampling,
seeded) for its percentiles, so a server that runs for days or a replay of
millions of requests holds the same few megabytes.
"""

from __future__ import annotations

import inspect
import random
import time
from array import array
from collections.abc import Callable, Generator
from typing import Any

import attrs

from sagellm_core import hookspecs
from sagellm_core.hookspecs import hookimpl

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

    def add(self, seconds: float) -> None:
        self.total_s += seconds
        if len(self.durations_s) < RESERVOIR:
            self.durations_s.append(seconds)
            return
        slot = self._rng.randrange(self.calls)  # calls already counts this one
        if slot < RESERVOIR:
            self.durations_s[slot] = seconds

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


def _make_wrapper(name: str) -> Callable[..., Any]:
    def wrapper(self: Any) -> Generator[None, Any, Any]:
        stats = self.stats[name]
        stats.calls += 1
        start = time.perf_counter()
        try:
            result = yield
        except BaseException:
            stats.errors += 1
            stats.add(time.perf_counter() - start)
            raise
        stats.add(time.perf_counter() - start)
        if result is not None and result != []:
            stats.answered += 1
        return result

    wrapper.__name__ = name
    return hookimpl(wrapper=True, tryfirst=True)(wrapper)


def _init(self: Any) -> None:
    self.stats = {name: HookStats() for name in HOOK_NAMES}


class HookTimer:
    """A pluggy wrapper plugin with one timing wrapper per hook (set below)."""

    stats: dict[str, HookStats]

    __init__ = _init


for _name in HOOK_NAMES:
    setattr(HookTimer, _name, _make_wrapper(_name))


def summarise(timer: HookTimer) -> dict[str, dict[str, float]]:
    return {name: s.summary() for name, s in timer.stats.items() if s.calls}
