"""The router's index: exact while every batch arrives in order, degraded
at a gap or after a restart (no cached block reported anywhere), exact
again after a replay, and then equal to an index that missed nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sagellm_plugin_cluster.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventFormatError,
    KVEventBatch,
    KVEventPublisher,
    encode,
)
from sagellm_plugin_cluster.index import KVIndex


def stored(*keys: int, medium: str = "GPU") -> BlockStored:
    return BlockStored(list(keys), None, [], 16, None, medium, None)


def batch(*events) -> bytes:
    return encode(KVEventBatch(0.0, list(events)))


def test_lookup_counts_the_device_run_then_the_lower_tier_run():
    index = KVIndex(["a"])
    index.receive("a", 0, batch(stored(1, 2), stored(3, 4, medium="CPU"), stored(9)))
    assert index.lookup("a", (1, 2, 3, 4, 5)) == (2, 2)
    assert index.lookup("a", (3, 4)) == (0, 2)
    assert index.lookup("a", (7, 1)) == (0, 0)
    index.receive("a", 1, batch(BlockRemoved([2], "GPU")))
    assert index.lookup("a", (1, 2, 3)) == (1, 0)
    index.receive("a", 2, batch(AllBlocksCleared()))
    assert index.lookup("a", (1,)) == (0, 0)


def test_a_dropped_batch_degrades_the_index_until_it_is_replayed():
    sent = []
    publisher = KVEventPublisher(16, lambda seq, payload: sent.append((seq, payload)))
    index = KVIndex(["a", "b"])
    index.receive("b", 0, batch(stored(1, 2)))
    for keys in ((1, 2), (3,), (4,)):
        publisher.sagellm_blocks_cached(tuple(_blocks(keys)))
        publisher.flush(0.0)
    index.receive("a", *sent[0])
    # Batch 1 is lost on its way; batch 2 shows the gap.
    assert index.receive("a", *sent[2]) is False
    assert not index.exact and index.degraded() == {"a": 1} and index.gaps == 1
    assert index.lookup("b", (1, 2)) == (0, 0)  # load alone, on every instance, while degraded
    index.replay("a", publisher.replay(1))
    assert index.exact
    assert index.lookup("b", (1, 2)) == (2, 0)
    assert index.lookup("a", (1, 2)) == (2, 0) and index.lookup("a", (3,)) == (1, 0)
    assert index.receive("a", *sent[2]) is False  # delivered twice: applied once


def _blocks(keys):
    from sagellm_core.types import CachedBlock

    parent = None
    for depth, key in enumerate(keys):
        yield CachedBlock(key * 10 + depth, depth, parent, key)
        parent = key * 10 + depth


def test_a_restarted_router_is_degraded_until_it_replays_from_the_first_batch():
    sent = []
    publisher = KVEventPublisher(16, lambda seq, payload: sent.append((seq, payload)))
    before = KVIndex(["a"])
    publisher.cleared()
    for keys in ((1, 2), (5,)):
        publisher.sagellm_blocks_cached(tuple(_blocks(keys)))
        publisher.flush(0.0)
    for seq, payload in sent:
        before.receive("a", seq, payload)
    restarted = KVIndex(["a"], known=False)
    assert not restarted.exact and restarted.degraded() == {"a": 0}
    publisher.sagellm_blocks_cached(tuple(_blocks((7,))))
    publisher.flush(1.0)
    assert restarted.receive("a", *sent[-1]) is False  # not applied: it has not caught up
    restarted.replay("a", publisher.replay(0))
    before.receive("a", *sent[-1])
    assert restarted.exact
    for keys in ((1, 2), (5,), (7,), (2,)):
        assert restarted.lookup("a", keys) == before.lookup("a", keys)


def test_a_replay_the_publisher_cannot_give_resets_the_entry():
    index = KVIndex(["a"])
    index.receive("a", 0, batch(stored(1)))
    index.receive("a", 5, batch(stored(2)))
    index.replay("a", None)
    assert index.exact and index.resets == 1
    assert index.lookup("a", (1,)) == (0, 0)  # forgotten: never credited again without an event
    assert index.receive("a", 9, batch(stored(3))) is True
    assert index.lookup("a", (3,)) == (1, 0)


def test_garbage_changes_nothing():
    index = KVIndex(["a"])
    index.receive("a", 0, batch(stored(1)))
    with pytest.raises(EventFormatError):
        index.receive("a", 1, b"\x93\x01")
    assert index.receive("a", 1, batch(stored(2))) is True
    with pytest.raises(KeyError, match="unknown instance"):
        index.receive("z", 0, batch())


events = st.lists(
    st.one_of(
        st.builds(stored, st.integers(0, 20), st.integers(0, 20)),
        st.builds(lambda k, m: BlockRemoved([k], m), st.integers(0, 20), st.sampled_from(["GPU", "CPU"])),
        st.builds(lambda k: stored(k, medium="CPU"), st.integers(0, 20)),
        st.just(AllBlocksCleared()),
    ),
    max_size=4,
)


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(events, min_size=1, max_size=12), lost=st.sets(st.integers(0, 11)), restart=st.booleans())
def test_any_losses_then_a_replay_leave_the_index_equal_to_a_lossless_one(batches, lost, restart):
    payloads = [(seq, batch(*evs)) for seq, evs in enumerate(batches)]
    lossless = KVIndex(["a"])
    for seq, payload in payloads:
        lossless.receive("a", seq, payload)
    lossy = KVIndex(["a"], known=not restart)
    for seq, payload in payloads:
        if seq not in lost:
            lossy.receive("a", seq, payload)
    missing = lossy.degraded().get("a")
    dropped = [seq for seq in lost if seq < len(payloads)]
    if missing is None and dropped:  # lost at the end: the next batch would show the gap
        missing = min(dropped)
    if missing is not None:
        lossy.replay("a", [p for p in payloads if p[0] >= missing])
    for key in range(21):
        assert lossy.lookup("a", (key,)) == lossless.lookup("a", (key,))
