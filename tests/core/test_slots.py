"""SlotIndex: the slots of a fixed-size tier (the host store's, the KV
connectors'): free slots lowest first, then the oldest written; a reused
slot forgets its content; pinned content is passed over."""

from hypothesis import given
from hypothesis import strategies as st

from sagellm_core.kit.slots import SlotIndex


def test_free_slots_go_lowest_first_then_the_oldest_written():
    index = SlotIndex(3)
    assert index.place(["a", "b"]) == [0, 1]
    assert index.place(["c", "d"]) == [2, 0]  # one free slot, then the oldest written
    assert index.place(["e", "f", "g"]) == [1, 2, 0]
    assert "a" not in index and "b" not in index and index.slots(["e", "f", "g"]) == [1, 2, 0]


def test_more_keys_than_the_tier_holds_change_nothing():
    index = SlotIndex(2)
    index.place(["a"])
    assert index.place(["b", "c", "d"]) is None
    assert index.slots(["a"]) == [0] and len(index) == 1


def test_content_saved_again_moves_to_its_new_slot():
    index = SlotIndex(3)
    index.place(["a"])
    assert index.place(["a"]) == [1]  # evicted again after a reload: a new copy
    assert index.slots(["a"]) == [1] and len(index) == 1
    index.place(["b"])  # the last free slot
    assert index.place(["c"]) == [0]  # the old copy's slot, the oldest written
    assert index.slots(["a", "b", "c"]) == [1, 2, 0]


def test_leading_counts_from_the_first_key():
    index = SlotIndex(4)
    index.place(["a", "b", "d"])
    assert index.leading(["a", "b", "c", "d"]) == 2 and index.leading(["c", "a"]) == 0


def test_pinned_content_is_passed_over_and_stays_the_oldest():
    index = SlotIndex(2)
    index.place(["a", "b"])
    index.pin(["a"])
    assert index.place(["c"]) == [1]  # b's slot: a's is pinned
    assert index.place(["d", "e"]) is None  # only one slot is not pinned
    index.unpin(["a"])
    assert index.place(["d"]) == [0]  # a's, still the oldest written
    assert "a" not in index and index.slots(["c", "d"]) == [1, 0]


def test_a_forgotten_key_is_not_held_and_its_slot_is_reused_in_turn():
    index = SlotIndex(2)
    index.place(["a", "b"])
    index.forget(["a"])
    assert "a" not in index and len(index) == 1
    assert index.place(["c"]) == [0]


operations = st.lists(
    st.tuples(
        st.sampled_from(["place", "pin", "unpin", "forget"]),
        st.lists(st.integers(0, 12), min_size=1, max_size=5, unique=True),
    ),
    max_size=60,
)


@given(capacity=st.integers(1, 6), ops=operations)
def test_every_key_is_in_one_slot_of_the_tier_and_reuse_is_oldest_first(capacity, ops):
    index = SlotIndex(capacity)
    written: list[int] = []  # a model of the FIFO: slots in the order last written
    pins: dict[int, int] = {}
    for op, keys in ops:
        if op == "place":
            pinned = {index.slots([k])[0] for k in pins if k in index}
            slots = index.place(keys)
            free = [s for s in range(capacity) if s not in written]
            reusable = [s for s in written if s not in pinned]
            if len(keys) > len(free) + len(reusable):
                assert slots is None
                continue
            expected = (free + reusable)[: len(keys)]
            assert slots == expected
            written = [s for s in written if s not in expected] + expected
        elif op == "pin":
            index.pin(keys)
            for k in keys:
                pins[k] = pins.get(k, 0) + 1
        elif op == "unpin":
            index.unpin(keys)
            for k in keys:
                if k in pins:
                    pins[k] -= 1
                    if not pins[k]:
                        del pins[k]
        else:
            index.forget(keys)
        held = [k for k in range(13) if k in index]
        slots_held = index.slots(held)
        assert len(set(slots_held)) == len(held) == len(index) <= capacity
        assert all(0 <= s < capacity for s in slots_held)
