"""Why gloo's one-block transfer took 17 ms: a transport's gather of a
pull's blocks out of the KV tensor (SmolLM2-135M's layout, fp32, 16-token
blocks, 300 blocks) through torch's intra-op thread pool, against the same
copy on the calling thread alone (``kv_tensors.one_thread``, what the
transports now do), for 1, 16 and 256 blocks; the two take turns, median of
``--repeats``, each row checking that the copy equals its source. Each
copy follows an idle ``IDLE_S``, as a transfer's copy follows its wait on
the network or the store: the pool's threads have gone to sleep by then,
as they have in a transfer.

    .venv/bin/python benchmarks/kv_copy_threads.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from sagellm_plugin_cluster.kv_tensors import one_thread

SHAPE = (30, 2, 300, 16, 3, 64)  # [layers, K/V, blocks, tokens, kv heads, head dim]
SIZES = (1, 16, 256)
#: Longer than the OpenMP runtime keeps its idle threads spinning (200 ms by default).
IDLE_S = 0.3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    kv = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    out = torch.empty(SHAPE[:2] + (256,) + SHAPE[3:])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    print("| blocks | thread pool | one thread | pool / one thread |")
    print("|---:|---:|---:|---:|")
    for size in SIZES:
        src, dst = kv.narrow(2, 7, size), out.narrow(2, 0, size)
        times: dict[str, list[float]] = {"pool": [], "one": []}
        for _ in range(args.repeats + 1):
            for how in ("pool", "one"):
                dst.zero_()
                time.sleep(IDLE_S)
                start = time.perf_counter()
                if how == "pool":
                    dst.copy_(src)
                else:
                    with one_thread():
                        dst.copy_(src)
                times[how].append(time.perf_counter() - start)
                assert torch.equal(dst, src), f"{size} blocks, {how}: the copy differs from its source"
        pool, one = (statistics.median(times[h][1:]) for h in ("pool", "one"))
        print(f"| {size} | {pool * 1e3:.3f} ms | {one * 1e3:.3f} ms | {pool / one:.1f}x |")


if __name__ == "__main__":
    main()
