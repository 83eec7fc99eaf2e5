"""KV stores below the device pool in a timed replay of the Mooncake
conversation trace (Llama-3.1-8B on an H100, 512-token blocks as the
trace's own, 10,000 device blocks): the hit rate of each tier and TTFT,
against the device alone and an infinite device; prefetch on against off;
load-or-recompute against always loading, with a slow tier.

    .venv/bin/python benchmarks/tiers_replay.py [--max-requests N] [--json F]

Every row runs in this process, one after another, on the same workload;
the disk store of each row writes to a fresh folder. Time is the replay's
model (``[engine] tier_links``: ``pcie`` for host memory, ``nvme`` for the
disk, ``network`` for a slow tier), so TTFT includes the loads' modelled time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.replay import session

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "mooncake_conversation.jsonl"
BASE = """
[engine]
name = "replay"
mode = "timed"
hardware = "h100"
model = "llama-3.1-8b"
max_num_batched_tokens = 16384
max_num_seqs = 64
{links}
[workload]
source = "mooncake"
path = "{trace}"
trace_block_tokens = 512
time_scale = {time_scale}
max_requests = {max_requests}
[prefix_cache]
plugin = "radix"
block_size = 512
[kv_pool]
plugin = "paged"
num_blocks = {blocks}
[eviction]
plugin = "lru"
[scheduler]
passes = ["fcfs"]
[report]
hook_timing = false
"""
STORES = """
[kv_stores]
tiers = {tiers}
bytes_per_block = 64
load_or_recompute = {weigh}
prefetch = {prefetch}
prefetch_timeout_s = 30.0
[kv_stores.host]
capacity_blocks = 20000
[kv_stores.disk]
path = "{disk}"
capacity_blocks = 100000
"""

#: (row, device blocks, tiers, links, load-or-recompute, prefetch)
ROWS = [
    ("device only", 10_000, (), {}, True, False),
    ("infinite device", 1_000_000, (), {}, True, False),
    ("host (pcie) + disk (nvme)", 10_000, ("host", "disk"), {"host": "pcie", "disk": "nvme"}, True, False),
    ("host + disk, prefetch", 10_000, ("host", "disk"), {"host": "pcie", "disk": "nvme"}, True, True),
    ("disk over the network, load or recompute", 10_000, ("disk",), {"disk": "network"}, True, False),
    ("disk over the network, always load", 10_000, ("disk",), {"disk": "network"}, False, False),
]


def run(row, max_requests: int, time_scale: float) -> dict:
    name, blocks, tiers, links, weigh, prefetch = row
    with tempfile.TemporaryDirectory() as disk:
        text = BASE.format(
            links=f"tier_links = {{ {', '.join(f'{t} = {json.dumps(v)}' for t, v in links.items())} }}"
            if links
            else "",
            trace=TRACE,
            time_scale=time_scale,
            max_requests=max_requests,
            blocks=blocks,
        )
        if tiers:
            text += STORES.format(
                tiers=json.dumps(list(tiers)), weigh=str(weigh).lower(), prefetch=str(prefetch).lower(), disk=disk
            )
            if "disk" not in tiers:
                text = text[: text.index("[kv_stores.disk]")]
            if "host" not in tiers:
                text = text.replace("[kv_stores.host]\ncapacity_blocks = 20000\n", "")
        report = session.run(settings_from_toml(text, f"<{name}>")).report
    check(row, report)
    stores = report["kv_stores"]
    return {
        "row": name,
        "block_hit_rate": report["block_hit_rate"],
        "tiers": {t: round(s["loaded_blocks"] / report["query_blocks"], 4) for t, s in stores.items()},
        "recomputed": {t: s["recomputed_blocks"] for t, s in stores.items()},
        "prefetch": {
            t: (s["prefetch_rounds"], s["late_prefetches"], s["wasted_prefetched_blocks"]) for t, s in stores.items()
        },
        "ttft_mean_s": report["ttft_s"]["mean"],
        "ttft_p50_s": report["ttft_s"]["p50"],
        "ttft_p99_s": report["ttft_s"]["p99"],
        "requests": report["requests"],
        "rejected": report["rejected"],
        "preemptions": report["preemptions"],
    }


def check(row, report: dict) -> None:
    """Stop with one line if a row did not do what its label says."""
    name, _, tiers, _, weigh, prefetch = row
    stores = report.get("kv_stores") or {}
    problems = []
    if set(stores) != set(tiers):
        problems.append(f"stores {sorted(stores)}, not {sorted(tiers)}")
    if name == "infinite device" and report["evicted_blocks"]:
        problems.append(f"{report['evicted_blocks']} blocks evicted")
    if tiers and not any(s["loaded_blocks"] for s in stores.values()):
        problems.append("no block loaded from a tier")
    if any(bool(s["prefetch_rounds"]) != prefetch for s in stores.values() if s["loaded_blocks"]):
        problems.append(f"prefetch rounds {[s['prefetch_rounds'] for s in stores.values()]} with prefetch {prefetch}")
    if not weigh and any(s["recomputed_blocks"] for s in stores.values()):
        problems.append("blocks recomputed while always loading")
    if problems:
        raise SystemExit(f"tiers_replay: row {name!r} did not do what its label says: {'; '.join(problems)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-requests", type=int, default=3000)
    parser.add_argument("--time-scale", type=float, default=6.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    results = []
    for row in ROWS:
        results.append(run(row, args.max_requests, args.time_scale))
        r = results[-1]
        print(
            f"{r['row']}: device {r['block_hit_rate']:.4f}, tiers {r['tiers']}, TTFT mean {r['ttft_mean_s']:.3f} s"
            f" p50 {r['ttft_p50_s']:.3f} p99 {r['ttft_p99_s']:.3f}, recomputed {r['recomputed']},"
            f" prefetch (rounds, late, wasted blocks) {r['prefetch']}, preemptions {r['preemptions']}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
