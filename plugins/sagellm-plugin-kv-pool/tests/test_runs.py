import attrs
import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from sagellm_plugin_kv_pool.runs import RunsPool, RunsSettings

from sagellm_core import PluginContext
from sagellm_core.types import KVCaches, LifetimePrediction, Request, RequestOutcome


def pool(n=16, **kw):
    return RunsPool(RunsSettings(**kw), PluginContext("runs", block_size=16, num_blocks=n))


def request(name: str) -> Request:
    return Request(name, [1, 2, 3], 1)


def take(p, n, req=None):
    return p.sagellm_allocate_blocks(num_blocks=n, request=req).block_ids


def free_runs(p) -> list[tuple[int, int]]:
    """The free runs from the bitmap, brute force: (start, length)."""
    runs, start = [], None
    for b, flag in enumerate([*p._is_free, 0]):
        if flag and start is None:
            start = b
        elif not flag and start is not None:
            runs.append((start, b - start))
            start = None
    return runs


def consistent(p) -> None:
    """The pool's runs and reservations against its bitmap: the free blocks
    set aside for no request, as runs, are its free runs; each reservation
    is free blocks right after its request's last block."""
    runs = free_runs(p)
    reserved = {b for s, n in p._reserved.values() for b in range(s, s + n)}
    assert sum(n for _, n in p._reserved.values()) == len(reserved) == p._num_reserved
    for owner, (s, n) in p._reserved.items():
        assert n > 0 and all(p._is_free[s : s + n]) and p._tails.of(owner) == s - 1
    available, start = [], None
    for b in range(p.num_blocks + 1):
        if b < p.num_blocks and p._is_free[b] and b not in reserved:
            start = b if start is None else start
        elif start is not None:
            available.append((start, b - start))
            start = None
    assert sorted(p._length.items()) == available
    assert sorted(p._by_length) == sorted((n, s) for s, n in available)
    assert {s + n - 1: s for s, n in available} == p._start
    usage = p.sagellm_pool_usage()
    assert usage.num_free_blocks == sum(n for _, n in runs) and usage.num_free_runs == len(runs)


def test_an_allocation_takes_the_smallest_run_that_holds_it():
    p = pool(16)
    a, b, c = take(p, 3), take(p, 2), take(p, 4)
    assert (a, b, c) == ((0, 1, 2), (3, 4), (5, 6, 7, 8))
    p.sagellm_free_blocks(block_ids=a + c)  # free runs: 0-2 (3), 5-15 (11)
    assert take(p, 3) == (0, 1, 2)  # the exact fit, not the long run
    assert take(p, 4) == (5, 6, 7, 8)


def test_a_request_grows_in_place_while_the_blocks_after_its_last_are_free():
    p = pool(16)
    a = take(p, 3, request("a"))
    b = take(p, 2, request("b"))
    p.sagellm_free_blocks(block_ids=b)
    assert take(p, 2, request("a")) == (3, 4)  # right after a's last block
    assert take(p, 1, request("b")) == (5,)  # b's tail was freed: best fit
    assert a == (0, 1, 2)


def test_without_a_run_long_enough_the_longest_runs_go_first():
    p = pool(10)
    held = take(p, 10)
    p.sagellm_free_blocks(block_ids=(0, 1, 4, 5, 6, 9))
    assert take(p, 5) == (4, 5, 6, 0, 1)  # the run of 3, then a run of 2: two pieces, not three
    assert take(p, 2) == ()  # all or nothing: one block is free
    assert len(held) == 10


def test_with_grow_room_a_new_piece_starts_where_the_request_can_grow_in_place():
    p = pool(32, grow_room=3)
    a, b = request("a"), request("b")
    assert take(p, 2, a) == (0, 1)
    assert take(p, 2, b) == (2, 3)  # a cannot grow in place any more
    held = take(p, 28)
    p.sagellm_free_blocks(block_ids=(4, 10, 11, 20, 21, 22, 23, 24))  # runs: 4 (1), 10-11 (2), 20-24 (5)
    # b grows in place into 4; a's new piece goes where 3 blocks are left after it:
    # not the single block (best fit's choice) nor the run of 2, the run of 5
    assert take(p, 1, b) == (4,)
    assert take(p, 1, a) == (20,)
    assert take(p, 2, a) == (21, 22)  # in place
    # without a run with room, best fit
    assert take(p, 1, b) == (10,)
    assert len(held) == 28
    consistent(p)


