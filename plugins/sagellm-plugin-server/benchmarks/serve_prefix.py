"""TTFT through the live server with prefix caching on and off, beside the
same workload in ``sagellm replay`` (the torch engine, no HTTP).

The workload is a Mooncake-format trace written here: 48 requests in four
groups, each group sharing a long prefix (8 hash ids) then one or two ids of
its own, 16 output tokens, Poisson arrivals at 1 request/s. ``sagellm bench
serve`` turns each hash id into 32 words of text; the replay maps each id to
32 token ids (``trace_block_tokens = 32``), so both see the same sharing.

    .venv/bin/python plugins/sagellm-plugin-server/benchmarks/serve_prefix.py [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
from pathlib import Path
from types import SimpleNamespace

import httpx
from sagellm_plugin_server import bench
from sagellm_plugin_server.testing import Server
from sagellm_plugin_torch import testing

from sagellm_core.replay import session

WORDS_PER_BLOCK = 32


def write_trace(path: Path, n: int = 48, seed: int = 0) -> Path:
    rng = random.Random(seed)
    t, rows = 0.0, []
    for i in range(n):
        group = i % 4
        ids = [1000 * (group + 1) + k for k in range(8)] + [10 + i * 3 + k for k in range(rng.randrange(1, 3))]
        rows.append(
            {
                "timestamp": round(t * 1000),
                "input_length": len(ids) * WORDS_PER_BLOCK,
                "output_length": 16,
                "hash_ids": ids,
            }
        )
        t += rng.expovariate(1.0)
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def config(folder: Path, cache: bool, trace: Path | None) -> Path:
    workload = (
        f'[workload]\nsource = "mooncake"\npath = "{trace}"\ntrace_block_tokens = {WORDS_PER_BLOCK}\n' if trace else ""
    )
    path = testing.write_config(
        folder,
        num_blocks=1024,
        prefix_cache=cache,
        max_num_seqs=32,
        max_num_batched_tokens=1024,
        extra=workload + '[server]\nmodel_name = "smollm2"\n',
    )
    text = path.read_text().replace('name = "torch"', 'name = "torch"\nignore_eos = true')
    out = folder / f"{'replay' if trace else 'serve'}-{'on' if cache else 'off'}.toml"
    out.write_text(text)
    return out


def serve_run(folder: Path, trace: Path, cache: bool) -> dict:
    server = Server(config(folder, cache, None))
    try:
        args = SimpleNamespace(
            url=server.url,
            trace=str(trace),
            rate=None,
            max_requests=None,
            model="smollm2",
            max_tokens=16,
            words_per_block=WORDS_PER_BLOCK,
            timeout=300.0,
            first_token_timeout=None,
            seed=0,
            quiet=True,
        )
        report = asyncio.run(bench.run(args, bench.load(args)))
        stats = httpx.get(f"{server.url}/kv/stats").json()
    finally:
        server.stop()
    assert report["failed"] == 0
    assert (stats["block_hit_rate"] > 0) == cache, "a caching run must hit, the other must not"
    return {
        "ttft_s": report["ttft_s"],
        "e2e_s": report["e2e_s"],
        "block_hit_rate": stats["block_hit_rate"],
        "throughput_output_tokens_per_s": report["throughput_output_tokens_per_s"],
    }


def replay_run(folder: Path, trace: Path, cache: bool) -> dict:
    report = session.run(session.load_settings(config(folder, cache, trace))).report
    assert (report["block_hit_rate"] > 0) == cache
    return {"ttft_s": report["ttft_s"], "block_hit_rate": report["block_hit_rate"]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    trace = write_trace(folder / "shared-prefix.jsonl")
    results = {}
    for name, run in (("serve", serve_run), ("replay", replay_run)):
        on, off = run(folder, trace, True), run(folder, trace, False)
        ratio = off["ttft_s"]["mean"] / on["ttft_s"]["mean"]
        results[name] = {"cache_on": on, "cache_off": off, "ttft_mean_ratio": ratio}
        print(
            f"{name}: mean TTFT cache on {on['ttft_s']['mean']:.3f} s (hit rate {on['block_hit_rate']:.3f}),"
            f" off {off['ttft_s']['mean']:.3f} s: {ratio:.2f}x lower with caching;"
            f" p99 {on['ttft_s']['p99']:.3f} against {off['ttft_s']['p99']:.3f} s"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
