"""Fuzz of the gloo link's control messages: any text where a decode side
writes its claim ends the lease without leaking a block or raising, and
the parsers accept exactly the messages they are given."""

from __future__ import annotations

import datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from sagellm_plugin_cluster.gloo import DecodePuller, KVTensors, PrefillServer, parse_claim, parse_offer  # noqa: E402

from sagellm_core.types import KVCaches  # noqa: E402

from .conftest import compute, prompt, runtime  # noqa: E402

TEXT = st.one_of(
    st.text(max_size=40),
    st.builds(lambda *parts: " ".join(parts), st.sampled_from(["pull", "offer", "declined", "expired"]),
              *[st.sampled_from(["0", "1", "3", "-1", "x", "99", ""]) for _ in range(3)]),
)  # fmt: skip


@given(TEXT)
def test_the_parsers_take_what_they_are_given_and_nothing_else(value):
    offer, claim = parse_offer(value), parse_claim(value)
    if offer is not None:
        assert value.split() == ["offer", str(offer[0]), str(offer[1])] and offer[0] > 0
    if claim is not None:
        assert value.split() == ["pull", *map(str, claim)]
    assert offer is None or claim is None


@pytest.fixture(scope="module")
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)


@settings(max_examples=40, deadline=None)
@given(value=TEXT)
def test_any_claim_ends_the_lease_with_nothing_held(store, value):
    rt = runtime()
    kv = KVTensors()
    rt.host.pm.register(kv)
    rt.register_kv_caches(KVCaches(torch.zeros(rt.num_blocks, 2, 4), 0))
    server = PrefillServer(rt, kv, store, f"fuzz-{abs(hash(value))}", lease_s=60.0, send_timeout_s=0.05)
    request = prompt(0)
    compute(rt, request)
    assert server.offer(request, 0.0) == 4
    store.set(f"kv/{server.link}/lease/r0", value)
    server.poll(1.0)
    offered = value == "offer 4 32"
    assert server.busy == offered
    if not offered:
        assert not server.leases.open and sum(server.leases.ended.values()) == 1
        assert server.send_failures == (1 if (c := parse_claim(value)) and 0 <= c[0] < c[0] + c[1] <= 4 else 0)
    rt.check_invariants()


def test_the_decode_side_sees_what_the_prefill_side_offers(store):
    """The decode side as a KV source: the blocks on offer, none once claimed."""
    prefill, decode = runtime(), runtime()
    kv = KVTensors()
    prefill.host.pm.register(kv)
    prefill.register_kv_caches(KVCaches(torch.zeros(prefill.num_blocks, 2, 4), 0))
    server = PrefillServer(prefill, kv, store, "source", lease_s=60.0, send_timeout_s=0.05)
    puller = DecodePuller(decode, KVTensors(), store, "source")
    request = prompt(0)
    assert puller.num_blocks_available(request) == 0
    compute(prefill, request)
    server.offer(request, 0.0)
    assert puller.num_blocks_available(request) == server.leases.num_blocks_available(request) == 4
    store.set("kv/source/lease/r0", "declined")
    server.poll(1.0)
    assert puller.num_blocks_available(request) == server.leases.num_blocks_available(request) == 0
    prefill.check_invariants()


# The in-place links' messages (Mooncake, NIXL): the claim (``read <start> <count> <epoch>``), the
# peer's description and the leased block ids.

READS = st.one_of(
    TEXT,
    st.builds(lambda *parts: " ".join(parts), st.sampled_from(["read", "done", "failed", "expired", "offer"]),
              *[st.sampled_from(["0", "1", "3", "4", "-1", "x", ""]) for _ in range(3)]),
)  # fmt: skip


@given(READS, st.text(max_size=60), st.integers(0, 6), st.integers(1, 8))
def test_the_inplace_parsers_take_what_they_are_given_and_nothing_else(value, text, count, num_blocks):
    from sagellm_plugin_cluster.inplace import parse_ids, parse_peer, parse_read

    read = parse_read(value)
    if read is not None:
        assert value.split() == ["read", *map(str, read)]
    assert read is None or parse_offer(value) is None
    for kind in ("mooncake", "nixl"):
        peer = parse_peer(text, kind)
        if peer is not None:
            assert text.split()[0] == kind and peer.nbytes > 0
    ids = parse_ids(text, count, num_blocks)
    if ids is not None:
        assert len(ids) == count and all(0 <= i < num_blocks for i in ids)
        assert ",".join(map(str, ids)).split(",") == [str(int(p)) for p in text.split(",")]


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def inplace_prefill(request):
    """An in-place transport's prefill side, skipped where its package is missing."""
    from sagellm_plugin_cluster import transports

    from sagellm_core.errors import ConfigError

    try:
        return request.param, transports.load(request.param)[0]
    except ConfigError as exc:
        pytest.skip(str(exc))


INPLACE_KV = torch.zeros(64, 2, 4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=READS, past_deadline=st.booleans())
def test_any_word_of_an_inplace_decode_side_ends_the_lease_with_nothing_held(
    store, inplace_prefill, value, past_deadline
):
    """Whatever the decode side leaves in the lease's key, the prefill side
    ends the lease (at once, or at its deadline while it is an offer or a
    claim) and holds nothing afterwards."""
    from sagellm_plugin_cluster.inplace import parse_read

    name, prefill_side = inplace_prefill
    rt = runtime()
    kv = KVTensors()
    rt.host.pm.register(kv)
    rt.register_kv_caches(KVCaches(INPLACE_KV, 0))  # one tensor: registered once, as an engine's
    link = f"fuzz-{name}-{abs(hash((value, past_deadline)))}"
    server = prefill_side(rt, kv, store, link, lease_s=60.0, send_timeout_s=0.05)
    request = prompt(0)
    compute(rt, request)
    assert server.offer(request, 0.0) == 4
    store.set(f"kv/{link}/lease/r0", value)
    server.poll(61.0 if past_deadline else 1.0)
    waiting = value == "offer 4 32" or parse_read(value) is not None
    assert server.busy == (waiting and not past_deadline)
    if not server.busy:
        assert not server.leases.open and sum(server.leases.ended.values()) == 1
        # "expired" is left for the decode side to read; the decode side's own last word is deleted
        assert (store.get(f"kv/{link}/lease/r0").decode() if waiting else store.check([f"kv/{link}/lease/r0"])) == (
            "expired" if waiting else False
        )
        assert not store.check([f"kv/{link}/blocks/r0"])
    rt.check_invariants()
