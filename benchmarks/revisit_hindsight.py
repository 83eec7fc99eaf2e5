"""How far ``revisit``'s features can go: the policy trained in hindsight.

    .venv/bin/python benchmarks/revisit_hindsight.py --split all

The policy suite asks a robust policy to close a quarter of the gap between
LRU and Belady; ``revisit`` (request-aware dead-block prediction) closes 6%
to 9% online. Is the shortfall its online learning
(labels arrive late, the weights start at zero), or what its features and
its order can express at all? This runs every setting of the suite's part
twice under ``revisit``: once as shipped (online, from zero), then again
from the weights the first run ended with, on the same workload (its
conversation numbers, keys and tables are the same run to run, so every
weight means in the second run what it meant in the first). The second run
is in-sample: it knows, through its weights, how this very workload's
blocks fared. It is an upper bound for these features and this order, not
a policy (as ``belady`` is for eviction). LRU and Belady run beside them,
and the script prints, per setting and over the part, the share of the gap
closed by each.

The weights are handed over by wrapping ``RevisitEviction.__init__`` in
this process only: no plugin code or setting changes for it.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys

from sagellm_plugin_eviction import suite as suite_mod
from sagellm_plugin_eviction.revisit import RevisitEviction

from sagellm_core.replay import session

#: The weights (and bias) the next RevisitEviction starts from, or None.
WARM: dict[str, object] | None = None
#: How many RevisitEviction instances started from WARM (one per second run).
WARMED = [0]
_plain_init = RevisitEviction.__init__


def _warm_init(self, *args, **kwargs):
    _plain_init(self, *args, **kwargs)
    if WARM is not None:
        self._weights = copy.deepcopy(WARM["weights"])
        self._bias = WARM["bias"]
        WARMED[0] += 1


RevisitEviction.__init__ = _warm_init  # type: ignore[method-assign]


def run(entry, where, traces, capacity, policy):
    settings = suite_mod._settings(entry, where, traces, capacity, policy)
    result = session.run(settings, label=f"{entry['name']} {capacity} {policy}")
    return result


def main(argv: list[str] | None = None) -> int:
    global WARM
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", default="all", choices=suite_mod.SPLITS)
    parser.add_argument("--policy", default="revisit", help="revisit, with settings (revisit:demotion=2)")
    opts = parser.parse_args(argv)
    suite, where = suite_mod.read_suite(None)
    traces = suite_mod.default_traces()
    print(f"{'setting':34} {'lru':>7} {'belady':>7} {'online':>7} {'hindsight':>9}  gap closed: online, hindsight")
    closed: dict[str, list[float]] = {"online": [], "hindsight": []}
    worst = {"online": 9.0, "hindsight": 9.0}
    for entry in suite["workload"]:
        if opts.split != "all" and entry["split"] != opts.split:
            continue
        if suite_mod._missing(entry, where, traces) is not None:
            continue
        reused, largest = suite_mod.footprint(suite_mod._settings(entry, where, traces, 1, "lru"))
        for fraction in suite["fractions"]:
            capacity = max(round(reused * fraction), 2 * largest + 1)
            lru = run(entry, where, traces, capacity, "lru").report["block_hit_rate"]
            best = run(entry, where, traces, capacity, "belady").report["block_hit_rate"]
            WARM = None
            first = run(entry, where, traces, capacity, opts.policy)
            policy = first.runtime.host.plugins["eviction"][0].instance
            assert isinstance(policy, RevisitEviction), policy
            online = first.report["block_hit_rate"]
            WARM = {"weights": policy._weights, "bias": policy._bias}
            warmed = WARMED[0]
            second = run(entry, where, traces, capacity, opts.policy)
            assert WARMED[0] == warmed + 1, "the second run did not start from the first run's weights"
            WARM = None
            hindsight = second.report["block_hit_rate"]
            gap = best - lru
            shares = {
                "online": (online - lru) / gap if gap >= suite_mod.MIN_GAP else None,
                "hindsight": (hindsight - lru) / gap if gap >= suite_mod.MIN_GAP else None,
            }
            for name, rate in (("online", online), ("hindsight", hindsight)):
                if shares[name] is not None:
                    closed[name].append(shares[name])
                worst[name] = min(worst[name], rate / lru if lru else 9.0)
            fmt = lambda v: "-" if v is None else f"{100 * v:5.1f}%"  # noqa: E731
            print(
                f"{entry['name'] + ' ' + str(capacity):34} {lru:7.4f} {best:7.4f} {online:7.4f} {hindsight:9.4f}"
                f"  {fmt(shares['online'])}, {fmt(shares['hindsight'])}",
                flush=True,
            )
    for name in ("online", "hindsight"):
        print(
            f"{name}: mean gap closed {100 * statistics.fmean(closed[name]):.1f}% over {len(closed[name])} settings;"
            f" worst ratio to LRU {worst[name]:.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
