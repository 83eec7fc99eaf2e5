"""The host store on its own: what it writes it gives back byte for byte
(with the checksum recorded at the put), the oldest row is reused when it
is full, pinned blocks stay, and its admission declines offloads that never
come back."""

import numpy as np
import pytest
from sagellm_plugin_kv_stores.host import PROBE_EVERY, HostSettings, HostStore

from sagellm_core import PluginContext
from sagellm_core.types import CachedBlock, KVCaches, block_checksum

NUM_BLOCKS = 8


def store(capacity: int, kv: KVCaches) -> HostStore:
    host = HostStore(HostSettings(capacity_blocks=capacity), PluginContext("host", 16, NUM_BLOCKS))
    host.sagellm_kv_caches_allocated(kv_caches=kv)
    return host


def byte_kv() -> KVCaches:
    rows = np.arange(NUM_BLOCKS * 32, dtype=np.uint8).reshape(NUM_BLOCKS, 32)
    return KVCaches(rows, 0)


def blocks(*pairs: tuple[int, int]) -> tuple[CachedBlock, ...]:
    """(block id, key) pairs as cached blocks."""
    return tuple(CachedBlock(block_id, depth, None, key) for depth, (block_id, key) in enumerate(pairs))


def read_back(host: HostStore, kv: KVCaches, keys, into) -> None:
    stored = host.get(keys).result()
    assert [block_checksum(v) for v in stored.views] == list(stored.checksums)
    kv.copy(stored.source, stored.row_ids, kv.tensor, into)


def test_blocks_come_back_byte_for_byte():
    kv = byte_kv()
    before = kv.tensor.copy()
    host = store(4, kv)
    assert host.put(blocks((5, 50), (2, 20))).result() == 2
    assert host.contains([50, 20, 99]) == 2 and host.contains([20]) == 1 and host.contains([99, 50]) == 0
    kv.tensor[:] = 0
    read_back(host, kv, [50, 20], [0, 7])
    assert (kv.tensor[0] == before[5]).all() and (kv.tensor[7] == before[2]).all()


def test_torch_kv_along_its_block_dimension():
    torch = pytest.importorskip("torch")
    tensor = torch.randn(2, 2, NUM_BLOCKS, 4, 3, dtype=torch.bfloat16)  # layers, K/V, blocks, tokens, heads
    kv = KVCaches(tensor, 2)
    before = tensor.clone()
    host = store(3, kv)
    assert host.put(blocks((1, 10), (6, 60))).result() == 2
    tensor.zero_()
    read_back(host, kv, [60, 10], [3, 4])
    assert torch.equal(tensor[:, :, 3], before[:, :, 6]) and torch.equal(tensor[:, :, 4], before[:, :, 1])


def test_blocks_adjacent_on_the_device_land_in_adjacent_rows_whatever_order_they_come_in():
    kv = byte_kv()
    host = store(6, kv)
    # An eviction round in LRU's order: a prefix's tail first.
    assert host.put(blocks((6, 60), (5, 50), (4, 40), (3, 30))).result() == 4
    rows = host.get([30, 40, 50, 60]).result().row_ids
    assert list(rows) == list(range(rows[0], rows[0] + 4)), "the prefix's rows are one run, in prefix order"
    before = kv.tensor.copy()
    kv.tensor[:] = 0
    read_back(host, kv, [30, 40, 50, 60], [0, 1, 2, 3])
    assert (kv.tensor[0:4] == before[3:7]).all()


def test_a_full_store_reuses_the_row_written_longest_ago():
    host = store(2, byte_kv())
    host.put(blocks((0, 1), (1, 2)))
    host.get([1, 2])  # a read: the store keeps taking every round
    host.put(blocks((2, 3)))
    assert host.contains([1]) == 0 and host.contains([2, 3]) == 2
    assert host.put(blocks((3, 4), (4, 5), (5, 6))).result() == 0  # more than it holds: nothing written
    assert host.contains([2]) == 1


def test_a_pinned_block_is_not_overwritten_and_a_removed_one_is_gone():
    host = store(2, byte_kv())
    host.put(blocks((0, 1), (1, 2)))
    host.pin([1])
    host.put(blocks((2, 3)))
    assert host.contains([1]) == 1 and host.contains([2]) == 0
    host.unpin([1])
    host.remove([3])
    assert host.contains([3]) == 0 and host.prefetch([1, 3]).result() == 1


def test_offloads_that_never_come_back_are_declined_but_for_probes():
    host = store(4, byte_kv())
    key = iter(range(1, 10_000))
    written = 0
    while not host.declining:
        written += host.put(blocks((0, next(key)), (1, next(key)))).result()
    assert written == host.written_since_read == 2 * len(host.index) == 8
    probed = []
    for _ in range(2 * PROBE_EVERY):
        keys = (next(key), next(key))
        if host.put(blocks((0, keys[0]), (1, keys[1]))).result():
            probed.append(keys)
    assert len(probed) == 2  # one round in PROBE_EVERY is written
    host.get(probed[-1])  # a read opens the store again
    assert not host.declining and host.put(blocks((0, next(key)))).result() == 1