def test_with_grow_room_a_new_piece_keeps_off_the_run_another_request_grows_into():
    p = pool(20, grow_room=2)
    a, b = request("a"), request("b")
    assert take(p, 2, a) == (0, 1)
    held = take(p, 18)
    p.sagellm_free_blocks(block_ids=(7,))
    assert take(p, 1, b) == (7,)
    p.sagellm_free_blocks(block_ids=(2, 3, 4, 5, 12, 13, 14, 15))  # runs 2-5 (after a's last block), 12-15
    assert take(p, 1, b) == (12,)  # not 2, where a grows
    assert take(p, 1, a) == (2,)
    assert len(held) == 18
    consistent(p)


def test_bad_frees_are_refused_without_change():
    p = pool(8)
    take(p, 4)
    p.sagellm_free_blocks(block_ids=(0,))
    for bad, message in (((1, 0), "block 0 is freed twice"), ((9,), "out of range"), ((2, 2), "duplicates")):
        with pytest.raises(ValueError, match=message):
            p.sagellm_free_blocks(block_ids=bad)
    assert p.sagellm_pool_usage().num_free_blocks == 5
    consistent(p)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(1, 9), st.integers(0, 3), st.randoms()), max_size=60),
    st.sampled_from([0, 1, 3]),
)
def test_the_allocator_never_hands_a_block_twice_and_its_runs_stay_exact(ops, grow_room):
    p = pool(48, grow_room=grow_room)
    held: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    for allocate, n, who, rnd in ops:
        name = f"r{who}"
        if allocate:
            ids = take(p, n, request(name))
            in_use = {b for blocks in held.values() for b in blocks}
            assert len(set(ids)) == len(ids) and in_use.isdisjoint(ids)
            assert not ids or len(ids) == n
            held[name] += ids
        elif held[name]:
            rnd.shuffle(held[name])
            freed, held[name] = held[name][:n], held[name][n:]
            p.sagellm_free_blocks(block_ids=tuple(freed))
        consistent(p)
        assert p.sagellm_pool_usage().num_free_blocks + sum(map(len, held.values())) == 48


def test_compaction_is_off_unless_asked_and_then_waits_for_fragmentation():
    assert not callable(pool().sagellm_plan_compaction)  # not a hook: the runtime asks nothing
    p = pool(16, compact=True, max_fragmentation=0.5, min_steps_between=1)
    take(p, 16)
    p.sagellm_free_blocks(block_ids=(0, 1, 2, 3, 4, 5))  # one run
    assert p.sagellm_plan_compaction(movable={6}) is None


class FakeKV:
    """A KV tensor of one int per block, copied as a device would."""

    def __init__(self, n):
        self.rows = list(range(1000, 1000 + n))
        self.copies = []

    def copy(self, src, src_ids, dst, dst_ids):
        assert src is dst is self
        self.copies.append((list(src_ids), list(dst_ids)))
        values = [self.rows[b] for b in src_ids]
        for b, v in zip(dst_ids, values):
            self.rows[b] = v


