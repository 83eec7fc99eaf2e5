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

import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("sagellm_plugin_torch")

from sagellm_plugin_cluster import workers  # noqa: E402

from .two_processes import BUDGET_S, Front, join, one_instance, outcomes, shared_prefix_requests, tiny_config, whole  # noqa: E402

pytestmark = pytest.mark.engine

#: Long enough for the decode side to reach every lease in its turn on a
#: loaded machine; the lease-expiry case ends its lease at once instead.
LEASE_S = 60.0
SEND_TIMEOUT_S = 2.0
PULL_TIMEOUT_S = 8.0


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return tiny_config(tmp_path_factory.mktemp("gloo"))


@pytest.fixture(scope="module")
def requests():
    return shared_prefix_requests()


@pytest.fixture(scope="module")
def reference(config, requests):
    return one_instance(config, requests)


def prefill(front, config, requests, faults=None, lease_s=LEASE_S):
    return front.start(
        workers.run_prefill, config, requests, lease_s=lease_s, send_timeout_s=SEND_TIMEOUT_S, faults=faults
    )


def decode(front, config, requests, faults=None):
    return front.start(workers.run_decode, config, requests, pull_timeout_s=PULL_TIMEOUT_S, faults=faults)


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
