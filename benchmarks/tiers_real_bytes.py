"""Real K/V bytes: the TTFT of a 2,000-token prefix reloaded from host
memory, a local disk and Redis against recomputing it, on the torch engine
(SmolLM2-135M, fp32, CPU), every run in this process, one after another.

    .venv/bin/python benchmarks/tiers_real_bytes.py [--threads N] [--json F]

Each run: a fresh engine whose pool holds 140 blocks of 16 tokens; the
prefix (125 blocks) is served, a 2,100-token request evicts it (each evicted
block offered to the run's one store), and the prefix comes back. The
disk's files are dropped from the page cache first (``posix_fadvise``), so
its reload reads the device; Redis runs as a redis-server of its own on a
free port (a row is left out, said so, without the binary). Every block
read back is checksummed before it enters the pool.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch
from sagellm_plugin_kv_stores.testing import redis_server
from sagellm_plugin_torch import testing as helpers
from sagellm_plugin_torch.engine import SamplingParams

from sagellm_core.types import Request


def uncache(folder: Path) -> None:
    """Drop the store's files from the page cache: the next read goes to the device."""
    for path in folder.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def reload_run(folder: Path, tier: str | None, prefix: list[int], filler: list[int], redis_url: str) -> dict:
    stores = ""
    if tier is not None:
        stores = f'[kv_stores]\ntiers = ["{tier}"]\n'
        stores += {
            "host": "[kv_stores.host]\ncapacity_blocks = 256\n",
            "disk": f'[kv_stores.disk]\npath = "{folder / "kv"}"\n',
            "redis": f'[kv_stores.redis]\nurl = "{redis_url}"\n',
        }[tier]
    core = helpers.engine_core(
        helpers.write_config(folder, num_blocks=140, max_num_seqs=4, max_num_batched_tokens=4096, extra=stores)
    )

    def serve(rid: str, prompt: list[int]) -> float:
        core.add_request(Request(rid, prompt, 1), SamplingParams(max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        while core.has_work():
            core.step()
        return time.perf_counter() - start

    serve("first", prefix + [11, 12, 13])
    serve("filler", filler)
    rt = core.rt
    report = rt.stores.report()  # (the writes done)
    if tier == "disk":
        uncache(folder / "kv")
    before = rt.counters.host_hit_blocks
    ttft = serve("again", prefix + [21, 22, 23])
    loaded = rt.counters.host_hit_blocks - before
    report = rt.stores.report().get(tier or "", {})
    assert tier is None or loaded >= 100, f"the prefix was meant to come back from {tier} ({loaded} blocks)"
    return {
        "ttft_s": ttft,
        "blocks_loaded": loaded,
        "bytes_read": report.get("bytes_read", 0),
        "corrupt_blocks": report.get("corrupt_blocks", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady on a busy machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(2000)]
    filler = [rng.randrange(100, 40000) for _ in range(2100)]
    rows = {}
    with redis_server() as url:
        for tier in (None, "host", "disk", *(["redis"] if url else [])):
            with tempfile.TemporaryDirectory() as folder:
                rows[tier or "recompute"] = reload_run(Path(folder), tier, prefix, filler, url or "")
    base = rows["recompute"]["ttft_s"]
    where = f"on the CPU, {args.threads} torch thread(s), load average {os.getloadavg()[0]:.1f}"
    print(f"TTFT of a 2,000-token prefix, SmolLM2-135M fp32 {where}{'' if url else ' (no redis-server here)'}:")
    for name, row in rows.items():
        print(
            f"  {name}: {row['ttft_s']:.3f} s, {base / row['ttft_s']:.2f}x recompute's speed,"
            f" {row['blocks_loaded']} blocks loaded ({row['bytes_read'] / 2**20:.1f} MiB),"
            f" {row['corrupt_blocks']} corrupt"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
