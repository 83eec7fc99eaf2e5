"""Fuzz: KV event payloads from a peer that cannot be trusted. Whatever the
bytes, decoding gives a batch or an EventFormatError, and an index fed
garbage is exactly as it was."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
from sagellm_plugin_cluster.events import BlockStored, EventFormatError, KVEventBatch, decode, encode
from sagellm_plugin_cluster.index import KVIndex

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)
event_like = st.lists(
    st.one_of(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]), msgpack_values), max_size=8
)
payloads = st.one_of(
    st.binary(max_size=64),
    msgpack_values.map(msgspec.msgpack.encode),
    st.tuples(st.floats(allow_nan=False), st.lists(event_like, max_size=4)).map(
        lambda t: msgspec.msgpack.encode([t[0], t[1]])
    ),
)


@settings(max_examples=400, deadline=None)
@given(payload=payloads)
def test_any_payload_decodes_to_a_batch_or_is_refused_by_name(payload):
    try:
        batch = decode(payload)
    except EventFormatError as exc:
        assert str(exc).startswith("not a KV event batch") and "\n" not in str(exc)
        return
    assert isinstance(batch, KVEventBatch)
    if batch.ts == batch.ts:  # (a NaN time is carried, but is not equal to itself)
        assert decode(encode(batch)) == batch


@settings(max_examples=200, deadline=None)
@given(payload=payloads, seq=st.integers(0, 3))
def test_an_index_fed_garbage_is_unchanged(payload, seq):
    index = KVIndex(["a"])
    index.receive("a", 0, encode(KVEventBatch(0.0, [BlockStored([7, 8], None, [], 16, None, "GPU", None)])))
    before = (index.lookup("a", (7, 8)), index.degraded(), index.applied)
    try:
        index.receive("a", seq, payload)
    except EventFormatError:
        assert (index.lookup("a", (7, 8)), index.degraded(), index.applied) == before
