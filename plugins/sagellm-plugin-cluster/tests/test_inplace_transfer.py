"""KV read in place (:mod:`sagellm_plugin_cluster.inplace`), over each
transport that reads remote memory: the Mooncake Transfer Engine (TCP on
loopback) and NIXL (UCX on loopback).

In this process: two runtimes with KV tensors of their own, each registered
with the library, hand a prompt's blocks over a store, and the decode side's
blocks hold the prefill side's bytes; a read the lease's deadline overtook
is never cached; a refused read frees both sides. Then two real processes
of the torch engine, faults injected (``engine``, ``tox -e
cluster-inplace``): every request completes with the outputs of one
instance alone, and no block is held on either side afterwards. A
transport whose package is not installed skips, saying which."""

from __future__ import annotations

import datetime
import time

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from sagellm_plugin_cluster import transports  # noqa: E402
from sagellm_plugin_cluster.kv_tensors import KVTensors  # noqa: E402
from sagellm_plugin_cluster.transfer import TransferStatus  # noqa: E402

from sagellm_core.errors import ConfigError  # noqa: E402
from sagellm_core.types import KVCaches  # noqa: E402

from .conftest import compute, prompt, runtime  # noqa: E402


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def transport(request):
    """The transport's name, skipped (saying why) where its package is missing."""
    try:
        transports.load(request.param)
    except ConfigError as exc:
        pytest.skip(str(exc))
    return request.param


@pytest.fixture(scope="module")
def sides(transport):
    return transports.load(transport)


@pytest.fixture(scope="module")
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)


def side(blocks: int = 64, seed: int = 0):
    """A runtime with a KV tensor of its own (``[2 layers, 2, blocks, 4 tokens, 3]``), random bytes."""
    rt = runtime(blocks)
    kv = KVTensors()
    rt.host.pm.register(kv)
    tensor = torch.randn(2, 2, blocks, 4, 3, generator=torch.Generator().manual_seed(seed))
    rt.register_kv_caches(KVCaches(tensor, 2, model="m"))
    return rt, kv, tensor


def pair(sides, store, link, prefill_faults=None, decode_faults=None, lease_s=60.0):
    prefill_side, decode_side = sides
    prefill, prefill_kv, prefill_tensor = side(seed=1)
    decode, decode_kv, decode_tensor = side(blocks=48, seed=2)
    # The decode side holds other blocks first, so that its ids differ from the prefill side's.
    compute(decode, prompt(7, shared=0, own=13))
    server = prefill_side(prefill, prefill_kv, store, link, lease_s=lease_s, send_timeout_s=1, faults=prefill_faults)
    puller = decode_side(decode, decode_kv, store, link, faults=decode_faults)
    return (prefill, server, prefill_tensor), (decode, puller, decode_tensor)


def serve_while(server, pull):
    """The prefill side's polls on a thread of their own, as an instance
    serves leases while the decode side reads."""
    import threading

    stop = threading.Event()

    def poll():
        while not stop.is_set():
            server.poll(time.monotonic())
            time.sleep(0.001)

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        return pull()
    finally:
        stop.set()
        thread.join()
        server.poll(time.monotonic())  # the decode side's last word, as a busy prefill side polls until it comes


def test_the_decode_side_reads_the_leased_blocks_in_place(transport, sides, store):
    (prefill, server, prefill_tensor), (decode, puller, decode_tensor) = pair(sides, store, f"in-place-{transport}")
    request = prompt(0)
    compute(prefill, request)
    assert server.offer(request, time.monotonic()) == 4
    lease_ids = server.leases.open["r0"].block_ids
    status = serve_while(server, lambda: puller.pull(request, 5.0))
    assert status is TransferStatus.DONE and puller.reason == ""
    assert not server.busy and server.leases.ended[TransferStatus.DONE] == 1
    landed = decode.host.lookup(request).block_ids
    assert len(landed) == 4 and landed != lease_ids  # other ids on the decode side
    assert torch.equal(decode_tensor[:, :, list(landed)], prefill_tensor[:, :, list(lease_ids)])
    assert (puller.counts.done, puller.counts.blocks) == (1, 4)
    prefill.check_invariants()
    decode.check_invariants()