def test_a_round_moves_islands_into_free_runs_and_copies_their_kv():
    p = pool(16, compact=True, max_fragmentation=0.1, min_steps_between=1)
    take(p, 16)
    # free: 0-1, 4-5, 9-15; in use: 2-3 (cached, movable), 6-8 (held)
    p.sagellm_free_blocks(block_ids=(0, 1, 4, 5, 9, 10, 11, 12, 13, 14, 15))
    kv = FakeKV(16)
    p.sagellm_kv_caches_allocated(kv_caches=KVCaches(kv, 0, kv.copy))
    moves = p.sagellm_plan_compaction(movable={2, 3})
    assert moves == ((2, 9), (3, 10))  # the island 2-3 into the smallest run that holds it, beside neither
    p.sagellm_blocks_moved(moves=moves)
    assert kv.rows[9:11] == [1002, 1003] and kv.copies == [([2, 3], [9, 10])]
    consistent(p)
    assert free_runs(p) == [(0, 6), (11, 5)]
    assert p.sagellm_plan_compaction(movable=set()) is None  # the next round waits min_steps_between


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.booleans(), min_size=24, max_size=64),
    st.lists(st.booleans(), min_size=64, max_size=64),
    st.integers(1, 64),
    st.sampled_from(["islands", "gather", "pieces"]),
    st.lists(st.integers(1, 8), min_size=64, max_size=64),
)
def test_a_plan_moves_only_movable_blocks_onto_free_ones_and_never_adds_a_run(free, movable, max_moves, kind, sizes):
    n = len(free)
    p = pool(n, compact=True, max_moves=max_moves, moves=kind)
    taken = 0
    for size in sizes:  # allocations of several sizes: pieces of several lengths
        taken += len(take(p, min(size, n - taken)))
    p.sagellm_free_blocks(block_ids=tuple(b for b in range(n) if free[b]))
    can_move = {b for b in range(n) if not free[b] and movable[b]}
    before = len(free_runs(p))
    moves = p.plan(can_move)
    src, dst = [m[0] for m in moves], [m[1] for m in moves]
    assert set(src) <= can_move and all(free[b] for b in dst)
    assert len(set(src)) == len(src) and len(set(dst)) == len(dst) and len(moves) <= max_moves
    p.sagellm_blocks_moved(moves=moves)
    consistent(p)
    assert len(free_runs(p)) <= before - (1 if moves else 0)


def joined_pairs(p) -> set[tuple[int, int]]:
    """The blocks in use that follow the one before them in a request's run, as (before, after)."""
    return {(b - 1, b) for b in range(1, p.num_blocks) if p._joined[b] and not p._is_free[b]}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6), st.integers(0, 3), st.randoms()), max_size=50))
def test_the_pool_knows_which_blocks_follow_which_in_a_request(ops):
    """A block follows the one before it when the two were handed out one
    after the other to a request (in one allocation, or growing in place
    from its last block), while both are in use."""
    p = pool(40)
    pairs: set[tuple[int, int]] = set()
    last: dict[str, int | None] = {}
    held: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    for allocate, n, who, rnd in ops:
        name = f"r{who}"
        if allocate:
            ids = take(p, n, request(name))
            chain = [last.get(name), *ids]
            pairs |= {(a, b) for a, b in zip(chain, chain[1:]) if a is not None and b == a + 1}
            held[name] += ids
            last[name] = ids[-1] if ids else last.get(name)
        elif held[name]:
            freed = set(rnd.sample(held[name], min(n, len(held[name]))))
            p.sagellm_free_blocks(block_ids=tuple(freed))
            held[name] = [b for b in held[name] if b not in freed]
            pairs = {(a, b) for a, b in pairs if a not in freed and b not in freed}
            if last.get(name) in freed:
                last[name] = None
        assert joined_pairs(p) == pairs


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 6), min_size=8, max_size=30),
    st.lists(st.booleans(), min_size=64, max_size=64),
    st.lists(st.booleans(), min_size=64, max_size=64),
    st.integers(1, 64),
)
def test_moving_pieces_never_splits_a_request_run(sizes, freed, movable, max_moves):
    p = pool(64, compact=True, moves="pieces", max_moves=max_moves)
    runs = [take(p, size, request(f"r{i}")) for i, size in enumerate(sizes)]
    p.sagellm_free_blocks(block_ids=tuple(b for run in runs for b in run if freed[b]))
    can_move = {b for run in runs for b in run if not freed[b] and movable[b]}
    pairs, before = joined_pairs(p), len(free_runs(p))
    moves = p.plan(can_move)
    dst = dict(moves)
    for a, b in pairs:  # a request's two adjacent blocks stay adjacent, in order
        if a in dst or b in dst:
            assert a in dst and b in dst and dst[b] == dst[a] + 1
    p.sagellm_blocks_moved(moves=moves)
    consistent(p)
    assert len(free_runs(p)) <= before - (1 if moves else 0)
    assert joined_pairs(p) == {(dst.get(a, a), dst.get(b, b)) for a, b in pairs}


