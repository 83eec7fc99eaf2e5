"""Observability from pluggy itself: a wrapper plugin around every hook.

``HookTimer`` is generated from the hookspecs: one ``wrapper=True`` impl per
hook, which times the whole call (all implementations) and counts outcomes
(answered, passed with ``None``, raised). No timing code lives in plugins.
"""

from __future__ import annotations

import inspect
import time
from array import array

import attrs

from sagellm_core import hookspecs
from sagellm_core.hookspecs import hookimpl


@attrs.define
class HookStats:
    calls: int = 0
    answered: int = 0
    errors: int = 0
    durations_s: array = attrs.field(factory=lambda: array("d"))

    def percentile_us(self, q: float) -> float:
        if not self.durations_s:
            return 0.0
        ordered = sorted(self.durations_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6

    @property
    def total_s(self) -> float:
        return sum(self.durations_s)

    def summary(self) -> dict:
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
    name
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
    if name.startswith("sagellm_")
)


def _make_wrapper(name: str):
    def wrapper(self):
        stats = self.stats[name]
        stats.calls += 1
        start = time.perf_counter()
        try:
            result = yield
        except BaseException:
            stats.errors += 1
            stats.durations_s.append(time.perf_counter() - start)
            raise
        stats.durations_s.append(time.perf_counter() - start)
        if result is not None and result != []:
            stats.answered += 1
        return result

    wrapper.__name__ = name
    return hookimpl(wrapper=True, tryfirst=True)(wrapper)


def _init(self) -> None:
    self.stats = {name: HookStats() for name in HOOK_NAMES}


HookTimer = type(
    "HookTimer",
    (),
    {"__init__": _init, "__doc__": __doc__, **{n: _make_wrapper(n) for n in HOOK_NAMES}},
)


def summarise(timer) -> dict[str, dict]:
    return {name: s.summary() for name, s in timer.stats.items() if s.calls}