def test_a_restarted_decode_side_takes_over_its_predecessors_claim(transport, sides, store):
    """A decode process claims a lease and is gone before reading it; the
    one that replaces it on the link (a higher epoch) takes the claim over
    and reads the blocks the lease still holds. A claim of a later epoch is
    not taken back; and every key of a lease is gone from the store once
    the lease has ended."""
    link = f"restart-{transport}"
    (prefill, server, prefill_tensor), (decode, gone, _) = pair(sides, store, link)
    request, other = prompt(0), prompt(1)
    for r in (request, other):
        compute(prefill, r)
        server.offer(r, time.monotonic())
    key, other_key = f"kv/{link}/lease/r0", f"kv/{link}/lease/r1"
    lease_ids = server.leases.open["r0"].block_ids
    offered = store.get(key).decode()
    claim = f"read 0 4 {gone.epoch}"
    assert store.compare_set(key, offered, claim).decode() == claim  # as the predecessor claims, then dies
    server.poll(time.monotonic())
    assert server.busy  # the claim holds the lease
    decode2, kv2, decode2_tensor = side(blocks=48, seed=3)
    puller = sides[1](decode2, kv2, store, link)
    assert puller.epoch > gone.epoch
    assert serve_while(server, lambda: puller.pull(request, 5.0)) is TransferStatus.DONE
    landed = decode2.host.lookup(request).block_ids
    assert torch.equal(decode2_tensor[:, :, list(landed)], prefill_tensor[:, :, list(lease_ids)])
    assert server.leases.ended[TransferStatus.DONE] == 1
    assert not store.check([key]) and not store.check([f"kv/{link}/blocks/r0"])
    # A claim of the later epoch: the earlier process takes nothing over.
    later = f"read 0 1 {puller.epoch}"
    assert store.compare_set(other_key, store.get(other_key).decode(), later).decode() == later
    assert gone.pull(other, 0.5) is TransferStatus.FAILED
    assert gone.reason == f"no offer on the lease's key ({later!r})"
    assert decode.host.lookup(other).num_blocks == 0 and store.get(other_key).decode() == later
    server.poll(time.monotonic() + 120.0)  # its deadline ends it; "expired" waits for the decode side
    assert server.leases.ended[TransferStatus.EXPIRED] == 1 and not server.busy
    assert store.get(other_key).decode() == "expired" and not store.check([f"kv/{link}/blocks/r1"])
    assert puller.pull(other, 0.5) is TransferStatus.EXPIRED and not store.check([other_key])
    assert puller.reason == "the lease expired before its claim"
    for rt in (prefill, decode, decode2):
        rt.check_invariants()
        assert rt.in_flight == 0


def test_a_read_the_deadline_overtook_is_never_cached(transport, sides, store):
    """The prefill side ends the lease once it is claimed; the decode side's
    read completes, but its confirmation loses: nothing lands."""
    (prefill, server, _), (decode, puller, _) = pair(
        sides,
        store,
        f"overtaken-{transport}",
        prefill_faults={"r0": "expire-claimed"},
        decode_faults={"r0": "confirm-late"},
    )
    request = prompt(0)
    compute(prefill, request)
    server.offer(request, time.monotonic())
    status = serve_while(server, lambda: puller.pull(request, 5.0))
    assert status is TransferStatus.EXPIRED and puller.reason == "the lease ended before the read was confirmed"
    assert server.leases.ended[TransferStatus.EXPIRED] == 1 and server.expired_claimed == 1
    assert decode.host.lookup(request).num_blocks == 0
    assert puller.counts.expired == 1 and puller.counts.recomputed_tokens == request.num_prompt_tokens
    prefill.check_invariants()
    decode.check_invariants()
    assert decode.in_flight == 0 and prefill.in_flight == 0


def test_a_read_past_its_own_deadline_fails_and_its_landing_waits_for_it(transport, sides, store, monkeypatch):
    """The read is still running at its own deadline (a peer that stopped
    answering): the pull ends failed well before its own deadline, the
    prefill side lets the lease go at once, and the landing's blocks stay
    held until the read has returned, then are freed unwritten."""
    import importlib

    from sagellm_plugin_cluster import inplace

    monkeypatch.setattr(importlib.import_module(f"sagellm_plugin_cluster.{transport}").MEMORY, "read_timeout_s", 0.2)
    (prefill, server, _), (decode, puller, _) = pair(
        sides, store, f"stalled-{transport}", decode_faults={"r0": "stall"}
    )
    request = prompt(0)
    compute(prefill, request)
    server.offer(request, time.monotonic())
    started = time.monotonic()
    status = serve_while(server, lambda: puller.pull(request, 30.0))
    assert status is TransferStatus.FAILED and puller.counts.failed == 1
    assert puller.reason == "still reading at the read's own deadline"
    assert server.leases.ended[TransferStatus.FAILED] == 1 and not server.busy
    if time.monotonic() - started < inplace.STALL_S:  # the read has not returned yet: its landing is held
        assert puller.reap() == 1 and decode.in_flight == 1
    give_up = time.monotonic() + inplace.STALL_S + 10.0  # the read returns once the stall ends
    while puller.reap() and time.monotonic() < give_up:
        time.sleep(0.05)
    assert puller.reap() == 0 and decode.in_flight == 0
    assert decode.host.lookup(request).num_blocks == 0
    prefill.check_invariants()
    decode.check_invariants()
    assert prefill.in_flight == 0