def test_moving_pieces_fills_a_run_exactly():
    p = pool(12, compact=True, moves="pieces", min_steps_between=1)
    assert (take(p, 4), take(p, 2), take(p, 6)) == ((0, 1, 2, 3), (4, 5), tuple(range(6, 12)))
    p.sagellm_free_blocks(block_ids=(0, 8, 9, 10))  # free: 0 (1), 8-10 (3)
    kv = FakeKV(12)
    p.sagellm_kv_caches_allocated(kv_caches=KVCaches(kv, 0, kv.copy))
    # pieces beside a free run: 1-3 (after 0), 6-7 (before 8), 11 (after 10);
    # 11, the shortest, fills the run at 0 exactly and its going lengthens 8-10
    moves = p.sagellm_plan_compaction(movable={1, 2, 3, 4, 5, 6, 7, 11})
    assert moves == ((11, 0),)
    p.sagellm_blocks_moved(moves=moves)
    assert kv.rows[0] == 1011
    consistent(p)
    assert free_runs(p) == [(8, 4)]


def test_moving_pieces_joins_the_runs_on_either_side_and_leaves_a_run_a_request_grows_into():
    p = pool(20, compact=True, moves="pieces", min_steps_between=1)
    take(p, 3, request("a"))  # 0-2
    take(p, 2, request("b"))  # 3-4: b grows into 5
    take(p, 5, request("c"))  # 5-9
    take(p, 10, request("d"))  # 10-19
    p.sagellm_free_blocks(block_ids=(0, 5, 6, 10, 15, 16, 17, 18, 19))  # free: 0 (1), 5-6 (2), 10 (1), 15-19 (5)
    # a's 1-2 and b's 3-4 would fill 5-6 exactly, but b grows into it; in 15-19
    # they fill nothing and join nothing. c's 7-9 lie between the runs at 5
    # and 10: moved to 15-17, they join the two (d's 11-14, between 10 and 15,
    # then wait: its runs are taken)
    moves = p.sagellm_plan_compaction(movable={1, 2, 3, 4, 7, 8, 9, 11, 12, 13, 14})
    assert moves == ((7, 15), (8, 16), (9, 17))
    p.sagellm_blocks_moved(moves=moves)
    consistent(p)
    assert free_runs(p) == [(0, 1), (5, 6), (18, 2)]
    assert joined_pairs(p) == {(1, 2), (3, 4), (11, 12), (12, 13), (13, 14), (15, 16), (16, 17)}


def test_gathering_fills_the_shortest_runs_with_the_blocks_beside_the_longest():
    p = pool(20, compact=True, moves="gather", min_steps_between=1)
    take(p, 20)
    # free: 1 (1), 4-5 (2), 10-15 (6), 18 (1); in use: 16-17 cached, 9 held
    p.sagellm_free_blocks(block_ids=(1, 4, 5, *range(10, 16), 18))
    kv = FakeKV(20)
    p.sagellm_kv_caches_allocated(kv_caches=KVCaches(kv, 0, kv.copy))
    moves = p.sagellm_plan_compaction(movable={2, 3, 6, 7, 8, 16, 17})
    # 16-17 lie between the longest run and 18: moving them joins 18, which is
    # not filled; 9 (held) stops the blocks before it; the run at 1 is filled
    # with 16 (the shortest run first), 4-5 has one donor left for two holes.
    assert moves == ((16, 1),)
    p.sagellm_blocks_moved(moves=moves)
    assert kv.rows[1] == 1016
    consistent(p)
    assert free_runs(p) == [(4, 2), (10, 7), (18, 1)]
    p2 = pool(20, compact=True, moves="gather", min_steps_between=1)
    take(p2, 20)
    p2.sagellm_free_blocks(block_ids=(1, 4, 5, *range(10, 16)))
    moves = p2.plan(movable={16, 17, 18, 19, 9})  # four blocks after the longest run, then one before it
    assert moves == ((16, 1), (17, 4), (18, 5))
    p2.sagellm_blocks_moved(moves=moves)
    consistent(p2)
    assert free_runs(p2) == [(10, 9)]  # 10-15 and 16-18: one run


def test_gathering_leaves_the_run_a_request_grows_into():
    p = pool(12, compact=True, moves="gather", min_steps_between=1)
    take(p, 2, request("a"))  # 0-1: a's last block is 1
    take(p, 10)
    p.sagellm_free_blocks(block_ids=(2, 5, 8, 9, 10, 11))  # free: 2 (after a's tail), 5, 8-11
    moves = p.plan(movable={7})
    assert moves == ((7, 5),)  # 5 filled from beside the longest run; 2 is left for a to grow into
    p.sagellm_blocks_moved(moves=moves)
    assert free_runs(p) == [(2, 1), (7, 5)]
    assert take(p, 1, request("a")) == (2,)
    consistent(p)


