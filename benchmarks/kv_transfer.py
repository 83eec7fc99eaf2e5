"""KV transfer bandwidth between two processes on loopback, per transport,
for 1, 16 and 256 blocks of SmolLM2-135M's KV layout (the torch engine's
tensor, fp32, 16-token blocks), against a raw transfer of the same bytes
with the same library in the same run.

* gloo: what :mod:`sagellm_plugin_cluster.gloo` does with a pull's blocks
  (a small pull gathered out of the prefill engine's KV tensor into one
  message and scattered into the decode engine's blocks; a large one as a
  message per layer slab, sent from and received into the engines' KV
  tensors) against a gloo send of the same bytes as one preallocated
  tensor on the same group.
* mooncake, nixl: what :mod:`sagellm_plugin_cluster.inplace` does over the
  Mooncake Transfer Engine and NIXL (one batch of in-place reads from the
  prefill engine's registered KV tensor into the decode engine's, one per
  layer slab and run of blocks) against one read of the same number of
  contiguous bytes between the same registered tensors, with the same
  library. Skipped, saying so, where the library does not import.

The prefill side's KV tensor holds seeded random values; every row checks
that the bytes that arrived equal them (the decode side's tensor is zeroed
before each repeat). Each size is timed ``--repeats`` times after one
warm-up, the raw transfer and the KV transfer taking turns; the table
gives the medians.

    .venv/bin/python benchmarks/kv_transfer.py [--repeats N] [--transport gloo|mooncake ...]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
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
TRANSPORTS = ("gloo", "mooncake", "nixl")
#: The module each transport's library is imported as.
LIBRARIES = {"gloo": "torch.distributed", "mooncake": "mooncake.engine", "nixl": "nixl_cu12._api"}


def expected_kv(kv) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.randn(kv.tensor.shape, generator=torch.Generator().manual_seed(0), dtype=kv.tensor.dtype)


def gloo_rows(rank: int, kv, store, expected: torch.Tensor, repeats: int, results) -> None:  # type: ignore[no-untyped-def]
    from sagellm_plugin_cluster import gloo

    group = dist.ProcessGroupGloo(dist.PrefixStore("bench/gloo/", store), rank, 2, TIMEOUT)
    block_dim = kv.caches.block_dim
    for size in SIZES:
        ids = tuple(range(size))
        sent = expected.narrow(block_dim, 0, size).contiguous().flatten()
        raw = sent.clone() if rank == 0 else torch.zeros_like(sent)
        messages = gloo.message_count(kv, size)
        times: dict[str, list[float]] = {"raw": [], "kv": []}
        for _ in range(repeats + 1):
            for kind in ("raw", "kv"):  # alternated, so that a change in the machine's load meets both
                if rank == 1:
                    raw.zero_()
                    kv.tensor.zero_()
                group.barrier().wait(TIMEOUT)
                start = time.perf_counter()
                if kind == "raw":
                    op = group.send([raw], 1, 0) if rank == 0 else group.recv([raw], 0, 0)
                    op.wait(TIMEOUT)
                elif rank == 0:
                    outgoing = gloo.outgoing(kv, ids)
                    assert len(outgoing) == messages
                    for work in [group.send([m], 1, tag) for tag, m in enumerate(outgoing)]:
                        work.wait(TIMEOUT)
                else:
                    targets, in_place = gloo.incoming(kv, ids, messages)
                    for work in [group.recv([t], 0, tag) for tag, t in enumerate(targets)]:
                        work.wait(TIMEOUT)
                    gloo.land(kv, ids, in_place)
                times[kind].append(time.perf_counter() - start)
                if rank == 1:
                    arrived = raw if kind == "raw" else kv.tensor.narrow(block_dim, 0, size).contiguous().flatten()
                    assert torch.equal(arrived, sent), f"gloo {kind} {size} blocks: the bytes that arrived differ"
        if rank == 1:
            for kind in ("raw", "kv"):
                results.put(
                    (
                        "gloo",
                        size,
                        kind,
                        statistics.median(times[kind][1:]),
                        sent.numel() * sent.element_size(),
                        messages,
                    )
                )


def inplace_rows(name: str, rank: int, kv, store, expected: torch.Tensor, repeats: int, results) -> None:  # type: ignore[no-untyped-def]
    """Mooncake's or NIXL's rows: the decode side (rank 1) reads, the prefill side waits."""
    import importlib

    from sagellm_plugin_cluster.inplace import parse_peer
    from sagellm_plugin_cluster.kv_tensors import segments

    memory = importlib.import_module(f"sagellm_plugin_cluster.{name}").MEMORY
    local = memory.register(kv, "127.0.0.1")
    if rank == 0:
        store.set(f"bench/{name}/peer", local.describe())
        store.wait([f"bench/{name}/finished"], TIMEOUT)
        return
    peer = parse_peer(store.get(f"bench/{name}/peer").decode(), name)
    assert peer is not None
    block_dim = kv.caches.block_dim
    for size in SIZES:
        ids = tuple(range(size))
        found = segments(peer.layout, ids, local.layout, ids)
        nbytes = sum(length for _, _, length in found)
        times: dict[str, list[float]] = {"raw": [], "kv": []}
        for _ in range(repeats + 1):
            for kind in ("raw", "kv"):  # alternated, so that a change in the machine's load meets both
                ranges = [(0, 0, nbytes)] if kind == "raw" else found
                kv.tensor.zero_()
                start = time.perf_counter()
                done = memory.start_read(local, peer, ranges).wait(TIMEOUT.total_seconds())
                times[kind].append(time.perf_counter() - start)
                assert done, f"{name} {kind} {size} blocks: the read failed"
                if kind == "raw":
                    arrived, sent = kv.tensor.flatten()[: nbytes // 4], expected.flatten()[: nbytes // 4]
                else:
                    arrived, sent = kv.tensor.narrow(block_dim, 0, size), expected.narrow(block_dim, 0, size)
                assert torch.equal(arrived, sent), f"{name} {kind} {size} blocks: the bytes that arrived differ"
        for kind in ("raw", "kv"):
            reads = 1 if kind == "raw" else len(found)
            results.put((name, size, kind, statistics.median(times[kind][1:]), nbytes, reads))
    store.set(f"bench/{name}/finished", "1")


def peer(rank: int, port: int, config: str, repeats: int, transports: list[str], results) -> None:  # type: ignore[no-untyped-def]
    from sagellm_plugin_cluster.workers import start_engine

    _, kv, _ = start_engine(config)
    expected = expected_kv(kv)
    if rank == 0:
        kv.tensor.copy_(expected)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    for transport in transports:
        if transport == "gloo":
            gloo_rows(rank, kv, store, expected, repeats, results)
        else:
            inplace_rows(transport, rank, kv, store, expected, repeats, results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transport", action="append", choices=TRANSPORTS, help="repeatable; all by default")
    args = parser.parse_args()
    transports = args.transport or list(TRANSPORTS)
    for transport in list(transports):
        try:
            importlib.import_module(LIBRARIES[transport])
        except ImportError as exc:
            print(f"kv_transfer: no {transport} rows: {exc}")
            transports.remove(transport)
    from sagellm_plugin_torch import testing

    with tempfile.TemporaryDirectory() as folder:
        config = str(testing.write_config(Path(folder), num_blocks=NUM_BLOCKS))
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        procs = [
            context.Process(target=peer, args=(r, store.port, config, args.repeats, transports, results))
            for r in (0, 1)
        ]
        for proc in procs:
            proc.start()
        rows = [results.get(timeout=900) for _ in range(2 * len(SIZES) * len(transports))]
        for proc in procs:
            proc.join()
            assert proc.exitcode == 0, f"a benchmark process exited with {proc.exitcode}"
    seconds = {(row[0], row[1], row[2]): row[3] for row in rows}
    nbytes = {(row[0], row[1]): row[4] for row in rows}
    reads = {(row[0], row[1]): row[5] for row in rows if row[2] == "kv"}
    raw_name = {"gloo": "raw gloo send", "mooncake": "raw Mooncake read", "nixl": "raw NIXL read"}
    print("| transport | blocks | bytes | raw (same library) | KV transfer | KV / raw |")
    print("|---|---:|---:|---:|---:|---:|")
    for transport in transports:
        for size in SIZES:
            raw, kv = seconds[transport, size, "raw"], seconds[transport, size, "kv"]
            gbps = nbytes[transport, size] / raw / 1e9
            unit = "messages" if transport == "gloo" else "reads"
            how = f" ({reads[transport, size]} {unit})"
            print(
                f"| {transport} | {size} | {nbytes[transport, size] / 2**20:.1f} MiB"
                f" | {raw * 1e3:.2f} ms ({gbps:.2f} GB/s, {raw_name[transport]}) | {kv * 1e3:.2f} ms{how}"
                f" | {kv / raw:.2f}x |"
            )


if __name__ == "__main__":
    main()
