"""KV handed between two real processes over gloo on loopback, with
faults injected: every request completes with the outputs of one instance
alone, and no block is held on either side afterwards (each side's
``check_invariants``).

Each case runs a prefill and a decode process of the torch engine on a tiny
random Llama; a worker that does not end within ``BUDGET_S`` fails the
test (it is killed), so a transfer that hangs cannot pass. Each request's
outcome and pull time are printed (``-s``) for the fault table of
docs/benchmarks/disaggregation.md. Marked ``engine`` (minutes: each process
loads torch and the model): ``tox -e cluster-transfer`` runs them."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import random
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("sagellm_plugin_torch")

import torch.distributed as dist  # noqa: E402
from sagellm_plugin_cluster import workers  # noqa: E402

from sagellm_core.types import Request  # noqa: E402

pytestmark = pytest.mark.engine

MAX_TOKENS = 6
#: Long enough for the decode side to reach every lease in its turn on a
#: loaded machine; the lease-expiry case ends its lease at once instead.
LEASE_S = 60.0
SEND_TIMEOUT_S = 2.0
PULL_TIMEOUT_S = 8.0
#: A worker's start (torch, transformers, the model: ~20 s on a shared
#: 2-core machine) and its requests, with room to spare.
BUDGET_S = 150.0


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    from sagellm_plugin_torch import testing

    folder = tmp_path_factory.mktemp("gloo")
    model = testing.save_tiny_llama(folder / "model")
    return str(testing.write_config(folder, model=str(model), num_blocks=64, max_num_seqs=4))


@pytest.fixture(scope="module")
def requests():
    """Six prompts of two to five blocks (block size 16) sharing two 24-token prefixes."""
    rng = random.Random(0)
    shared = [[rng.randrange(5, 120) for _ in range(24)] for _ in range(2)]
    tails = [[rng.randrange(5, 120) for _ in range(rng.randrange(10, 60))] for _ in range(6)]
    return [Request(f"r{i}", shared[i % 2] + tail, MAX_TOKENS) for i, tail in enumerate(tails)]


@pytest.fixture(scope="module")
def reference(config, requests):
    """One instance alone, in this process."""
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


def prefill(front, config, requests, faults=None, lease_s=LEASE_S):
    return front.start(
        workers.run_prefill, config, requests, lease_s=lease_s, send_timeout_s=SEND_TIMEOUT_S, faults=faults
    )


def decode(front, config, requests, faults=None):
    return front.start(workers.run_decode, config, requests, pull_timeout_s=PULL_TIMEOUT_S, faults=faults)


def outcomes(front, requests):
    results = {r.request_id: front.read(f"result/p0-d0/{r.request_id}") for r in requests}
    missing = [rid for rid, result in results.items() if result is None]
    assert not missing, f"requests with no outcome: {missing}"
    print(" ".join(f"{rid} {r['status']} {r['pull_s']:.3f}s" for rid, r in results.items()))
    return results


def whole(report) -> None:
    assert report is not None and "error" not in report, report
    assert report["invariants"] == "ok" and report["in_flight"] == 0


def test_failed_and_expired_transfers_are_recomputed_with_equal_outputs(config, requests, reference):
    """An injected transport error on r1, and r5's lease expiring before
    the decode side claims it; the other four hand their blocks over."""
    front, started = Front(), time.monotonic()
    procs = [
        prefill(front, config, requests, {"r1": "error", "r5": "expire"}),
        decode(front, config, requests, {"r5": "late"}),
    ]
    join(procs, started)
    results = outcomes(front, requests)
    assert {rid: r["tokens"] for rid, r in results.items()} == reference
    assert {rid: r["status"] for rid, r in results.items()} == {
        "r0": "done", "r1": "failed", "r2": "done", "r3": "done", "r4": "done", "r5": "expired",
    }  # fmt: skip
    decoded, prefilled = front.read("report/p0-d0/decode"), front.read("report/p0-d0/prefill")
    whole(decoded)
    whole(prefilled)
    counts = decoded["counts"]
    assert (counts["done"], counts["failed"], counts["expired"]) == (4, 1, 1)
    assert counts["blocks"] > 0
    assert counts["recomputed_tokens"] == requests[1].num_prompt_tokens + requests[5].num_prompt_tokens
    assert prefilled["leases"] == {"done": 4, "failed": 1, "expired": 1}
    assert prefilled["send_failures"] == 0


def test_a_prefill_killed_mid_transfer(config, requests, reference):
    """The prefill process exits after answering r3's pull, before sending:
    the decode side's receive fails, and it computes r3 itself."""
    served = requests[:4]
    front, started = Front(), time.monotonic()
    procs = [prefill(front, config, served, {"r3": "exit-before-send"}), decode(front, config, served)]
    join(procs, started)
    assert procs[0].exitcode == 17
    results = outcomes(front, served)
    assert {rid: r["tokens"] for rid, r in results.items()} == {r.request_id: reference[r.request_id] for r in served}
    assert [r["status"] for r in results.values()] == ["done", "done", "done", "failed"]
    whole(front.read("report/p0-d0/decode"))


def test_a_decode_restarting_mid_transfer(config, requests, reference):
    """The decode process exits after claiming r2's lease; a new one serves
    r2 onwards: r2's lease was taken by the dead one (the prefill's send to
    it fails within its timeout), so r2 is computed; the rest are handed
    over on a new group (the leases outlast the new process's start)."""
    front, started = Front(), time.monotonic()
    procs = [
        prefill(front, config, requests, lease_s=BUDGET_S),
        decode(front, config, requests, {"r2": "exit-after-claim"}),
    ]
    procs[1].join(BUDGET_S)
    assert procs[1].exitcode == 17
    procs.append(decode(front, config, requests[2:]))
    join(procs, started)
    results = outcomes(front, requests)
    assert {rid: r["tokens"] for rid, r in results.items()} == reference
    assert [r["status"] for r in results.values()] == ["done", "done", "failed", "done", "done", "done"]
    prefilled = front.read("report/p0-d0/prefill")
    whole(prefilled)
    whole(front.read("report/p0-d0/decode"))
    assert prefilled["send_failures"] == 1