# ------------------------------------------------------------ reservations --


def outcome(name: str) -> RequestOutcome:
    return RequestOutcome(request(name), 1, 0, 0.0, 0.0, 0.0, 0, None)


def test_a_reservation_sets_aside_the_blocks_after_a_request_and_it_grows_into_them():
    p = pool(32, reserve=4)
    a, b = request("a"), request("b")
    assert not callable(pool().sagellm_reserved_blocks)  # without reservations the runtime asks nothing
    assert p.sagellm_reserved_blocks(num_blocks=3, request=a) == 4  # what taking 3 for a sets aside
    assert take(p, 3, a) == (0, 1, 2)  # 3-6 set aside for a
    assert take(p, 2, b) == (7, 8)  # not a's blocks; 9-12 set aside for b
    assert p._reserved == {"a": (3, 4), "b": (9, 4)}
    assert p.sagellm_reserved_blocks(num_blocks=1, request=a) == 7
    assert [take(p, 1, a) for _ in range(4)] == [(3,), (4,), (5,), (6,)]  # in place, one run
    assert p.sagellm_pool_usage().num_free_blocks == 32 - 9  # set aside is free
    assert p.sagellm_reserved_blocks(num_blocks=1, request=a) == 8  # beyond its reservation: 4 more
    assert take(p, 1, a) == (13,)  # 7 is b's: a new piece, with 4 set aside after it
    assert p._reserved == {"a": (14, 4), "b": (9, 4)}
    consistent(p)


def test_the_last_piece_of_an_allocation_goes_where_room_is_left_after_it():
    p = pool(24, reserve=3)
    held = take(p, 24)
    p.sagellm_free_blocks(block_ids=(0, 1, 4, 5, 6, 7, 8, 9, 15, 16))  # runs 0-1, 4-9, 15-16
    # the last piece from the run of 6, as much as leaves 3 after it; the rest before it, best fit
    assert take(p, 5, request("a")) == (0, 1, 4, 5, 6)
    assert p._reserved == {"a": (7, 3)}
    assert len(held) == 24
    consistent(p)


def test_reserved_blocks_go_to_others_only_when_no_other_block_is_free():
    p = pool(12, reserve=4)
    a, b = request("a"), request("b")
    assert take(p, 4, a) == (0, 1, 2, 3)  # 4-7 set aside for a
    assert take(p, 4, b) == (8, 9, 10, 11)  # no room left for b
    assert take(p, 3, request("c")) == (5, 6, 7)  # a's, from the end: what stays is right after a
    assert p._reserved == {"a": (4, 1)}
    assert take(p, 2, b) == ()  # all or nothing: one block is free
    consistent(p)


def test_a_reservation_goes_back_when_its_request_ends():
    p = pool(16, reserve=4)
    a, b, c = request("a"), request("b"), request("c")
    for r in (a, b, c):
        take(p, 1, r)  # a 0, b 5, c 10, each with the 4 after it set aside
    assert p._num_reserved == 12
    p.sagellm_free_blocks(block_ids=(0,))  # a's last block freed (preempted, or finished)
    p.sagellm_request_finished(outcome=outcome("b"))
    p.sagellm_blocks_released(request=c)
    assert p._reserved == {} and p._num_reserved == 0
    assert free_runs(p) == [(0, 5), (6, 4), (11, 5)]
    consistent(p)


