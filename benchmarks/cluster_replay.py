"""Disaggregation and routing in replay, on the Mooncake conversation trace
(``contrib/configs/mooncake-cluster.toml``: Llama-3.1-8B on H100s, 30,000
blocks of KV each, KV over 200 Gb RDMA layer by layer):

* ``pd``: colocated instances against prefill and decode instances at
  equal total GPUs (2 and 4), arrivals stretched so each GPU sees the load one GPU
  keeps up with (``mooncake-timed.toml``'s 6x, over the GPUs);
* ``routing``: KV-aware against least-loaded routing on 4 and 16 colocated
  instances, at the same per-GPU load.

Prints one Markdown table per part; every figure is the report's.

    .venv/bin/python benchmarks/cluster_replay.py pd [--max-requests N]
    .venv/bin/python benchmarks/cluster_replay.py routing [--max-requests N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sagellm_core.replay import session

CONFIG = Path(__file__).resolve().parents[1] / "contrib" / "configs" / "mooncake-cluster.toml"
#: The trace's arrivals stretched this much keep one H100 busy but not swamped.
ONE_GPU_SCALE = 6.0


def shape(colocated: int = 0, prefill: int = 0, decode: int = 0, router: str = "kv-aware") -> dict:
    gpus = colocated + prefill + decode
    return {
        ("cluster", "colocated"): colocated,
        ("cluster", "prefill"): prefill,
        ("cluster", "decode"): decode,
        ("router", "plugin"): router,
        ("workload", "time_scale"): ONE_GPU_SCALE / gpus,
    }


PARTS = {
    "pd": [
        ("2 colocated", shape(colocated=2)),
        ("1P1D", shape(prefill=1, decode=1)),
        ("4 colocated", shape(colocated=4)),
        ("2P2D", shape(prefill=2, decode=2)),
        ("3P1D", shape(prefill=3, decode=1)),
    ],
    "routing": [
        ("4, least-loaded", shape(colocated=4, router="least-loaded")),
        ("4, kv-aware", shape(colocated=4)),
        ("16, least-loaded", shape(colocated=16, router="least-loaded")),
        ("16, kv-aware", shape(colocated=16)),
    ],
}

COLUMNS = [
    ("block hit rate", lambda r: f"{r['block_hit_rate']:.4f}"),
    ("TTFT p50 (s)", lambda r: f"{r['ttft_s']['p50']:.3f}"),
    ("TTFT p99 (s)", lambda r: f"{r['ttft_s']['p99']:.3f}"),
    ("TPOT p50 (ms)", lambda r: f"{r['tpot_s']['p50'] * 1e3:.1f}"),
    ("TPOT p99 (ms)", lambda r: f"{r['tpot_s']['p99'] * 1e3:.1f}"),
    ("SLO attainment", lambda r: f"{r['cluster']['slo_attainment']:.1%}"),
    ("goodput per GPU (req/s)", lambda r: f"{r['cluster']['goodput_per_instance']:.3f}"),
    ("KV transfer mean (ms)", lambda r: f"{r['cluster']['kv_transfer_s_mean'] * 1e3:.2f}"),
    ("busy, prompt instances", lambda r: _busy(r, ("colocated", "prefill"))),
    ("busy, decode instances", lambda r: _busy(r, ("decode",))),
    ("simulated s", lambda r: f"{r['simulated_s']:,.0f}"),
]


def _busy(report: dict, roles: tuple[str, ...]) -> str:
    """The instances' mean share of the run spent in steps."""
    shares = [i["busy"] for i in report["cluster"]["instances"] if i["role"] in roles]
    return f"{sum(shares) / len(shares):.1%}" if shares else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=sorted(PARTS))
    parser.add_argument("--max-requests", type=int)
    args = parser.parse_args()
    rows = []
    for label, overrides in PARTS[args.part]:
        settings = session.load_settings(CONFIG, overrides=overrides)
        if args.max_requests:
            settings = session.config_mod.with_workload(settings, max_requests=args.max_requests)
        report = session.run(settings, label=label).report
        rows.append((label, report))
        print(f"{label}: {report['requests']:,} requests, wall {report['wall_s']:.0f} s", flush=True)
    print()
    print("| | " + " | ".join(label for label, _ in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for name, cell in COLUMNS:
        print(f"| {name} | " + " | ".join(cell(r) for _, r in rows) + " |")


if __name__ == "__main__":
    main()
