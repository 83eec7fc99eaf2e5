"""KV transfer bandwidth between two processes on loopback over gloo, for
1, 16 and 256 blocks of SmolLM2-135M's KV layout (the torch engine's
tensor, fp32, 16-token blocks), against a raw gloo send of the same bytes
as one contiguous tensor on the same group in the same run.

A transfer is what :mod:`sagellm_plugin_cluster.gloo` does with a pull's
blocks: gathered out of the prefill engine's KV tensor into one tensor,
sent, received, scattered into the decode engine's blocks. Each size is
timed ``--repeats`` times after one warm-up; the table gives the median.

    .venv/bin/python benchmarks/kv_transfer.py [--repeats N]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

SIZES = (1, 16, 256)
NUM_BLOCKS = 300
TIMEOUT = datetime.timedelta(seconds=120)


def peer(rank: int, port: int, config: str, repeats: int, results) -> None:  # type: ignore[no-untyped-def]
    from sagellm_plugin_cluster.workers import start_engine

    _, kv, _ = start_engine(config)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    group = dist.ProcessGroupGloo(dist.PrefixStore("bench/", store), rank, 2, TIMEOUT)
    for size in SIZES:
        ids = tuple(range(size))
        raw = torch.zeros(kv.read(ids).numel(), dtype=torch.float32)
        for kind in ("raw", "kv"):
            times = []
            for _ in range(repeats + 1):
                group.barrier().wait(TIMEOUT)
                start = time.perf_counter()
                if kind == "raw":
                    op = group.send([raw], 1, 0) if rank == 0 else group.recv([raw], 0, 0)
                    op.wait(TIMEOUT)
                elif rank == 0:
                    group.send([kv.read(ids)], 1, 0).wait(TIMEOUT)
                else:
                    data = kv.empty(size)
                    group.recv([data], 0, 0).wait(TIMEOUT)
                    kv.write(ids, data)
                times.append(time.perf_counter() - start)
            if rank == 1:
                results.put((size, kind, statistics.median(times[1:]), raw.numel() * raw.element_size()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from sagellm_plugin_torch import testing

    with tempfile.TemporaryDirectory() as folder:
        config = str(testing.write_config(Path(folder), num_blocks=NUM_BLOCKS))
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        procs = [context.Process(target=peer, args=(r, store.port, config, args.repeats, results)) for r in (0, 1)]
        for proc in procs:
            proc.start()
        rows = [results.get(timeout=600) for _ in range(2 * len(SIZES))]
        for proc in procs:
            proc.join()
    seconds = {(size, kind): s for size, kind, s, _ in rows}
    nbytes = {size: n for size, _, _, n in rows}
    print("| blocks | bytes | raw gloo send | KV transfer | KV / raw |")
    print("|---:|---:|---:|---:|---:|")
    for size in SIZES:
        raw, kv = seconds[size, "raw"], seconds[size, "kv"]
        gbps = nbytes[size] / raw / 1e9
        print(
            f"| {size} | {nbytes[size] / 2**20:.1f} MiB | {raw * 1e3:.2f} ms ({gbps:.2f} GB/s)"
            f" | {kv * 1e3:.2f} ms | {kv / raw:.2f}x |"
        )


if __name__ == "__main__":
    main()