def test_with_predictions_a_reservation_is_the_predicted_output_at_most_reserve():
    p = pool(64, reserve=8, reserve_predicted=True)
    guess = LifetimePrediction(output_tokens=40.0, low_tokens=10.0, high_tokens=90.0, confidence=0.5)
    p.sagellm_request_arrived(request=request("a"), prediction=guess)  # 40 tokens: 3 blocks of 16
    p.sagellm_request_arrived(request=request("b"), prediction=None)
    p.sagellm_request_arrived(request=request("c"), prediction=attrs.evolve(guess, output_tokens=1000.0))
    for name in "abc":
        take(p, 1, request(name))
    assert p._reserved == {"a": (1, 3), "b": (5, 8), "c": (14, 8)}
    p.sagellm_request_finished(outcome=outcome("a"))
    assert "a" not in p._want and "a" not in p._reserved


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["take", "free", "end"]), st.integers(1, 9), st.integers(0, 3), st.randoms()),
        max_size=60,
    ),
    st.sampled_from([1, 3, 6]),
    st.booleans(),
)
def test_reservations_never_hand_a_block_twice_nor_refuse_an_allocation(ops, reserve, compact):
    """Whatever requests take, free and end, no block is handed twice, an
    allocation that the free blocks hold is served, the runtime is told no
    more set aside than the pool then keeps, and a compaction plan moves
    nothing onto a reserved block."""
    p = pool(48, reserve=reserve, compact=compact, moves="pieces", min_steps_between=1)
    held: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    for op, n, who, rnd in ops:
        name = f"r{who}"
        free = p.sagellm_pool_usage().num_free_blocks
        if op == "take":
            kept = p.sagellm_reserved_blocks(num_blocks=n, request=request(name))
            ids = take(p, n, request(name))
            in_use = {b for blocks in held.values() for b in blocks}
            assert len(set(ids)) == len(ids) and in_use.isdisjoint(ids)
            assert len(ids) == (n if n <= free else 0)
            assert p._num_reserved <= kept or not ids
            held[name] += ids
        elif op == "free" and held[name]:
            rnd.shuffle(held[name])
            freed, held[name] = held[name][:n], held[name][n:]
            p.sagellm_free_blocks(block_ids=tuple(freed))
        elif op == "end":
            p.sagellm_free_blocks(block_ids=tuple(held[name]))
            held[name] = []
            p.sagellm_request_finished(outcome=outcome(name))
            assert name not in p._reserved
        if compact:
            reserved = {b for s, k in p._reserved.values() for b in range(s, s + k)}
            moves = p.plan(set(rnd.sample(held[name], len(held[name]) // 2)))
            assert reserved.isdisjoint(d for _, d in moves)
        consistent(p)
        assert p.sagellm_pool_usage().num_free_blocks + sum(map(len, held.values())) == 48


def first_bad(p, block_ids) -> str | None:
    """What a free of ``block_ids`` must refuse, by the rule one block at a
    time: the first id, in the order given, that is no block or is free,
    else a repeated id; ``None`` when every id is a block in use, once."""
    for b in block_ids:
        if not (type(b) is int and 0 <= b < p.num_blocks):
            return f"block {b!r} is out of range"
        if p._is_free[b]:
            return f"block {b} is freed twice"
    return "contain duplicates" if len(set(block_ids)) < len(block_ids) else None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 8), max_size=8),
    st.lists(st.one_of(st.integers(-2, 41), st.sampled_from([1.0, True, "3", None])), max_size=24),
    st.lists(st.integers(0, 39), max_size=40, unique=True),
    st.integers(0, 6),
)
def test_a_free_takes_what_the_per_block_rule_takes_and_refuses_the_rest_unchanged(sizes, junk, mine, reserve):
    """Fuzz: a free of any ids (blocks in use or free, repeated, out of
    range, not ints) either frees exactly them, each run of adjacent ids
    joined with the free runs beside it, or raises the ValueError the
    per-block rule names, leaving the pool as it was."""
    p = pool(40, reserve=reserve)
    held = []
    for i, n in enumerate(sizes):
        held.extend(take(p, n, request(f"r{i}")))
    for block_ids in ([b for b in mine if b in held], [*junk], [b for b in mine if b in held] + [*junk][:1]):
        expected = first_bad(p, block_ids)
        before = (bytes(p._is_free), dict(p._length), dict(p._reserved), p._num_free)
        if expected is None:
            p.sagellm_free_blocks(block_ids=tuple(block_ids))
            assert not any(b in held and not p._is_free[b] for b in block_ids)
            held = [b for b in held if b not in set(block_ids)]
        else:
            with pytest.raises(ValueError, match=expected.replace("(", r"\(")):
                p.sagellm_free_blocks(block_ids=tuple(block_ids))
            assert (bytes(p._is_free), dict(p._length), dict(p._reserved), p._num_free) == before
        assert [b for b in held if p._is_free[b]] == []
        consistent(p)
