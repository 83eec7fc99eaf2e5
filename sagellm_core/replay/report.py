"""The replay report: one flat dict of figures, printed as a rich table and
written as JSON and Markdown, with plots of hit rate and memory over time."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sagellm_core.drivers.recorder import Recorder
from sagellm_core.runtime import Runtime
from sagellm_core.timing import summarise


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """Mean, nearest-rank p50, p95 and p99, and max (rounded to the µs)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

    return {
        "mean": round(sum(ordered) / len(ordered), 6),
        "p50": round(q(0.50), 6),
        "p95": round(q(0.95), 6),
        "p99": round(q(0.99), 6),
        "max": round(ordered[-1], 6),
    }


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index (Σx)² / (n·Σx²): 1 when all equal, 1/n when one
    value holds everything; ``None`` when undefined (no values, all zero)."""
    square_sum = sum(x * x for x in values)
    if not values or square_sum == 0:
        return None
    return sum(values) ** 2 / (len(values) * square_sum)


def build(
    rt: Runtime, recorder: Recorder, mode: str, wall_s: float, label: str, read: int | None = None
) -> dict[str, Any]:
    c = rt.counters if recorder.counters is None else recorder.counters
    sim = recorder.simulated_s
    span = sim - (recorder.first_arrival_s if recorder.finished else 0.0)
    output_tokens = recorder.output_tokens
    timed = mode == "timed"
    return {
        "label": label,
        "config": rt.settings.path,
        "mode": mode,
        "workload": rt.settings.workload.path or "generator",
        "plugins": {
            section: ", ".join(p.selection.name for p in loaded) for section, loaded in rt.host.plugins.items()
        },
        "block_size": rt.block_size,
        "num_blocks": rt.num_blocks,
        "plugin_distributions": {
            section: ", ".join(f"{p.info.distribution} {p.info.version}" for p in loaded)
            for section, loaded in rt.host.plugins.items()
        },
        #: Requests the workload yielded: each is finished or rejected.
        "requests_read": c.requests_finished + c.requests_rejected if read is None else read,
        "requests": c.requests_finished,
        "rejected": c.requests_rejected,
        "rejections": dict(sorted(c.rejections.items())),
        #: The admission decision's deferrals (a request each step it was deferred) and rejections.
        "admission": {
            "deferrals": c.admission_deferrals,
            "rejections": c.admission_rejections,
            "tenant_deferrals": dict(sorted(c.tenant_deferrals.items())),
        },
        #: A compacting pool's rounds and the cached blocks they moved.
        "compaction": {"rounds": c.compactions, "moved_blocks": c.moved_blocks},
        #: The plugins' own figures (``sagellm_report_figures``), by the name each gives.
        "plugin_figures": rt.host.plugin_figures(),
        "block_hit_rate": round(c.hit_blocks / c.query_blocks, 6) if c.query_blocks else 0.0,
        "token_hit_rate": round(c.hit_tokens / c.query_tokens, 6) if c.query_tokens else 0.0,
        "hit_blocks": c.hit_blocks,
        "query_blocks": c.query_blocks,
        "host_hit_blocks": c.host_hit_blocks,
        "host_hit_rate": round(c.host_hit_blocks / c.query_blocks, 6) if c.query_blocks else 0.0,
        "tokens_saved": c.hit_tokens,
        "lost_waiting_blocks": c.lost_waiting_blocks,
        "prefill_compute_saved": _compute_saved(c, recorder.prefill_flops),
        "prefill_tokens": c.prefill_tokens,
        "reprefill_tokens": c.reprefill_tokens,
        "reprefill_rate": round(c.reprefill_tokens / (c.prefill_tokens + c.reprefill_tokens), 6)
        if c.prefill_tokens + c.reprefill_tokens
        else 0.0,
        "tenant_block_hit_rates": {t: round(h / q, 6) for t, (q, h) in sorted(c.tenant_blocks.items()) if q},
        "jain_fairness": _round(jain_index([h / q for q, h in c.tenant_blocks.values() if q])),
        "evicted_blocks": c.evicted_blocks,
        "preemptions": c.preemptions,
        "pool_utilisation_mean": round(recorder.used_block_sum / recorder.used_block_samples / rt.num_blocks, 4)
        if recorder.used_block_samples
        else 0.0,
        "pool_utilisation_peak": round(recorder.used_block_peak / rt.num_blocks, 4),
        "pool_fragmentation_mean": round(recorder.fragmentation_sum / recorder.used_block_samples, 4)
        if recorder.used_block_samples
        else 0.0,
        "ttft_s": percentiles(recorder.ttft_s) if timed else None,
        "tenant_ttft_s": {t: percentiles(v) for t, v in sorted(recorder.tenant_ttft_s.items())} if timed else None,
        "tpot_s": percentiles(recorder.tpot_s) if timed else None,
        "e2e_s": percentiles(recorder.e2e_s) if timed else None,
        "slo_attainment": round(recorder.deadlines_met / recorder.deadlines, 6)
        if timed and recorder.deadlines
        else None,
        "throughput_tokens_per_s": round(output_tokens / span, 2) if timed and span > 0 else None,
        "throughput_requests_per_s": round(recorder.finished / span, 4) if timed and span > 0 else None,
        "steps": recorder.steps,
        "mean_batch_tokens": round(recorder.batched_tokens / recorder.steps, 1) if recorder.steps else None,
        "simulated_s": round(sim, 3),
        "wall_s": round(wall_s, 3),
        "lifetime_mae": round(c.lifetime_abs_error / c.lifetime_predictions, 2) if c.lifetime_predictions else None,
        "lifetime_fallbacks": c.lifetime_fallbacks,
        "lifetime_failure": c.lifetime_failure,
        "transfers": {
            "count": c.transfers,
            "failures": c.transfer_failures,
            "blocks": c.transferred_blocks,
            "bytes": c.transferred_bytes,
            "bytes_per_s": round(c.transferred_bytes / c.transfer_s) if c.transfer_s > 0 else None,
        },
        #: Per KV store: what it was offered and wrote, read back, failed its check.
        "kv_stores": rt.stores.report(),
        "hooks": summarise(rt.timer) if rt.timer else {},
        **({"cluster": recorder.cluster} if recorder.cluster is not None else {}),
    }


def _compute_saved(c, prefill_flops: tuple[float, float] | None) -> float | None:
    """The share of the prompts' prefill FLOPs that device-cache hits saved:
    FLOPs per token times tokens, plus FLOPs per causal token pair times
    pairs (attention), both for the hits over both for the prompts."""
    if prefill_flops is None or not c.query_tokens:
        return None
    per_token, per_pair = prefill_flops
    total = per_token * c.query_tokens + per_pair * c.query_token_pairs
    return round((per_token * c.hit_tokens + per_pair * c.hit_token_pairs) / total, 6)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


# (key, label, format) of the figures shown in tables, in order.
ROWS: list[tuple[str, str, str]] = [
    ("requests", "requests", "{:,}"),
    ("rejected", "rejected", "{:,}"),
    ("block_hit_rate", "block hit rate", "{:.4f}"),
    ("hit_blocks", "hit blocks", "{:,}"),
    ("query_blocks", "query blocks", "{:,}"),
    ("token_hit_rate", "token hit rate", "{:.4f}"),
    ("host_hit_rate", "host-tier hit rate", "{:.4f}"),
    ("tokens_saved", "tokens saved", "{:,}"),
    ("lost_waiting_blocks", "hits lost while waiting (blocks)", "{:,}"),
    ("prefill_compute_saved", "prefill compute saved", "{:.4f}"),
    ("prefill_tokens", "prefill tokens", "{:,}"),
    ("reprefill_tokens", "re-prefill tokens", "{:,}"),
    ("reprefill_rate", "re-prefill rate", "{:.4f}"),
    ("jain_fairness", "Jain's fairness (tenant hit rates)", "{:.4f}"),
    ("evicted_blocks", "evicted blocks", "{:,}"),
    ("preemptions", "preemptions", "{:,}"),
    ("admission.deferrals", "admission deferrals", "{:,}"),
    ("compaction.moved_blocks", "blocks moved by compaction", "{:,}"),
    ("pool_utilisation_mean", "pool utilisation (mean)", "{:.1%}"),
    ("pool_utilisation_peak", "pool utilisation (peak)", "{:.1%}"),
    ("pool_fragmentation_mean", "free-list fragmentation (mean)", "{:.3f}"),
    ("ttft_s.p50", "TTFT p50 (s)", "{:.3f}"),
    ("ttft_s.p95", "TTFT p95 (s)", "{:.3f}"),
    ("ttft_s.p99", "TTFT p99 (s)", "{:.3f}"),
    ("ttft_s.max", "TTFT max: longest wait (s)", "{:.3f}"),
    ("ttft_s.mean", "TTFT mean (s)", "{:.3f}"),
    ("slo_attainment", "TTFT deadlines met", "{:.1%}"),
    ("e2e_s.mean", "end-to-end mean (s)", "{:.3f}"),
    ("e2e_s.p99", "end-to-end p99 (s)", "{:.3f}"),
    ("tpot_s.p50", "TPOT p50 (ms)", "ms"),
    ("tpot_s.p95", "TPOT p95 (ms)", "ms"),
    ("tpot_s.p99", "TPOT p99 (ms)", "ms"),
    ("throughput_tokens_per_s", "throughput (output tok/s)", "{:,.0f}"),
    ("throughput_requests_per_s", "throughput (req/s)", "{:.3f}"),
    ("mean_batch_tokens", "mean batch (tokens)", "{:,.0f}"),
    ("simulated_s", "simulated time (s)", "{:,.1f}"),
    ("lifetime_mae", "lifetime MAE (tokens)", "{:.1f}"),
    ("lifetime_fallbacks", "lifetime fallbacks", "{:,}"),
    ("transfers.count", "KV transfers", "{:,}"),
    ("transfers.bytes", "KV bytes moved", "{:,}"),
    ("transfers.bypassed_blocks", "evicted blocks not offloaded (tier bypassed)", "{:,}"),
    ("wall_s", "wall time (s)", "{:.2f}"),
]


# A cluster's figures (``cluster`` in a report), and its per-instance rows.
CLUSTER_ROWS: list[tuple[str, str, str]] = [
    ("cluster.router", "router", "{}"),
    ("cluster.slo_attainment", "SLO attainment (TTFT and TPOT)", "{:.1%}"),
    ("cluster.ttft_attainment", "TTFT SLO attainment", "{:.1%}"),
    ("cluster.tpot_attainment", "TPOT SLO attainment", "{:.1%}"),
    ("cluster.goodput_requests_per_s", "goodput (req/s within SLO)", "{:.3f}"),
    ("cluster.goodput_per_instance", "goodput per instance (req/s)", "{:.3f}"),
    ("cluster.kv_transfers", "KV handed to decode", "{:,}"),
    ("cluster.kv_bytes", "KV bytes handed to decode", "{:,}"),
    ("cluster.kv_transfer_s_mean", "KV transfer mean (ms)", "ms"),
    ("cluster.routing.cached", "routed with the prompt cached somewhere", "{:,}"),
    ("cluster.routing.degraded", "routed with a degraded index", "{:,}"),
    ("cluster.events.gaps", "KV event gaps", "{:,}"),
]
INSTANCE_COLUMNS: list[tuple[str, str, str]] = [
    ("instance", "instance", "{}"),
    ("role", "role", "{}"),
    ("requests", "requests", "{:,}"),
    ("block_hit_rate", "block hit rate", "{:.4f}"),
    ("prefill_tokens", "prefill tokens", "{:,}"),
    ("preemptions", "preemptions", "{:,}"),
    ("busy", "busy", "{:.1%}"),
    ("pool_utilisation_mean", "pool used (mean)", "{:.1%}"),
    ("kv_blocks", "KV blocks moved", "{:,}"),
]


def instance_rows(report: dict) -> list[list[str]]:
    return [[_fmt(row.get(key), fmt) for key, _, fmt in INSTANCE_COLUMNS] for row in report["cluster"]["instances"]]


def _get(report: dict, key: str) -> Any:
    value: Any = report
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "ms":
        return f"{value * 1e3:.2f}"
    return fmt.format(value)


def figure_rows(reports: Sequence[dict]) -> list[list[str]]:
    return [[label, *(_fmt(_get(r, key), fmt) for r in reports)] for key, label, fmt in ROWS]


def hook_rows(report: dict) -> list[list[str]]:
    return [
        [
            name.removeprefix("sagellm_"),
            f"{s['calls']:,}",
            f"{s['answered']:,}",
            f"{s['mean_us']:.2f}",
            f"{s['p50_us']:.2f}",
            f"{s['p99_us']:.2f}",
        ]
        for name, s in sorted(report["hooks"].items(), key=lambda kv: -kv[1]["calls"])
    ]


HOOK_HEADER = ["hook", "calls", "answered", "mean µs", "p50 µs", "p99 µs"]

STORE_HEADER = [
    "run",
    "KV store",
    "hit rate",
    "blocks loaded",
    "loads",
    "recomputed (slower to load)",
    "prefetches / late",
    "prefetched blocks wasted",
    "corrupt",
    "load s (modelled)",
]


def store_rows(reports: Sequence[dict]) -> list[list[str]]:
    """Per run and KV store: its hits (blocks loaded, as a share of the
    prompts' blocks), loads, recomputes and prefetches."""
    rows = []
    for r in reports:
        for name, s in r.get("kv_stores", {}).items():
            rate = s["loaded_blocks"] / r["query_blocks"] if r["query_blocks"] else 0.0
            rows.append(
                [
                    r["label"],
                    name,
                    f"{rate:.4f}",
                    f"{s['loaded_blocks']:,}",
                    f"{s['get_rounds']:,}",
                    f"{s['recomputed_blocks']:,}",
                    f"{s['prefetch_rounds']:,} / {s['late_prefetches']:,}",
                    f"{s['wasted_prefetched_blocks']:,}",
                    f"{s['corrupt_blocks']:,}",
                    f"{s['load_s']:.3f}",
                ]
            )
    return rows


def print_reports(reports: Sequence[dict], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="sagellm replay", show_lines=False)
    table.add_column("figure")
    for r in reports:
        table.add_column(r["label"], justify="right")
    for row in figure_rows(reports):
        table.add_row(*row)
    console.print(table)
    clusters = [r for r in reports if "cluster" in r]
    if clusters:
        summary = Table(title="cluster")
        summary.add_column("figure")
        for r in clusters:
            summary.add_column(r["label"], justify="right")
        for key, label, fmt in CLUSTER_ROWS:
            summary.add_row(label, *(_fmt(_get(r, key), fmt) for r in clusters))
        console.print(summary)
        for r in clusters:
            instances = Table(title=f"{r['label']}: instances")
            for i, (_, label, _) in enumerate(INSTANCE_COLUMNS):
                instances.add_column(label, justify="left" if i < 2 else "right")
            for row in instance_rows(r):
                instances.add_row(*row)
            console.print(instances)
    if rows := store_rows(reports):
        stores = Table(title="KV stores below the device pool")
        for i, h in enumerate(STORE_HEADER):
            stores.add_column(h, justify="left" if i < 2 else "right")
        for row in rows:
            stores.add_row(*row)
        console.print(stores)
    for r in reports:
        if r.get("lifetime_failure"):
            console.print(
                f"[yellow]{r['label']}: {r['lifetime_fallbacks']:,} predictions by the fallback;"
                f" first failure: {r['lifetime_failure']}"
            )
    if len(reports) == 1 and reports[0]["hooks"]:
        hooks = Table(title="hook calls (timed by the hook dispatch)")
        for i, h in enumerate(HOOK_HEADER):
            hooks.add_column(h, justify="left" if i == 0 else "right")
        for row in hook_rows(reports[0]):
            hooks.add_row(*row)
        console.print(hooks)


def markdown(reports: Sequence[dict]) -> str:
    lines = ["| figure | " + " | ".join(r["label"] for r in reports) + " |"]
    lines.append("|---|" + "---:|" * len(reports))
    lines += ["| " + " | ".join(row) + " |" for row in figure_rows(reports)]
    for r in (r for r in reports if "cluster" in r):
        lines += ["", "| " + " | ".join(label for _, label, _ in INSTANCE_COLUMNS) + " |"]
        lines += ["|---|---|" + "---:|" * (len(INSTANCE_COLUMNS) - 2)]
        lines += ["| " + " | ".join(row) + " |" for row in instance_rows(r)]
    if rows := store_rows(reports):
        lines += ["", "| " + " | ".join(STORE_HEADER) + " |", "|---|---|" + "---:|" * (len(STORE_HEADER) - 2)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    if len(reports) == 1 and reports[0]["hooks"]:
        lines += ["", "| " + " | ".join(HOOK_HEADER) + " |", "|---|" + "---:|" * (len(HOOK_HEADER) - 1)]
        lines += ["| " + " | ".join(row) + " |" for row in hook_rows(reports[0])]
    return "\n".join(lines) + "\n"


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by ``None``:
    a report is strict JSON (no ``NaN``, no ``Infinity``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_json(reports: Sequence[dict], path: str | Path) -> None:
    data = reports[0] if len(reports) == 1 else list(reports)
    Path(path).write_text(json.dumps(finite(data), indent=2, allow_nan=False) + "\n")


def plot(reports: Sequence[dict], timelines: Sequence[list], path: str | Path) -> None:
    """Hit rate and memory use over (simulated) time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for report, timeline in zip(reports, timelines):
        if not timeline:
            continue
        t = [p[0] for p in timeline]
        top.plot(t, [p[1] for p in timeline], label=report["label"])
        bottom.plot(t, [p[2] / report["num_blocks"] for p in timeline], label=f"{report['label']} used")
        bottom.plot(
            t, [p[3] / report["num_blocks"] for p in timeline], linestyle="--", label=f"{report['label']} cached"
        )
    top.set_ylabel("cumulative block hit rate")
    bottom.set_ylabel("share of pool")
    bottom.set_xlabel("time (s, simulated)")
    top.legend(fontsize="small")
    bottom.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _sweep_rows(runs, values, figure: str) -> tuple[list[str], list[list[str]]]:
    labels = list(dict.fromkeys(label for label, _, _ in runs))
    # Keyed by repr: a swept value may be a list (scheduler.passes).
    cell = {(label, repr(value)): _get(r.report, figure) for label, value, r in runs}
    rows = []
    for label in labels:
        figures = [cell.get((label, repr(v))) for v in values]
        rows.append([label, *(_fmt(f, "{:.4f}" if isinstance(f, float) else "{}") for f in figures)])
    return labels, rows


def sweep_table(runs, name: str, values, figure: str) -> Table:
    table = Table(title=f"{figure} by {name}")
    table.add_column("config")
    for v in values:
        table.add_column(str(v), justify="right")
    for row in _sweep_rows(runs, values, figure)[1]:
        table.add_row(*row)
    return table


def sweep_markdown(runs, name: str, values, figure: str) -> str:
    lines = [f"| {figure} \\ {name} | " + " | ".join(str(v) for v in values) + " |", "|---|" + "---:|" * len(values)]
    lines += ["| " + " | ".join(row) + " |" for row in _sweep_rows(runs, values, figure)[1]]
    return "\n".join(lines) + "\n"


def plot_sweep(runs, name: str, values, figure: str, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    numeric = all(isinstance(v, (int, float)) for v in values)
    for label in dict.fromkeys(label for label, _, _ in runs):
        points = [(v, _get(r.report, figure)) for lab, v, r in runs if lab == label]
        xs = [p[0] for p in points] if numeric else list(range(len(points)))
        ax.plot(xs, [p[1] for p in points], marker="o", label=label)
    if numeric and min(values) > 0 and max(values) / min(values) >= 10:
        ax.set_xscale("log")
        ax.minorticks_off()
    ax.set_xticks(values if numeric else range(len(values)), [f"{v:,}" if numeric else str(v) for v in values])
    ax.set_xlabel(name)
    ax.set_ylabel(figure)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
