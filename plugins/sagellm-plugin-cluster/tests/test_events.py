"""KV events: vLLM's wire format both ways, and what a publisher makes of
an instance's block observations and host-tier offloads."""

from __future__ import annotations

import msgspec
import pytest
from sagellm_plugin_cluster.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventFormatError,
    KVEventBatch,
    KVEventPublisher,
    decode,
    encode,
)

from sagellm_core.types import CachedBlock


# vLLM's subscriber example (examples/online_serving/kv_events_subscriber.py)
# declares these structs to decode the publisher's batches: written out here
# independently of ours, so that the test holds our bytes to theirs.
class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class VllmKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


def sample_batch() -> KVEventBatch:
    return KVEventBatch(
        12.5,
        [
            BlockStored([11, 2**64 - 1], None, [], 16, None, "GPU", None),
            BlockStored([13], 2**64 - 1, [], 16, None, "GPU", None),
            BlockRemoved([11], "GPU"),
            AllBlocksCleared(),
        ],
    )


def test_our_batches_decode_with_vllms_own_subscriber_structs():
    theirs = msgspec.msgpack.Decoder(VllmKVEventBatch).decode(encode(sample_batch()))
    assert theirs.ts == 12.5
    stored, child, removed, cleared = theirs.events
    assert (stored.block_hashes, stored.parent_block_hash, stored.block_size, stored.medium) == (
        [11, 2**64 - 1],
        None,
        16,
        "GPU",
    )
    assert child.parent_block_hash == 2**64 - 1
    assert (removed.block_hashes, removed.medium) == ([11], "GPU")
    assert isinstance(cleared, VllmAllBlocksCleared)


def test_a_batch_round_trips():
    assert decode(encode(sample_batch())) == sample_batch()


def test_the_tagged_map_layout_of_newer_vllm_decodes_too():
    payload = msgspec.msgpack.encode(
        [
            3.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [5, 6],
                    "parent_block_hash": 4,
                    "token_ids": [1],
                    "block_size": 2,
                },
                {"type": "BlockRemoved", "block_hashes": [6], "medium": "CPU"},
                {"type": "AllBlocksCleared"},
            ],
            1,
        ]
    )
    batch = decode(payload)
    assert batch.events == [
        BlockStored([5, 6], 4, [1], 2, None, None, None),
        BlockRemoved([6], "CPU"),
        AllBlocksCleared(),
    ]
    assert batch.data_parallel_rank == 1
    as_map = msgspec.msgpack.encode({"ts": 4.0, "events": [{"type": "AllBlocksCleared"}]})
    assert decode(as_map) == KVEventBatch(4.0, [AllBlocksCleared()])


@pytest.mark.parametrize(
    "payload", [b"", b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode([1.0, [["Nope"]]])]
)
def test_what_is_not_a_batch_is_named(payload):
    with pytest.raises(EventFormatError, match="not a KV event batch"):
        decode(payload)


def chain(*ids: int, parent: int | None = None, depth: int = 0) -> tuple[CachedBlock, ...]:
    out = []
    for i, block_id in enumerate(ids):
        out.append(CachedBlock(block_id, depth + i, parent, block_id * 100))
        parent = block_id
    return tuple(out)


@pytest.fixture
def sent():
    return []


@pytest.fixture
def publisher(sent):
    return KVEventPublisher(16, lambda seq, payload: sent.append((seq, decode(payload))), buffer_batches=3)


def test_cached_blocks_become_stored_runs_with_their_parents_key(publisher, sent):
    publisher.sagellm_blocks_cached(chain(1, 2))
    # Two runs in one observation: under block 2, and a new root.
    publisher.sagellm_blocks_cached(chain(3, parent=2, depth=2) + chain(7))
    assert publisher.flush(1.0) == 0
    seq, batch = sent[0]
    assert (seq, batch.ts) == (0, 1.0)
    assert [(e.block_hashes, e.parent_block_hash, e.medium) for e in batch.events] == [
        ([100, 200], None, "GPU"),
        ([300], 200, "GPU"),
        ([700], None, "GPU"),
    ]


def test_evicted_blocks_become_removed(publisher, sent):
    publisher.sagellm_blocks_cached(chain(1, 2))
    publisher.sagellm_blocks_evicted(chain(1, 2))
    publisher.flush(0.0)
    assert sent[0][1].events[-1] == BlockRemoved([100, 200], "GPU")


def test_batches_are_numbered_and_kept_for_replay(publisher, sent):
    assert publisher.flush(0.0) is None  # nothing gathered, nothing sent
    for n in range(5):
        publisher.sagellm_blocks_cached(chain(n + 1))
        assert publisher.flush(float(n)) == n
    assert [seq for seq, _ in sent] == [0, 1, 2, 3, 4]
    assert [seq for seq, _ in publisher.replay(3)] == [3, 4]
    assert publisher.replay(5) == []
    assert publisher.replay(1) is None  # only the last three are kept
    publisher.cleared()
    publisher.flush(9.0)
    assert sent[-1][1].events == [AllBlocksCleared()]
