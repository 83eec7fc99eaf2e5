"""Latency of the lifetime predictors per request, at p50 and p99: one
request at a time (the ``sagellm_predict_lifetime`` hook), the requests of
one step together (``predict_batch``: one forward pass; predictors without it
answer through the hook, one call each), and the finish hook (with the
``text`` model's online update). Prints the machine's load average before and
after, since on a shared machine the tail follows the load.

    python3 benchmarks/lifetime_latency.py [--predictor text ...] [--step 8 --step 64] [--json out.json]

Needs the ShareGPT workload (``sagellm-plugin-sharegpt``), and torch for
``text`` (its weights are trained on first use, about five minutes, as in
``sagellm lifetime evaluate``). The first ``--history`` requests are
observed as finished first, so the predictors' memories are as full as in
service; then ``--requests`` requests are predicted one at a time and each
finished right after (batch 1), then ``--steps`` groups of each ``--step``
size are predicted together and finished (per step). The latency of one request in a step is the
step's time over its size. Timed with ``time.perf_counter_ns`` around the
plugin's method; pluggy's own dispatch (about 2 us) is not included.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import time

from sagellm_plugin_lifetime.evaluate import build_predictor, predict_group

from sagellm_core.config import WorkloadSettings
from sagellm_core.replay import workloads
from sagellm_core.types import RequestOutcome


def percentiles(samples_ns: list[int], scale: float = 1.0) -> dict:
    """p50, p99, mean and max in milliseconds (each sample / ``scale``)."""
    ordered = sorted(s / scale for s in samples_ns)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6  # noqa: E731
    return {
        "p50_ms": round(pick(0.5), 4),
        "p99_ms": round(pick(0.99), 4),
        "mean_ms": round(statistics.fmean(ordered) / 1e6, 4),
        "max_ms": round(ordered[-1] / 1e6, 4),
        "samples": len(ordered),
    }


def _finish(predictor, request, prediction, finish_ns: list[int]) -> None:
    outcome = RequestOutcome(request, request.output_tokens, 0, 0.0, 0.0, 1.0, 0, prediction)
    start = time.perf_counter_ns()
    predictor.sagellm_request_finished(outcome=outcome)
    finish_ns.append(time.perf_counter_ns() - start)


def measure(name: str, requests: list, history: int, count: int, steps: list[int], step_count: int) -> dict:
    workload = WorkloadSettings(source="sharegpt")
    start = time.perf_counter()
    predictor = build_predictor(name, workload)
    load_s = time.perf_counter() - start
    warm, rest = requests[:history], iter(requests[history:])
    for request in warm:
        predictor.sagellm_request_finished(
            outcome=RequestOutcome(request, request.output_tokens, 0, 0.0, 0.0, 1.0, 0, None)
        )
    row: dict = {"predictor": name, "load_s": round(load_s, 2)}
    # Batch 1: the hook, one request at a time, each finished right after.
    one_ns: list[int] = []
    finish_ns: list[int] = []
    for i, request in enumerate(itertools.islice(rest, count)):
        start = time.perf_counter_ns()
        prediction = predictor.sagellm_predict_lifetime(request=request)
        one_ns.append(time.perf_counter_ns() - start)
        if i == 0:
            row["first_call_ms"] = round(one_ns[0] / 1e6, 3)
        _finish(predictor, request, prediction, finish_ns)
    row["batch1"] = percentiles(one_ns)
    # Per step: the requests of one step predicted together, then finished.
    for size in steps:
        step_ns: list[int] = []
        sizes: list[int] = []
        for _ in range(step_count):
            group = list(itertools.islice(rest, size))
            if not group:
                break
            start = time.perf_counter_ns()
            predictions = predict_group(predictor, group)
            step_ns.append(time.perf_counter_ns() - start)
            sizes.append(len(group))
            for request, prediction in zip(group, predictions):
                _finish(predictor, request, prediction, finish_ns)
        per_request = [t / n for t, n in zip(step_ns, sizes)]
        row[f"step{size}"] = {"per_request": percentiles(per_request), "per_step": percentiles(step_ns)}
    row["finish"] = percentiles(finish_ns)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--predictor", action="append", help="a sagellm.lifetime plugin (default: stat, online, text)")
    parser.add_argument("--history", type=int, default=20_000, help="requests observed as finished first")
    parser.add_argument("--requests", type=int, default=2_000, help="requests timed one at a time, and per step size")
    parser.add_argument("--step", type=int, action="append", help="requests in one step (default: 8 and 64)")
    parser.add_argument("--steps", type=int, default=200, help="steps timed per step size")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    parser.add_argument("--json", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    names = args.predictor or ["stat", "online", "text"]
    steps = args.step or [8, 64]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    needed = args.history + args.requests + args.steps * sum(steps)
    requests = list(workloads.load(WorkloadSettings(source="sharegpt", max_requests=needed)))
    before = os.getloadavg()
    print(f"load average before: {before[0]:.2f} {before[1]:.2f} {before[2]:.2f} ({os.cpu_count()} CPUs)")
    rows = []
    for name in names:
        gc.collect()
        row = measure(name, requests, args.history, args.requests, steps, args.steps)
        row["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        rows.append(row)
        print(f"\n{name}: loaded in {row['load_s']} s, first call {row.get('first_call_ms')} ms")
        print(f"  {'':32} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9} {'max ms':>9}")
        lines = [("predict, batch 1 (per request)", row["batch1"])]
        for size in steps:
            lines.append((f"predict, step of {size} (per request)", row[f"step{size}"]["per_request"]))
            lines.append((f"predict, step of {size} (per step)", row[f"step{size}"]["per_step"]))
        lines.append(("finish hook", row["finish"]))
        for label, p in lines:
            print(f"  {label:32} {p['p50_ms']:9.4f} {p['p99_ms']:9.4f} {p['mean_ms']:9.4f} {p['max_ms']:9.4f}")
        print(f"  load average after: {' '.join(f'{x:.2f}' for x in row['loadavg_after'])}")
    try:
        import torch

        threads = torch.get_num_threads()
    except ImportError:
        threads = None
    summary = {"loadavg_before": [round(x, 2) for x in before], "torch_threads": threads, "rows": rows}
    print(f"\ntorch threads: {threads}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
