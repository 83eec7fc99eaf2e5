"""The byte ranges an in-place transport reads: copying them moves exactly
the blocks asked for, into exactly the blocks given, whatever the ids and
the layout, in as few ranges as the runs of ids allow."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from sagellm_plugin_cluster.kv_tensors import KVTensors, TransportError, runs, segments  # noqa: E402

from sagellm_core.types import KVCaches  # noqa: E402


def kv_of(tensor, block_dim):
    kv = KVTensors()
    kv.sagellm_kv_caches_allocated(KVCaches(tensor, block_dim))
    return kv


@st.composite
def transfers(draw):
    block_dim = draw(st.integers(0, 2))
    shape = [draw(st.integers(1, 3)) for _ in range(3)]
    src_blocks, dst_blocks = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    count = draw(st.integers(0, min(src_blocks, dst_blocks)))
    src_ids = draw(st.permutations(range(src_blocks)))[:count]
    dst_ids = draw(st.permutations(range(dst_blocks)))[:count]
    return block_dim, shape, src_blocks, dst_blocks, tuple(src_ids), tuple(dst_ids)


@given(transfers())
def test_copying_the_segments_copies_the_blocks(case):
    block_dim, shape, src_blocks, dst_blocks, src_ids, dst_ids = case
    src_shape, dst_shape = list(shape), list(shape)
    src_shape.insert(block_dim, src_blocks)
    dst_shape.insert(block_dim, dst_blocks)
    src = torch.arange(torch.Size(src_shape).numel(), dtype=torch.float32).reshape(src_shape)
    dst = torch.full(dst_shape, -1.0)
    src_layout, dst_layout = kv_of(src, block_dim).layout(), kv_of(dst, block_dim).layout()
    found = segments(src_layout, src_ids, dst_layout, dst_ids)
    src_bytes, dst_bytes = src.view(torch.uint8).flatten(), dst.view(torch.uint8).flatten()
    for s, d, length in found:
        dst_bytes[d : d + length] = src_bytes[s : s + length]
    expected = torch.full(dst_shape, -1.0)
    if src_ids:
        expected.index_copy_(block_dim, torch.tensor(dst_ids), src.index_select(block_dim, torch.tensor(src_ids)))
    assert torch.equal(dst, expected)
    outer = torch.Size(shape[:block_dim]).numel()
    assert len(found) == outer * len(runs(src_ids, dst_ids))


@settings(deadline=None)  # a loaded machine's thread pool, not the test, sets its time
@given(st.lists(st.lists(st.integers(0, 9), unique=True, min_size=1, max_size=10), min_size=1, max_size=4))
def test_gathered_blocks_scatter_back_through_kept_buffers(pulls):
    """gloo's copies: each pull's blocks gathered into the kept send buffer
    and scattered from the kept receive buffer land where they belong,
    whatever the sizes of the pulls before (the buffers are reused)."""
    src = torch.randn(2, 3, 10, 4)
    prefill, decode = kv_of(src, 2), kv_of(torch.zeros(2, 3, 10, 4), 2)
    for ids in pulls:
        ids = tuple(ids)
        dst_ids = tuple(reversed(ids))
        received = decode.empty(len(ids))
        received.copy_(prefill.read(ids))
        decode.write(dst_ids, received)
        assert torch.equal(decode.tensor[:, :, list(dst_ids)], src[:, :, list(ids)])
    decode.drop_buffers()
    assert decode.empty(1).shape == (2, 3, 1, 4)


@given(st.lists(st.integers(0, 40), unique=True, max_size=12), st.integers(0, 30))
def test_runs_are_maximal(ids, shift):
    src = tuple(ids)
    dst = tuple(i + shift for i in ids)
    found = runs(src, dst)
    assert [s + k for s, _, n in found for k in range(n)] == list(src)
    assert all(a[0] + a[2] != b[0] for a, b in zip(found, found[1:], strict=False))


def test_only_contiguous_host_memory_is_laid_out_and_layouts_must_agree():
    with pytest.raises(TransportError, match="non-contiguous"):
        kv_of(torch.zeros(4, 6).t(), 0).layout()
    a, b = kv_of(torch.zeros(2, 4, 3), 1).layout(), kv_of(torch.zeros(2, 4, 5), 1).layout()
    with pytest.raises(ValueError, match="layouts differ"):
        segments(a, (0,), b, (0,))
    with pytest.raises(ValueError, match="1 source blocks for 2"):
        runs((0,), (0, 1))


@given(
    st.lists(
        st.tuples(st.integers(0, 9), st.integers(1, 10), st.integers(0, 9), st.booleans()), min_size=1, max_size=4
    ),
    st.integers(1, 64),
)
def test_gloo_messages_carry_the_blocks_into_the_landing(pulls, message_bytes):
    """gloo's pull, its messages copied across as gloo would: one gathered
    message, or one per slab, sent from the KV tensor itself or from the
    gathered buffer and received into the blocks themselves or into the
    buffer, whichever the ids and the size make it; the decode side's blocks
    end equal to the prefill side's, and no other block changes."""
    from sagellm_plugin_cluster import gloo

    src = torch.randn(2, 3, 10, 4)
    prefill, decode = kv_of(src, 2), kv_of(torch.zeros(2, 3, 10, 4), 2)
    old = gloo.SLAB_MESSAGE_BYTES
    gloo.SLAB_MESSAGE_BYTES = message_bytes  # bytes_per_block is 96 (6 slabs of 16 B): both modes come up
    try:
        for start, count, dst_start, shuffled in pulls:
            count = min(count, 10 - start, 10 - dst_start)
            ids = tuple(range(start, start + count))
            dst_ids = tuple(range(dst_start, dst_start + count))
            if shuffled:
                dst_ids = dst_ids[::-1]
            before = decode.tensor.clone()
            sent = gloo.outgoing(prefill, ids)
            assert len(sent) == gloo.message_count(prefill, count) in (1, 6)
            targets, in_place = gloo.incoming(decode, dst_ids, len(sent))
            assert in_place == (len(sent) == 6 and (count == 1 or not shuffled))
            for message, target in zip(sent, targets, strict=True):
                target.copy_(message)
            gloo.land(decode, dst_ids, in_place)
            expected = before.clone()
            expected[:, :, list(dst_ids)] = src[:, :, list(ids)]
            assert torch.equal(decode.tensor, expected)
    finally:
        gloo.SLAB_MESSAGE_BYTES = old


def test_gloo_refuses_a_message_count_that_is_not_its_layouts():
    from sagellm_plugin_cluster import gloo

    decode = kv_of(torch.zeros(2, 3, 10, 4), 2)
    with pytest.raises(TransportError, match="5 messages for a KV tensor of 6 slabs"):
        gloo.incoming(decode, (0, 1), 5)
    assert gloo.parse_answer("sending 6") == 6
    assert [gloo.parse_answer(v) for v in ("sending", "sending 0", "sending -1", "failed", "sending 6 1")] == [None] * 5
