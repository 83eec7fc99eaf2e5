"""Each store's own eviction policy (``[kv_stores.NAME] eviction``): a
fresh instance of an installed ``sagellm.eviction`` policy per store
(``sagellm_core.kit.store_eviction``). LRU through the policy keeps what a
reference LRU keeps; the disk store under ``lru`` deletes what its own
order deletes; the host store under ``lfu`` keeps a block read often where
its own order (oldest written) drops it, and gives back every block it
holds byte for byte; a policy not installed is named in one line."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from sagellm_plugin_kv_stores.disk import DiskSettings, DiskStore
from sagellm_plugin_kv_stores.host import HostSettings, HostStore

from sagellm_core import PluginContext
from sagellm_core.errors import ConfigError, PluginError
from sagellm_core.kit.store_eviction import StoreEviction
from sagellm_core.kit.testing import declare_plugins, settings_from_toml
from sagellm_core.runtime import Runtime
from sagellm_core.types import CachedBlock, KVCaches, block_checksum

NUM_BLOCKS = 8
#: A store's life: ("write", key), ("read", key), ("drop", key), ("room", n).
events = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["write", "read", "drop"]), st.integers(0, 11)),
        st.tuples(st.just("room"), st.integers(1, 3)),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(events=events)
def test_lru_through_the_policy_keeps_what_a_reference_lru_keeps(events):
    policy = StoreEviction("lru", 6, "[kv_stores.test] eviction")
    reference: OrderedDict[int, None] = OrderedDict()  # least recently written or read first
    for what, value in events:
        if what == "write":
            policy.written([value])
            reference[value] = None
            reference.move_to_end(value)
        elif what == "read" and value in reference:
            policy.read([value])
            reference.move_to_end(value)
        elif what == "drop":
            policy.dropped([value])
            reference.pop(value, None)
        elif what == "room":
            expected = list(reference)[:value]
            assert policy.make_room(value) == expected
            for key in expected:
                del reference[key]
        assert set(reference) == {key for key in range(12) if key in policy}


def test_a_pinned_block_is_never_picked():
    policy = StoreEviction("lru", 4, "[kv_stores.test] eviction")
    policy.written([1, 2, 3])
    assert policy.make_room(2, pinned={1}) == [2, 3]
    assert policy.make_room(2, pinned={1}) == []  # only the pinned one is left


def byte_kv() -> KVCaches:
    return KVCaches(np.arange(NUM_BLOCKS * 32, dtype=np.uint8).reshape(NUM_BLOCKS, 32), 0)


def host_store(capacity: int, eviction: str, kv: KVCaches) -> HostStore:
    host = HostStore(HostSettings(capacity_blocks=capacity, eviction=eviction), PluginContext("host", 4, NUM_BLOCKS))
    host.sagellm_kv_caches_allocated(kv_caches=kv)
    return host


def test_the_host_store_under_lfu_keeps_a_block_read_often():
    kept = {}
    for eviction in ("", "lfu"):
        host = host_store(3, eviction, byte_kv())
        host.put([CachedBlock(0, 0, None, 100)]).result()
        for _ in range(3):
            host.get([100]).result()  # read often
        for block_id, key in enumerate([101, 102, 103, 104], start=1):
            host.put([CachedBlock(block_id, 0, None, key)]).result()
        kept[eviction] = host.contains([100])
    assert kept == {"": 0, "lfu": 1}  # its own order drops the block written first; LFU keeps it


@settings(max_examples=40, deadline=None)
@given(events=events, eviction=st.sampled_from(["lru", "lfu", "s3fifo", "arc"]))
def test_the_host_store_under_any_policy_gives_back_what_it_holds_byte_for_byte(events, eviction):
    kv = byte_kv()
    original = kv.tensor.copy()
    host = host_store(4, eviction, kv)
    for what, value in events:
        key = 1000 + value
        if what == "write":
            host.put([CachedBlock(value % NUM_BLOCKS, 0, None, key)]).result()
        elif what == "read" and host.contains([key]):
            stored = host.get([key]).result()
            assert block_checksum(stored.views[0]) == stored.checksums[0]
            assert (stored.views[0] == original[value % NUM_BLOCKS]).all()  # its own bytes
        elif what == "drop":
            host.remove([key])
        held = [k for k in range(1000, 1012) if host.contains([k])]
        assert len(held) == len(host.index) <= 4 and len(host.policy) == len(held)
        assert len(set(host.index.slots(held))) == len(held)  # a row each


def disk_store(folder, eviction: str) -> DiskStore:
    disk = DiskStore(DiskSettings(path=str(folder), capacity_blocks=3, eviction=eviction), PluginContext("disk", 4, 8))
    disk.sagellm_kv_caches_allocated(kv_caches=byte_kv())
    return disk


@settings(max_examples=20, deadline=None)
@given(events=events)
def test_the_disk_store_under_lru_deletes_what_its_own_order_deletes(tmp_path_factory, events):
    own, lru = disk_store(tmp_path_factory.mktemp("own"), ""), disk_store(tmp_path_factory.mktemp("lru"), "lru")
    for what, value in events:
        for disk in (own, lru):
            if what == "write":
                disk.put([CachedBlock(value % NUM_BLOCKS, 0, None, value)]).result()
            elif what == "read" and disk.contains([value]):
                disk.get([value]).result()
            elif what == "drop":
                disk.remove([value])
        assert [own.contains([k]) for k in range(12)] == [lru.contains([k]) for k in range(12)]
    assert own.stats() == lru.stats()


def test_a_policy_not_installed_is_named_in_one_line(tmp_path):
    text = """
[prefix_cache]
plugin = "radix"
[kv_pool]
plugin = "paged"
num_blocks = 8
[eviction]
plugin = "lru"
[kv_stores]
tiers = ["host"]
[kv_stores.host]
eviction = "nope"
"""
    with pytest.raises(
        ConfigError, match=r"\[kv_stores\.host\] eviction: unknown eviction plugin 'nope'; installed: .*lru"
    ):
        Runtime(settings_from_toml(text), hook_timing=False)


def test_a_policy_that_names_a_pinned_block_is_named_in_one_line(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.syspath_prepend(str(tmp_path))
    declare_plugins(tmp_path, {"sagellm.eviction": {"pinned-picker": "store_faults:PinnedPicker"}}, name="t-policy")
    host = host_store(2, "pinned-picker", byte_kv())
    host.put([CachedBlock(0, 0, None, 100), CachedBlock(1, 0, None, 101)]).result()
    host.pin([100])
    with pytest.raises(
        PluginError,
        match=r"^\[kv_stores\.host\] eviction: eviction policy 'pinned-picker' chose .* for 1 of the 1 blocks",
    ):
        host.put([CachedBlock(2, 0, None, 102)])
    assert host.contains([100]) == host.contains([101]) == 1  # nothing dropped
