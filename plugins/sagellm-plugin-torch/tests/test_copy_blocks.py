"""The device's block copy (``copy_blocks``) inside the KV tensor, to host
rows laid out as the host store's (block-major, seen through the KV
tensor's block dimension) and back: every destination block equals its
source block as it was before the copy, every other block is untouched,
whether the ids come as runs (copied a run at a time) or scattered
(gathered by index). On the CPU always; on a GPU where there is one."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sagellm_plugin_torch.devices import BLOCK_DIM, MIN_MEAN_RUN, copy_runs, load_device

NUM_BLOCKS = 40
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def kv_tensor(device: str) -> torch.Tensor:
    # [layers, K/V, blocks, block_size, kv_heads, head_dim], each element distinct.
    shape = (2, 2, NUM_BLOCKS, 4, 2, 3)
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape).to(device)


def host_rows(kv: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-major host rows and their view through the block dimension (as ``HostRows``)."""
    per_block = tuple(kv.shape[:BLOCK_DIM]) + tuple(kv.shape[BLOCK_DIM + 1 :])
    rows = -torch.ones((capacity, *per_block), dtype=kv.dtype, pin_memory=kv.is_cuda)
    return rows, rows.movedim(0, BLOCK_DIM)


@st.composite
def block_ids(draw, limit: int = NUM_BLOCKS) -> tuple[list[int], list[int]]:
    """Distinct source and destination ids: runs of adjacent ids on both
    sides, or any distinct ids, or runs on one side only."""
    n = draw(st.integers(0, limit // 2))
    ids = st.permutations(range(limit)).map(lambda p: p[:n])

    def runs() -> st.SearchStrategy[list[int]]:
        start = st.integers(0, limit - n)
        return start.map(lambda s: list(range(s, s + n)))

    return draw(st.one_of(runs(), ids)), draw(st.one_of(runs(), ids))


@given(ids=block_ids())
def test_runs_spell_out_the_ids(ids):
    src_ids, dst_ids = ids
    a, b = torch.zeros(2, 2, NUM_BLOCKS), torch.zeros(2, 2, NUM_BLOCKS)
    runs = copy_runs(a, src_ids, b, dst_ids)
    if runs is None:  # scattered: fewer than MIN_MEAN_RUN blocks a run on average
        return
    assert [i for s, _, n in runs for i in range(s, s + n)] == src_ids
    assert [i for _, d, n in runs for i in range(d, d + n)] == dst_ids
    assert len(runs) * MIN_MEAN_RUN <= len(src_ids) or not src_ids


def test_a_copy_inside_one_tensor_that_writes_what_it_reads_is_gathered():
    kv = torch.zeros(2, 2, NUM_BLOCKS)
    assert copy_runs(kv, [0, 1, 2, 3, 4], kv, [2, 3, 4, 5, 6]) is None
    assert copy_runs(kv, [0, 1, 2, 3], kv, [10, 11, 12, 13]) == [(0, 10, 4)]


def test_unequal_id_lists_are_refused():
    kv = torch.zeros(2, 2, NUM_BLOCKS)
    with pytest.raises(ValueError, match="3 source blocks for 2 destination blocks"):
        copy_runs(kv, [0, 1, 2], kv, [4, 5])


@pytest.mark.parametrize("name", DEVICES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=block_ids(), where=st.sampled_from(["inside", "offload", "reload"]))
def test_every_destination_block_gets_its_source_block_and_nothing_else_changes(name, ids, where):
    device = load_device(name)
    src_ids, dst_ids = ids
    kv = kv_tensor(name)
    rows, host = host_rows(kv, NUM_BLOCKS)
    if where == "inside":
        src, dst = kv, kv
    elif where == "offload":
        src, dst = kv, host
    else:  # reload: the host rows hold other content than the KV tensor
        rows.copy_(torch.randn(rows.shape))
        src, dst = host, kv
    before_src, before_dst = src.clone().cpu(), dst.clone().cpu()
    device.copy_blocks(src, src_ids, dst, dst_ids)
    device.synchronize()
    after = dst.cpu()
    expected = before_dst.clone()
    for s, d in zip(src_ids, dst_ids):
        expected.select(BLOCK_DIM, d).copy_(before_src.select(BLOCK_DIM, s))
    assert torch.equal(after, expected)
    if where != "inside":
        assert torch.equal(src.cpu(), before_src)  # the source is read, never written