def test_a_refused_read_fails_and_frees_both_sides(transport, sides, store):
    """The read asks for addresses past the prefill side's registered
    memory: the peer's engine refuses it."""
    (prefill, server, _), (decode, puller, _) = pair(
        sides, store, f"refused-{transport}", decode_faults={"r0": "error"}
    )
    request = prompt(0)
    compute(prefill, request)
    server.offer(request, time.monotonic())
    status = serve_while(server, lambda: puller.pull(request, 5.0))
    assert status is TransferStatus.FAILED
    assert transport in puller.reason.lower(), puller.reason  # the library's refusal, as it said it
    assert server.leases.ended[TransferStatus.FAILED] == 1 and not server.busy
    assert decode.host.lookup(request).num_blocks == 0
    prefill.check_invariants()
    decode.check_invariants()
    assert decode.in_flight == 0 and prefill.in_flight == 0


def test_an_idle_nixl_agent_leaves_the_cpu_alone(transport):
    """An agent as the transport makes it (its progress thread running), in
    a process of its own that then sleeps for two seconds: its progress
    thread waits on UCX's events and the process takes almost no CPU. (With
    NIXL's own wait of zero the thread spun, a whole core for as long as
    the process lived. A loaded machine only lowers what a spinning thread
    gets, never raises what a waiting one takes.)"""
    import subprocess
    import sys

    if transport != "nixl":
        pytest.skip("the progress thread is NIXL's")
    code = (
        "import os, time\n"
        "from sagellm_plugin_cluster.nixl import new_agent\n"
        "agent = new_agent('idle')\n"
        "cpu, wall = time.process_time(), time.monotonic()\n"
        "time.sleep(2.0)\n"
        "print('idle', time.process_time() - cpu, time.monotonic() - wall, flush=True)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    line = next((line for line in out.stdout.splitlines() if line.startswith("idle ")), None)
    assert line is not None, out.stdout + out.stderr[-2000:]
    cpu, wall = map(float, line.split()[1:])
    assert cpu < 0.25 * wall, f"the idle agent's process took {cpu:.2f} s of CPU in {wall:.2f} s"


# One process per side on two addresses of this machine, a loopback one and
# the machine's own: no engine, the library's registration and reads alone.

#: A side of :func:`test_reads_between_a_loopback_address_and_the_machines_own`:
#: ``python -c SIDE <config> <transport> <host> [<peer's description>]``.
#: Without a description it registers its KV tensor, prints its description
#: and the digest of its bytes, and waits for its stdin to close; with one,
#: it reads the peer's whole tensor four times and prints each read's
#: outcome and the digest of its own tensor after it (each line it prints
#: begins ``side``: the libraries log to stdout too).
SIDE = """
import hashlib, sys, torch
from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.runtime import Runtime
from sagellm_core.types import KVCaches
from sagellm_plugin_cluster import transports
from sagellm_plugin_cluster.inplace import parse_peer
from sagellm_plugin_cluster.kv_tensors import KVTensors

config, transport, host, *peer = sys.argv[1:]
rt = Runtime(settings_from_toml(open(config).read()))
kv = KVTensors()
rt.host.pm.register(kv)
tensor = torch.randn(2, 2, 64, 4, 3, generator=torch.Generator().manual_seed(len(peer)))
rt.register_kv_caches(KVCaches(tensor, 2, model="m"))
memory = transports.load(transport)[0].memory
local = memory.register(kv, host)
digest = lambda: hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
if not peer:
    print("side", local.describe(), digest(), flush=True)
    sys.stdin.read()
else:
    remote = parse_peer(peer[0], local.kind)
    for _ in range(4):
        tensor.zero_()
        try:
            done = memory.start_read(local, remote, [(0, 0, remote.nbytes)]).wait(60.0)
        except Exception as exc:
            done = f"{type(exc).__name__}: {exc}".replace(" ", "_")
        print("side", done, digest(), flush=True)
"""


def machine_address() -> str | None:
    """This machine's first IPv4 address outside loopback, if it has one."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address on it
                continue
            address = socket.inet_ntoa(packed[20:24])
            if not address.startswith("127."):
                return address
    return None


@pytest.mark.parametrize("owner", ["loopback", "machine"])
def test_reads_between_a_loopback_address_and_the_machines_own(transport, owner, tmp_path):
    """The prefill side's process on one address, the decode side's on the
    other (as two Ray nodes of one machine are, 127.0.0.2 and the machine's
    address): each of four reads of the peer's whole tensor completes with
    its bytes. (NIXL held an agent on a loopback address to UCX's ``lo``,
    which UCX does not join to a non-loopback device: every read failed.)"""
    import subprocess
    import sys

    from .conftest import CONFIG

    address = machine_address()
    if address is None:
        pytest.skip("this machine has no IPv4 address outside loopback")
    hosts = ("127.0.0.2", address) if owner == "loopback" else (address, "127.0.0.2")
    config = tmp_path / "side.toml"
    config.write_text(CONFIG.format(blocks=64))
    side = [sys.executable, "-c", SIDE, str(config), transport]
    server = subprocess.Popen([*side, hosts[0]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = next((line for line in server.stdout if line.startswith("side ")), "")  # past the libraries' logs
        *description, expected = line.split()[1:] or [""]
        assert description, "the prefill side printed no description"
        reader = subprocess.run([*side, hosts[1], " ".join(description)], capture_output=True, text=True, timeout=240)
    finally:
        server.stdin.close()
        server.wait(60)
    reads = [line.split()[1:] for line in reader.stdout.splitlines() if line.startswith("side ")]
    assert reads == [["True", expected]] * 4, reader.stdout + reader.stderr[-2000:]


# Two processes of the torch engine: the gloo tests' cases, read in place.


@pytest.fixture(scope="module")
def processes():
    pytest.importorskip("transformers")
    pytest.importorskip("sagellm_plugin_torch")
    from . import two_processes

    return two_processes


@pytest.fixture(scope="module")
def config(processes, tmp_path_factory):
    return processes.tiny_config(tmp_path_factory.mktemp("mooncake"))


@pytest.fixture(scope="module")
def requests(processes):
    return processes.shared_prefix_requests()


@pytest.fixture(scope="module")
def reference(processes, config, requests):
    return processes.one_instance(config, requests)


def start(front, transport, role, config, requests, faults=None, **kwargs):
    from sagellm_plugin_cluster import workers

    if role == "prefill":
        kwargs.setdefault("lease_s", 60.0)
        target = workers.run_prefill
        kwargs.update(send_timeout_s=2.0)
    else:
        target = workers.run_decode
        kwargs.setdefault("pull_timeout_s", 8.0)
    return front.start(target, config, requests, faults=faults, transport=transport, **kwargs)


@pytest.mark.engine
def test_failed_and_expired_reads_are_recomputed_with_equal_outputs(transport, processes, config, requests, reference):
    """r1's read is refused by the prefill side's engine; r3's lease ends
    once claimed, so its completed read loses its confirmation; r5's lease
    expires before the decode side claims it. The others are read in place."""
    front, started = processes.Front(), time.monotonic()
    procs = [
        start(front, transport, "prefill", config, requests, {"r3": "expire-claimed", "r5": "expire"}),
        start(front, transport, "decode", config, requests, {"r1": "error", "r3": "confirm-late", "r5": "late"}),
    ]
    processes.join(procs, started)
    results = processes.outcomes(front, requests)
    assert {rid: r["tokens"] for rid, r in results.items()} == reference
    assert {rid: r["status"] for rid, r in results.items()} == {
        "r0": "done", "r1": "failed", "r2": "done", "r3": "expired", "r4": "done", "r5": "expired",
    }  # fmt: skip
    decoded, prefilled = front.read("report/p0-d0/decode"), front.read("report/p0-d0/prefill")
    processes.whole(decoded)
    processes.whole(prefilled)
    counts = decoded["counts"]
    assert (counts["done"], counts["failed"], counts["expired"]) == (3, 1, 2)
    assert counts["blocks"] > 0
    assert counts["recomputed_tokens"] == sum(requests[i].num_prompt_tokens for i in (1, 3, 5))
    assert prefilled["leases"] == {"done": 3, "failed": 1, "expired": 2}
    assert prefilled["expired_claimed"] == 1


@pytest.mark.engine
def test_a_prefill_killed_mid_transfer(transport, processes, config, requests, reference):
    """The prefill process offers r3 and exits: the decode side's read of
    its memory fails (or finds nothing to read), and it computes r3 itself."""
    served = requests[:4]
    front, started = processes.Front(), time.monotonic()
    procs = [
        start(front, transport, "prefill", config, served, {"r3": "exit-after-offer"}),
        start(front, transport, "decode", config, served),
    ]
    processes.join(procs, started)
    assert procs[0].exitcode == 17
    results = processes.outcomes(front, served)
    assert {rid: r["tokens"] for rid, r in results.items()} == {r.request_id: reference[r.request_id] for r in served}
    assert [r["status"] for r in results.values()] == ["done", "done", "done", "failed"]
    processes.whole(front.read("report/p0-d0/decode"))


@pytest.mark.engine
def test_a_decode_restarting_takes_over_the_claim_its_predecessor_left(
    transport, processes, config, requests, reference
):
    """The decode process exits after claiming r2; a new one serves r2
    onwards: it takes r2's claim over (a later epoch on the link) and reads
    the blocks the lease still holds, then r3 onwards (their leases outlast
    its start). Every request is read in place, with the outputs of one
    instance alone, and every lease ends done."""
    front, started = processes.Front(), time.monotonic()
    procs = [
        start(front, transport, "prefill", config, requests, lease_s=75.0),
        start(front, transport, "decode", config, requests, {"r2": "exit-after-claim"}),
    ]
    procs[1].join(processes.BUDGET_S)
    assert procs[1].exitcode == 17
    procs.append(start(front, transport, "decode", config, requests[2:]))
    processes.join(procs, started)
    results = processes.outcomes(front, requests)
    assert {rid: r["tokens"] for rid, r in results.items()} == reference
    assert [r["status"] for r in results.values()] == ["done"] * 6
    prefilled, decoded = front.read("report/p0-d0/prefill"), front.read("report/p0-d0/decode")
    processes.whole(prefilled)
    processes.whole(decoded)
    assert prefilled["leases"] == {"done": 6, "failed": 0, "expired": 0}
    assert prefilled["expired_claimed"] == 0
    assert decoded["counts"]["done"] == 4 and decoded["counts"]["recomputed_tokens"] == 0
    assert not [k for r in requests for k in (f"kv/p0-d0/lease/{r.request_id}", f"kv/p0-d0/blocks/{r.request_id}")
                if front.store.check([k])]  # fmt: skip


@pytest.mark.engine
def test_a_stopped_peer_ends_the_read_within_its_bound_and_frees_the_landing(
    transport, processes, config, requests, reference
):
    """The prefill process offers r3 and stops (SIGSTOP: its connections
    stay open, nothing answers), its transport on a second loopback address.
    The decode side's read of r3 is still running at the read's own
    deadline: the pull ends failed (well before the pull's own deadline)
    and r3 is computed. No pull follows, yet the landing is freed: NIXL
    cancels the read; Mooncake's read returns once its progress timeout
    (``MC_TCP_PROGRESS_TIMEOUT_SEC``, set to the read's deadline) passes,
    within the read's deadline plus ``REAP_SLACK_S`` (``reads_past_bound``
    counts one that does not). Mooncake's only: NIXL's reads on one
    machine go by UCX's cross-memory attach (``cma``), which, like RDMA,
    reads a stopped process's memory without it (its read of r3 ended
    done), and over UCX's TCP alone the
    case is not established (docs/benchmarks/disaggregation.md)."""
    import os
    import signal

    if transport != "mooncake":
        pytest.skip("a stopped peer stalls a read over Mooncake's TCP; see the docstring for NIXL")

    served = requests[:4]
    front, started = processes.Front(), time.monotonic()
    prefill = start(front, transport, "prefill", config, served, {"r3": "stop-after-offer"}, host="127.0.0.2")
    decode = start(front, transport, "decode", config, served, host="127.0.0.3", pull_timeout_s=60.0)
    try:
        processes.join([decode], started)
    finally:
        os.kill(prefill.pid, signal.SIGKILL)
        prefill.join(30)
    results = processes.outcomes(front, served)
    assert {rid: r["tokens"] for rid, r in results.items()} == {r.request_id: reference[r.request_id] for r in served}
    assert [r["status"] for r in results.values()] == ["done", "done", "done", "failed"]
    decoded = front.read("report/p0-d0/decode")
    processes.whole(decoded)  # every landing freed: nothing in flight, the accounting whole
    assert decoded["parked"] == 0 and decoded["reads_past_bound"] == 0
    assert decoded["counts"]["failed"] == 1 and decoded["counts"]["expired"] == 0
