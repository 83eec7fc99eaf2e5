"""Two processes of the torch engine handing KV over a link, hosted by a
store in this process as a cluster's front hosts it: what the transports'
fault-injection tests share. Import only where torch, transformers and the
torch engine are installed."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import random
import time
from pathlib import Path

import torch.distributed as dist
from sagellm_plugin_cluster import workers

from sagellm_core.types import Request

MAX_TOKENS = 6
#: A worker's start (torch, transformers, the model: ~20 s on a shared
#: 2-core machine) and its requests, with room to spare.
BUDGET_S = 150.0


def tiny_config(folder: Path) -> str:
    from sagellm_plugin_torch import testing

    model = testing.save_tiny_llama(folder / "model")
    return str(testing.write_config(folder, model=str(model), num_blocks=64, max_num_seqs=4))


def shared_prefix_requests() -> list[Request]:
    """Six prompts of two to five blocks (block size 16) sharing two 24-token prefixes."""
    rng = random.Random(0)
    shared = [[rng.randrange(5, 120) for _ in range(24)] for _ in range(2)]
    tails = [[rng.randrange(5, 120) for _ in range(rng.randrange(10, 60))] for _ in range(6)]
    return [Request(f"r{i}", shared[i % 2] + tail, MAX_TOKENS) for i, tail in enumerate(tails)]


def one_instance(config: str, requests: list[Request]) -> dict[str, list[int]]:
    """Each request's outputs from one instance alone, in this process."""
    rt, _, engine = workers.start_engine(config)
    out = {r.request_id: workers.generate(engine, r) for r in requests}
    rt.check_invariants()
    return out


class Front:
    """The store's host, as the front of a cluster is: it outlives the workers."""

    def __init__(self) -> None:
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
        )
        self.context = multiprocessing.get_context("spawn")

    def start(self, target, config, requests, **kwargs):
        proc = self.context.Process(target=target, args=(config, self.store.port, "p0-d0", requests), kwargs=kwargs)
        proc.start()
        return proc

    def read(self, key: str):
        return json.loads(self.store.get(key)) if self.store.check([key]) else None


def join(procs, started: float) -> None:
    for proc in procs:
        proc.join(max(0.0, BUDGET_S - (time.monotonic() - started)))
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.kill()
    assert not alive, f"a worker ran past {BUDGET_S} s"


def outcomes(front, requests):
    results = {r.request_id: front.read(f"result/p0-d0/{r.request_id}") for r in requests}
    missing = [rid for rid, result in results.items() if result is None]
    assert not missing, f"requests with no outcome: {missing}"
    print(" ".join(f"{rid} {r['status']} {r['pull_s']:.3f}s" for rid, r in results.items()))
    return results


def whole(report) -> None:
    assert report is not None and "error" not in report, report
    assert report["invariants"] == "ok" and report["in_flight"] == 0
