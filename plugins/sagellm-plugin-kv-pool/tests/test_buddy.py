import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from sagellm_plugin_kv_pool.buddy import BuddyPool, aligned_blocks

from sagellm_core import PluginContext
from sagellm_core.types import Request


def pool(n=16):
    return BuddyPool(None, PluginContext("buddy", block_size=16, num_blocks=n))


def request(name: str) -> Request:
    return Request(name, [1, 2, 3], 1)


def take(p, n, req=None):
    return p.sagellm_allocate_blocks(num_blocks=n, request=req).block_ids


def free_blocks(p) -> list[tuple[int, int]]:
    return sorted(p._order.items())


def consistent(p) -> None:
    """The free buddy blocks are aligned, cover exactly the free ids, no two
    buddies are both free at one order, and the usage's counts are the
    bitmap's."""
    covered = []
    for start, order in free_blocks(p):
        assert start % (1 << order) == 0 and start + (1 << order) <= p.num_blocks
        assert start in p._free[order]
        buddy = start ^ (1 << order)
        assert p._order.get(buddy) != order, f"blocks {start} and {buddy} of order {order} are both free"
        covered += range(start, start + (1 << order))
    assert sum(len(s) for s in p._free) == len(p._order)
    flags = p._is_free[1:-1]
    assert sorted(covered) == [b for b in range(p.num_blocks) if flags[b]]
    runs = sum(1 for b in range(p.num_blocks) if flags[b] and (b == 0 or not flags[b - 1]))
    usage = p.sagellm_pool_usage()
    assert usage.num_free_blocks == len(covered) and usage.num_free_runs == runs


def test_the_pool_starts_as_the_largest_aligned_blocks():
    assert aligned_blocks(0, 12) == [(0, 3), (8, 2)]
    assert aligned_blocks(3, 13) == [(3, 0), (4, 2), (8, 2), (12, 0)]
    assert free_blocks(pool(12)) == [(0, 3), (8, 2)]
    assert free_blocks(pool(0)) == [] and pool(0).sagellm_pool_usage().num_free_runs == 0


def test_an_allocation_is_its_size_in_binary_each_piece_from_the_smallest_block_that_holds_it():
    p = pool(32)
    assert take(p, 13) == tuple(range(0, 8)) + (8, 9, 10, 11) + (12,)  # 8 + 4 + 1
    consistent(p)
    assert free_blocks(p) == [(13, 0), (14, 1), (16, 4)]
    assert take(p, 2) == (14, 15)  # the free block of order 1, not a split of 16-31
    assert take(p, 1) == (13,)
    assert free_blocks(p) == [(16, 4)]


def test_without_a_block_large_enough_the_largest_free_ones_go_first():
    p = pool(8)
    assert take(p, 8) == tuple(range(8))
    p.sagellm_free_blocks(block_ids=(0, 1, 4, 5, 6))  # free: 0-1 (order 1), 4-5 (order 1), 6 (order 0)
    assert take(p, 4) == (0, 1, 4, 5)
    assert take(p, 2) == ()  # all or nothing: one block is free
    assert take(p, 1) == (6,)


def test_a_request_grows_in_place_while_the_blocks_after_its_last_are_free():
    p = pool(16)
    a = take(p, 3, request("a"))  # 0-1, 2
    b = take(p, 1, request("b"))  # 3
    p.sagellm_free_blocks(block_ids=b)
    assert take(p, 3, request("a")) == (3, 4, 5)  # right after a's last block, across two buddy blocks
    assert take(p, 1, request("b")) == (6,)  # b's tail was freed: the lowest free block
    assert a == (0, 1, 2)
    consistent(p)


def test_bad_frees_are_refused_without_change():
    p = pool(8)
    take(p, 4)
    p.sagellm_free_blocks(block_ids=(0,))
    before = free_blocks(p)
    for bad, message in (
        ((1, 0), "block 0 is freed twice"),
        ((9,), "out of range"),
        ((2, 2), "duplicates"),
        ((1.0,), "out of range"),
    ):
        with pytest.raises(ValueError, match=message):
            p.sagellm_free_blocks(block_ids=bad)
    assert free_blocks(p) == before and p.sagellm_pool_usage().num_free_blocks == 5
    consistent(p)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 70),
    st.lists(st.tuples(st.booleans(), st.integers(1, 20), st.integers(0, 3), st.randoms()), max_size=60),
)
def test_the_allocator_never_hands_a_block_twice_and_coalesces_back_to_its_start(n, ops):
    p = pool(n)
    start = free_blocks(p)
    held: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    for allocate, k, who, rnd in ops:
        name = f"r{who}"
        if allocate:
            free_before = p.sagellm_pool_usage().num_free_blocks
            ids = take(p, k, request(name))
            in_use = {b for blocks in held.values() for b in blocks}
            assert len(set(ids)) == len(ids) and in_use.isdisjoint(ids) and all(0 <= b < n for b in ids)
            assert len(ids) == (k if k <= free_before else 0)  # all or nothing, and never refused when it fits
            held[name] += ids
        elif held[name]:
            rnd.shuffle(held[name])
            freed, held[name] = held[name][:k], held[name][k:]
            p.sagellm_free_blocks(block_ids=tuple(freed))
        consistent(p)
        assert p.sagellm_pool_usage().num_free_blocks + sum(map(len, held.values())) == n
    for blocks in held.values():  # everything back: the maximal blocks it started with
        if blocks:
            p.sagellm_free_blocks(block_ids=tuple(blocks))
    assert free_blocks(p) == start
    consistent(p)
    assert take(p, n) == tuple(range(n))  # every block can be allocated again, in one allocation


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))))
def test_a_fresh_pool_serves_a_request_in_no_more_pieces_than_the_binary_digits_of_its_size(sizes):
    n, k = sizes
    ids = take(pool(n), k)
    pieces = sum(1 for i, b in enumerate(ids) if i == 0 or b != ids[i - 1] + 1)
    assert sorted(ids) == sorted(set(ids)) and len(ids) == k
    assert pieces <= bin(k).count("1")
