"""The same workload through vLLM's real scheduler and through ``sagellm
replay``: prefix-cache hits, to the block.

    VLLM_TARGET_DEVICE=cpu python plugins/sagellm-plugin-vllm/benchmarks/equivalence.py \
        [--trace ../shared/data/traces/mooncake_conversation.jsonl] [--max-requests N] \
        [--num-blocks 320000] [--policies s3fifo,lfu]

Cache-only: each request alone, in arrival order, prompt only, 16-token
blocks, an equal pool. Table 1 sets stock vLLM (its own scheduler and
``FreeKVCacheBlockQueue``) beside ``sagellm replay`` with the LRU plugin and
beside vLLM with sagellm's LRU. Table 2 runs other sagellm policies inside
vLLM and in replay. Exit status 1 if any pair differs.
"""

from __future__ import annotations

import argparse
import sys
import time
import tomllib
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sagellm_core import config as config_mod
from sagellm_core.replay.session import run

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "traces" / "mooncake_conversation.jsonl"
)

CONFIG = """
[engine]
name = "{engine}"
{engine_params}

[workload]
source = "mooncake"
path = "{trace}"
{limit}

[prefix_cache]
block_size = 16
{cache_plugin}

[kv_pool]
num_blocks = {num_blocks}
{pool_plugin}

[eviction]
plugin = "{policy}"

[report]
hook_timing = false
"""


def settings(engine: str, policy: str, args, scheduler: str = "sagellm"):
    replay = engine == "replay"
    text = CONFIG.format(
        engine=engine,
        engine_params='mode = "cache-only"'
        if replay
        else f'scheduler = "{scheduler}"\nmax_num_batched_tokens = 262144',
        trace=Path(args.trace).resolve(),
        limit=f"max_requests = {args.max_requests}" if args.max_requests else "",
        cache_plugin='plugin = "radix"' if replay else "",
        pool_plugin='plugin = "paged"' if replay else "",
        num_blocks=args.num_blocks,
        policy=policy,
    )
    return config_mod.parse(tomllib.loads(text), f"<{engine} {scheduler} {policy}>")


def measure(label: str, s) -> dict:
    start = time.perf_counter()
    result = run(s, label=label)
    c = result.runtime.counters
    return {
        "label": label,
        "requests": result.report["requests"],
        "query_blocks": c.query_blocks,
        "hit_blocks": c.hit_blocks,
        "rate": c.hit_blocks / c.query_blocks if c.query_blocks else 0.0,
        "wall_s": time.perf_counter() - start,
    }


def table(title: str, rows: list[dict]) -> Table:
    t = Table(title=title)
    for col in ("run", "requests", "query blocks", "hit blocks", "block hit rate", "wall (s)"):
        t.add_column(col, justify="left" if col == "run" else "right")
    for r in rows:
        t.add_row(
            r["label"],
            f"{r['requests']:,}",
            f"{r['query_blocks']:,}",
            f"{r['hit_blocks']:,}",
            f"{r['rate']:.4f}",
            f"{r['wall_s']:.1f}",
        )
    return t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--num-blocks", type=int, default=320_000)
    parser.add_argument("--policies", default="s3fifo,lfu")
    args = parser.parse_args()
    console = Console()
    lru = [
        measure("vLLM, stock scheduler and queue", settings("vllm", "lru", args, scheduler="stock")),
        measure("sagellm replay, lru", settings("replay", "lru", args)),
        measure("vLLM + sagellm, lru", settings("vllm", "lru", args)),
    ]
    console.print(table(f"LRU: vLLM's own vs sagellm ({args.num_blocks:,} x 16-token blocks)", lru))
    others = []
    for policy in args.policies.split(","):
        others.append(measure(f"vLLM + sagellm, {policy}", settings("vllm", policy, args)))
        others.append(measure(f"sagellm replay, {policy}", settings("replay", policy, args)))
    console.print(table("sagellm policies inside vLLM and in replay", others))
    pairs = [(lru[0], lru[1]), (lru[0], lru[2])] + list(zip(others[::2], others[1::2]))
    differ = [
        (a["label"], b["label"])
        for a, b in pairs
        if (a["hit_blocks"], a["query_blocks"]) != (b["hit_blocks"], b["query_blocks"])
    ]
    for a, b in differ:
        console.print(f"[red]differ: {a} / {b}")
    if not differ:
        console.print("Equal hit and query block counts in every pair.")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
