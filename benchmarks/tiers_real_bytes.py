"""Real K/V bytes: the TTFT of a 2,000-token prefix reloaded from host
memory, a local disk and Redis against recomputing it, on the torch engine
(SmolLM2-135M, fp32, CPU), every run in this process, one after another.

    .venv/bin/python benchmarks/tiers_real_bytes.py [--threads N] [--json F]

Each run: a fresh engine whose pool holds 140 blocks of 16 tokens; the
prefix (125 blocks) is served, a 2,100-token request evicts it (each evicted
block offered to the run's one store), and the prefix comes back; then
another 2,100-token request evicts it again and it comes back a second
time. The engine loads a run of blocks from a store only where its
measured costs (``sagellm_plugin_torch.costs``) expect the load to be
faster than recomputing it: at the first reload the store was never
measured, and it is loaded (that measures it); the second reload is the
decision made from the measured costs, printed with it and checked
against the blocks loaded or recomputed. The disk's files are dropped from
the page cache before each reload (``posix_fadvise``), so it reads the
device; Redis runs as a redis-server of its own on a free port (a row is
left out, said so, without the binary). Every block read back is
checksummed before it enters the pool.
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


def reload_run(folder: Path, tier: str | None, prefix: list[int], fillers: list[list[int]], redis_url: str) -> dict:
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
    rt = core.rt
    out = {}
    for reload, filler in (("first reload", fillers[0]), ("second reload", fillers[1])):
        serve(f"filler {reload}", filler)
        rt.stores.report()  # (the writes done)
        if tier == "disk":
            uncache(folder / "kv")
        before = rt.stores.report().get(tier or "", {})
        request = Request(reload, prefix + [21, 22, 23], 1)
        held = rt.stores.match(request, rt.host.lookup(request).num_blocks)
        rt.stores.ended(reload)  # (the lookup's keys: asked again at its admission)
        held_blocks = sum(len(run.keys) for run in held)
        costs = core.costs
        # What the engine's costs say of this reload before it is served: the
        # first one, its store never measured, is loaded (to measure it).
        cached = (len(prefix) // 16 - held_blocks) * 16
        expected = {
            "load_s": costs.load_s(tier, held_blocks) if costs else 0.0,
            "recompute_s": costs.recompute_s(held_blocks * 16, cached) if costs else 0.0,
        }
        ttft = serve(reload, prefix + [21, 22, 23])
        after = rt.stores.report().get(tier or "", {})
        loaded = after.get("loaded_blocks", 0) - before.get("loaded_blocks", 0)
        recomputed = after.get("recomputed_blocks", 0) - before.get("recomputed_blocks", 0)
        if tier is not None:
            assert held_blocks >= 100, f"the prefix was meant to be on {tier} ({held_blocks} blocks)"
            if expected["load_s"] < expected["recompute_s"]:
                assert loaded == held_blocks and recomputed == 0, f"{tier}: meant to load ({loaded}, {recomputed})"
            else:
                assert loaded == 0 and recomputed == held_blocks, f"{tier}: meant to recompute ({loaded}, {recomputed})"
        out[reload] = {
            "ttft_s": ttft,
            "blocks_held": held_blocks,
            "blocks_loaded": loaded,
            "blocks_recomputed": recomputed,
            "bytes_read": after.get("bytes_read", 0) - before.get("bytes_read", 0),
            "corrupt_blocks": after.get("corrupt_blocks", 0),
            **{f"expected_{k}": v for k, v in expected.items()},
        }
    out["costs"] = core.costs.figures() if core.costs else {}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady on a busy machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(2000)]
    fillers = [[rng.randrange(100, 40000) for _ in range(2100)] for _ in range(2)]
    rows = {}
    with redis_server() as url:
        for tier in (None, "host", "disk", *(["redis"] if url else [])):
            with tempfile.TemporaryDirectory() as folder:
                rows[tier or "recompute"] = reload_run(Path(folder), tier, prefix, fillers, url or "")
    where = f"on the CPU, {args.threads} torch thread(s), load average {os.getloadavg()[0]:.1f}"
    print(f"TTFT of a 2,000-token prefix, SmolLM2-135M fp32 {where}{'' if url else ' (no redis-server here)'}:")
    for reload in ("first reload", "second reload"):
        base = rows["recompute"][reload]["ttft_s"]
        print(f" {reload}:")
        for name, runs in rows.items():
            row = runs[reload]
            decided = (
                f"expected load {row['expected_load_s']:.3f} s against recompute {row['expected_recompute_s']:.3f} s"
            )
            print(
                f"  {name}: {row['ttft_s']:.3f} s, {base / row['ttft_s']:.2f}x recompute's speed,"
                f" {row['blocks_loaded']} blocks loaded ({row['bytes_read'] / 2**20:.1f} MiB),"
                f" {row['blocks_recomputed']} held but recomputed, {row['corrupt_blocks']} corrupt"
                + ("" if name == "recompute" else f"; {decided}")
            )
    for name, runs in rows.items():
        if runs["costs"]:
            print(f" {name}'s measured costs: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in runs["costs"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
