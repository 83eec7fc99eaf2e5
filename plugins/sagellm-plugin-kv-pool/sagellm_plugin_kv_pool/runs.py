"""Contiguous allocation: the free blocks as runs of adjacent ids, handed out
as runs, and compaction that moves cached blocks to rejoin them.

A request's KV in a few runs of adjacent blocks is a few large copies when
it is offloaded to host memory, loaded back or sent to another instance,
instead of one per block. The pool keeps its free blocks as runs (start ->
length, last block -> start, and the runs sorted by length):

* an allocation for a request first extends the run it was given last (the
  blocks right after its last block, while free: a decoding request grows
  in place), then takes the smallest free run that holds the rest (best
  fit, keeping long runs long), else the longest runs first (fewest
  pieces); with ``grow_room = k`` (above 0), a request that holds blocks
  here and cannot grow in place starts its next piece at the beginning of
  the smallest free run with ``k`` blocks to spare that no other request
  grows into (a run not right after another request's last block), so that
  it grows in place from there, and what it frees when it finishes is one
  run (best fit when there is none);
* with ``reserve = k`` (above 0), an allocation for a request that needs
  more than it has set aside puts its last piece where free blocks are left
  after it (the smallest free run longer than ``k``, else the longest) and
  sets up to ``k`` of them aside for the request: it grows into them in
  place, and others take them only when no other block is free. The pool
  tells the runtime how many it keeps (``sagellm_reserved_blocks``), which
  evicts cached blocks to keep them free. A reservation goes back when its
  request ends (``sagellm_request_finished``), lets its blocks go
  (``sagellm_blocks_released``) or frees its last block;
* a free merges each run of freed ids with the free runs on either side;
* with ``compact = true``, once a step (``sagellm_plan_compaction``) while
  the free blocks are more fragmented than ``max_fragmentation``
  (``PoolUsage.external_fragmentation``: 0 for one run, 1 when no two free
  blocks are adjacent), it moves *islands*, runs of cached blocks that no
  request holds lying between two free runs, into other free runs (best
  fit, order kept): each move joins the two runs around the island. At
  most ``max_moves`` blocks a round, and a round at most every
  ``min_steps_between`` steps, so a fragmentation that moves cannot cure
  (blocks that requests hold) costs nothing per step. When the engine has
  KV tensors (the torch engine), the moved blocks' KV is copied through the
  engine's device (``KVCaches.copy_blocks``) before the step runs. With
  ``moves = "gather"`` a round instead fills the shortest free runs, whole,
  with the movable blocks beside a long free run, which joins them.

Allocation and free are O(log runs) per run taken or freed; a free's work
per block (its checks, the split into runs) is done by builtins.
"""

from __future__ import annotations

import operator
from bisect import bisect_right
from collections.abc import Sequence

from attrs import field, frozen, validators
from sortedcontainers import SortedList

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import (
    BlockAllocation,
    EvictionCandidates,
    KVCaches,
    LifetimePrediction,
    PoolUsage,
    Request,
    RequestOutcome,
)

from .tails import RequestTails

_NO_BLOCKS = BlockAllocation(())
#: The longest free runs a gathering round looks beside for blocks to move.
GATHER_TRIES = 8


@frozen
class RunsSettings:
    #: Move cached blocks to rejoin free runs (every plugin that keeps blocks by id must follow moves).
    compact: bool = field(default=False, validator=validators.instance_of(bool))
    #: Compact while the free blocks' fragmentation is above this.
    max_fragmentation: float = field(
        default=0.1, validator=[validators.instance_of(float), validators.ge(0), validators.le(1)]
    )
    #: Blocks moved at most in one round.
    max_moves: int = field(default=256, validator=[validators.instance_of(int), validators.gt(0)])
    #: Steps at least between two rounds.
    min_steps_between: int = field(default=32, validator=[validators.instance_of(int), validators.gt(0)])
    #: What a round moves: ``"islands"`` (cached blocks between two free
    #: runs, into other runs), ``"gather"`` (the cached blocks beside the
    #: longest free run, into the shortest runs, filling them) or
    #: ``"pieces"`` (whole pieces of requests' blocks beside a free run, each
    #: into one free run, where that leaves a free run fewer).
    moves: str = field(default="islands", validator=validators.in_(("islands", "gather", "pieces")))
    #: Free blocks to leave after a request's new piece for it to grow into
    #: (0: best fit, the new piece in the smallest run that holds it).
    grow_room: int = field(default=0, validator=[validators.instance_of(int), validators.ge(0)])
    #: Free blocks to set aside for a request right after the blocks an
    #: allocation gives it, when it needs more than it had set aside (0: none).
    reserve: int = field(default=0, validator=[validators.instance_of(int), validators.ge(0)])
    #: Size each reservation as the request's predicted output (the lifetime
    #: prediction at arrival, its median, in blocks), at most ``reserve``;
    #: ``reserve`` where it has no prediction.
    reserve_predicted: bool = field(default=False, validator=validators.instance_of(bool))


class RunsPool:
    """``[kv_pool] plugin = "runs"``"""

    Settings = RunsSettings

    def __init__(self, settings: RunsSettings, context: PluginContext):
        n = self.num_blocks = context.num_blocks
        self._is_free = bytearray(b"\x01") * n
        self._length: dict[int, int] = {0: n} if n else {}  # free run start -> length
        self._start: dict[int, int] = {n - 1: 0} if n else {}  # free run's last block -> start
        self._by_length = SortedList([(n, 0)] if n else [])  # (length, start)
        self._num_free = n
        self._free_runs = 1 if n else 0  # runs of free blocks, reserved or not
        self._tails = RequestTails()
        self._usage: PoolUsage | None = None
        self.max_fragmentation = settings.max_fragmentation
        self.max_moves = settings.max_moves
        self.min_steps_between = settings.min_steps_between
        self.grow_room = settings.grow_room
        self.plan = {"islands": self.plan_islands, "gather": self.plan_gather, "pieces": self.plan_pieces}[
            settings.moves
        ]
        #: ``_joined[b]``: block ``b`` follows block ``b - 1`` in some request's
        #: blocks (handed out together, or grown in place): moving one without
        #: the other would split a request's run in two.
        self._joined = bytearray(n)
        self._steps = self._next_round = 0
        self._kv: KVCaches | None = None
        self.block_size = context.block_size
        self.reserve = settings.reserve
        self._reserved: dict[str, tuple[int, int]] = {}  # request id -> (start, length) set aside for it
        self._num_reserved = 0
        self._want: dict[str, int] = {}  # request id -> the blocks its reservations are, where predicted
        if not settings.reserve:  # nothing set aside: no hook for the runtime to ask, nothing to observe
            self.sagellm_reserved_blocks = None  # type: ignore[method-assign,assignment]
            self.sagellm_request_finished = None  # type: ignore[method-assign,assignment]
            self.sagellm_blocks_released = None  # type: ignore[method-assign,assignment]
        if not (settings.reserve and settings.reserve_predicted):
            self.sagellm_request_arrived = None  # type: ignore[method-assign,assignment]
        if not settings.compact:
            # Not a compacting pool: without the hook, the runtime neither asks
            # for moves nor needs every plugin to follow them.
            self.sagellm_plan_compaction = None  # type: ignore[method-assign,assignment]

    # ------------------------------------------------------------ the runs --

    def _add_run(self, start: int, length: int) -> None:
        self._length[start] = length
        self._start[start + length - 1] = start
        self._by_length.add((length, start))

    def _drop_run(self, start: int) -> int:
        length = self._length.pop(start)
        del self._start[start + length - 1]
        self._by_length.remove((length, start))
        return length

    def _take(self, start: int, count: int, follows: bool = False) -> range:
        """Take the first ``count`` blocks of the free run at ``start``
        (``follows``: the first continues a request's run from ``start - 1``)."""
        length = self._drop_run(start)
        if length > count:
            self._add_run(start + count, length - count)
        return self._mark_taken(start, count, follows)

    def _mark_taken(self, start: int, count: int, follows: bool) -> range:
        is_free, end = self._is_free, start + count
        is_free[start:end] = bytes(count)
        self._free_runs += (start > 0 and is_free[start - 1]) + (end < self.num_blocks and is_free[end]) - 1
        self._joined[start:end] = b"\x01" * count
        self._joined[start] = follows
        self._num_free -= count
        return range(start, end)

    def _give_back(self, start: int, count: int) -> None:
        """Free ``start .. start + count - 1`` (in use), joining the runs on either side."""
        is_free, end = self._is_free, start + count
        is_free[start:end] = b"\x01" * count
        self._free_runs += 1 - (start > 0 and is_free[start - 1]) - (end < self.num_blocks and is_free[end])
        self._num_free += count
        self._joined[start : end + 1] = bytes(count + (end < self.num_blocks))  # (the block after follows none)
        self._join(start, count)

    def _join(self, start: int, count: int) -> None:
        """Make free ``start .. start + count - 1`` a run, joined with the runs on either side."""
        end = start + count
        if end in self._length:
            count += self._drop_run(end)
        before = self._start.get(start - 1)
        if before is not None:
            count += self._drop_run(before)
            start = before
        self._add_run(start, count)

    # ---------------------------------------------------------------- hooks --

    @hookimpl
    def sagellm_allocate_blocks(self, num_blocks: int, request: Request | None) -> BlockAllocation:
        if num_blocks > self._num_free:
            return _NO_BLOCKS
        ids: list[int] = []
        need = num_blocks
        rid = None if request is None else request.request_id
        tail = None if rid is None else self._tails.of(rid)
        mine = self._reserved.get(rid) if self._reserved and rid is not None else None  # type: ignore[arg-type]
        if mine is not None:  # what was set aside for it first
            ids.extend(self._take_reserved(rid, min(need, mine[1]), tail == mine[0] - 1))  # type: ignore[arg-type]
            need = num_blocks - len(ids)
            if not need:
                self._tails.set(rid, ids[-1])  # type: ignore[arg-type]
                self._usage = None
                return BlockAllocation(tuple(ids))
        room = self._want.get(rid, self.reserve) if self.reserve and rid is not None else 0  # type: ignore[arg-type]
        last = ids[-1] if ids else tail
        if last is not None and last + 1 in self._length:  # grow in place
            ids.extend(self._take(last + 1, min(need, self._length[last + 1]), True))
            need = num_blocks - len(ids)
        by_length = self._by_length
        spare = room or (self.grow_room if tail is not None else 0)
        final: range | None = None
        if need and spare:  # a new piece, with room to grow after it
            start = self._room_for(need, spare)
            if start is not None:
                ids.extend(self._take(start, need, bool(ids) and ids[-1] == start - 1))
                need = 0
            elif room:  # the last piece where room is left after it, set aside; the rest before it
                final = self._last_piece(rid, need, room)  # type: ignore[arg-type]
                if final is not None:
                    need -= len(final)
        while need:
            if not by_length:  # every free block is set aside: take from the end of the largest reservation
                ids.extend(self._take_others(need, ids[-1] if ids else tail))
                break
            at = by_length.bisect_left((need, -1))
            length, start = by_length[at] if at < len(by_length) else by_length[-1]
            ids.extend(self._take(start, min(need, length), bool(ids) and ids[-1] == start - 1))
            need = num_blocks - len(ids) - (len(final) if final else 0)
        if final is not None:
            self._joined[final[0]] = bool(ids) and ids[-1] == final[0] - 1
            ids.extend(final)
        if rid is not None and ids:
            self._tails.set(rid, ids[-1])
            if room and rid not in self._reserved and ids[-1] + 1 in self._length:
                self._set_aside(rid, ids[-1] + 1, room)
        self._usage = None
        return BlockAllocation(tuple(ids))

    def _room_for(self, need: int, spare: int) -> int | None:
        """The start of the smallest free run of at least ``need + spare``
        blocks that is not right after a request's last block, or ``None``."""
        by_length, is_tail = self._by_length, self._tails.is_tail
        for _, start in by_length.islice(by_length.bisect_left((need + spare, -1))):
            if not is_tail(start - 1):
                return start
        return None

    # --------------------------------------------------------- reservations --

    def _last_piece(self, request_id: str, need: int, room: int) -> range | None:
        """Of ``need`` blocks for ``request_id``, take the last piece from the
        smallest free run with more than ``room`` blocks that no other request
        grows into (else the longest free run, where no request grows into
        it), and set aside the blocks after it, ``room`` at most: as much of
        ``need`` as leaves ``room``, one block at least, and more where the
        other runs hold too few. ``None`` where there is no such run."""
        start = self._room_for(1, room)
        if start is None:
            if not self._by_length or self._tails.is_tail(self._by_length[-1][1] - 1):
                return None
            start = self._by_length[-1][1]
        length = self._length[start]
        others = self._num_free - self._num_reserved - length
        count = min(length, max(min(need, length - room), need - others, 1))
        piece = self._take(start, count)
        if count < length:
            self._set_aside(request_id, start + count, room)
        return piece

    def _set_aside(self, request_id: str, start: int, count: int) -> None:
        """Set aside the first ``count`` blocks (at most) of the free run at ``start`` for ``request_id``."""
        length = self._drop_run(start)
        count = min(count, length)
        if length > count:
            self._add_run(start + count, length - count)
        self._reserved[request_id] = (start, count)
        self._num_reserved += count

    def _take_reserved(self, request_id: str, count: int, follows: bool) -> range:
        """Take the first ``count`` blocks set aside for ``request_id``."""
        start, length = self._reserved.pop(request_id)
        if length > count:
            self._reserved[request_id] = (start + count, length - count)
        self._num_reserved -= count
        return self._mark_taken(start, count, follows)

    def _take_others(self, need: int, last: int | None) -> list[int]:
        """``need`` blocks set aside for other requests, the last of the
        largest reservation first (``last``: the block they follow)."""
        ids: list[int] = []
        while need:
            owner, (start, length) = max(self._reserved.items(), key=lambda item: item[1][1])
            count = min(need, length)
            if count == length:
                del self._reserved[owner]
            else:
                self._reserved[owner] = (start, length - count)
            self._num_reserved -= count
            first = start + length - count
            ids.extend(self._mark_taken(first, count, last == first - 1))
            last, need = ids[-1], need - count
        return ids

    def _drop_reservation(self, request_id: str) -> None:
        """The blocks set aside for ``request_id`` go back to the free runs."""
        mine = self._reserved.pop(request_id, None)
        if mine is not None:
            self._num_reserved -= mine[1]
            self._join(*mine)
            self._usage = None

    @hookimpl
    def sagellm_reserved_blocks(self, num_blocks: int, request: Request | None) -> int:
        """The free blocks set aside once ``num_blocks`` are taken for ``request``."""
        if request is None:
            return self._num_reserved
        mine = self._reserved.get(request.request_id)
        have = 0 if mine is None else mine[1]
        if num_blocks <= have:
            return self._num_reserved - num_blocks
        return self._num_reserved - have + self._want.get(request.request_id, self.reserve)

    @hookimpl
    def sagellm_request_arrived(self, request: Request, prediction: LifetimePrediction | None) -> None:
        if prediction is not None:
            blocks = -(-int(prediction.output_tokens) // self.block_size)
            self._want[request.request_id] = max(1, min(self.reserve, blocks))

    @hookimpl
    def sagellm_request_finished(self, outcome: RequestOutcome) -> None:
        self._drop_reservation(outcome.request.request_id)
        self._want.pop(outcome.request.request_id, None)

    @hookimpl
    def sagellm_blocks_released(self, request: Request | None) -> None:
        if request is not None:  # preempted, finished, or its blocks handed on
            self._drop_reservation(request.request_id)

    @hookimpl
    def sagellm_free_blocks(self, block_ids: Sequence[int]) -> bool:
        # The work per block is done by builtins (sorted, set, map, bisect,
        # bytearray.find); the Python below runs once per run of adjacent ids.
        ordered = sorted(block_ids) if set(map(type, block_ids)) <= {int} else None
        runs = None if ordered is None else self._runs_of(ordered)
        if runs is None:  # some block is bad: find the first, in the order given
            self._refuse(block_ids)
        for request_id in self._tails.forget(ordered):  # type: ignore[arg-type]
            self._drop_reservation(request_id)
        for start, count in runs:  # type: ignore[union-attr]
            self._give_back(start, count)
        self._usage = None
        return True

    def _runs_of(self, ordered: list[int]) -> list[tuple[int, int]] | None:
        """``ordered`` (sorted ints) as runs of adjacent ids, ``(start,
        count)``; ``None`` unless every id is a block in use, once."""
        n = len(ordered)
        if not n:
            return []
        if ordered[0] < 0 or ordered[-1] >= self.num_blocks or len(set(ordered)) < n:
            return None
        if ordered[-1] - ordered[0] == n - 1:  # distinct: one run
            bounds = [(0, n)]
        else:  # ``b - i`` for the ``i``-th id ``b``: equal within a run, larger after each gap
            keys = list(map(operator.sub, ordered, range(n)))
            bounds, i = [], 0
            while i < n:
                j = bisect_right(keys, keys[i], i)
                bounds.append((i, j))
                i = j
        is_free, runs = self._is_free, []
        for i, j in bounds:
            start = ordered[i]
            if is_free.find(1, start, start + j - i) >= 0:
                return None
            runs.append((start, j - i))
        return runs

    def _refuse(self, block_ids: Sequence[int]) -> None:
        """Raise the ValueError that names what is wrong with ``block_ids``."""
        num_blocks, is_free = self.num_blocks, self._is_free
        for block_id in block_ids:
            if not (type(block_id) is int and 0 <= block_id < num_blocks):
                raise ValueError(f"block {block_id!r} is out of range 0..{num_blocks - 1}")
            if is_free[block_id]:
                raise ValueError(f"block {block_id} is freed twice")
        raise ValueError(f"blocks {list(block_ids)} contain duplicates")

    def _free_sorted(self, ordered: list[int]) -> None:
        runs = self._runs_of(ordered)
        if runs is None:
            self._refuse(ordered)
        for start, count in runs:  # type: ignore[union-attr]
            self._give_back(start, count)

    @hookimpl
    def sagellm_pool_usage(self) -> PoolUsage:
        usage = self._usage
        if usage is None:
            usage = self._usage = PoolUsage(self.num_blocks, self._num_free, self._free_runs)
        return usage

    # ----------------------------------------------------------- compaction --

    @hookimpl
    def sagellm_kv_caches_allocated(self, kv_caches: KVCaches) -> None:
        self._kv = kv_caches

    @hookimpl
    def sagellm_plan_compaction(self, movable: EvictionCandidates) -> tuple[tuple[int, int], ...] | None:
        self._steps += 1
        free, runs = self._num_free, self._free_runs
        if self._steps < self._next_round or free <= 1 or (runs - 1) / (free - 1) <= self.max_fragmentation:
            return None  # (PoolUsage.external_fragmentation, without building one)
        self._next_round = self._steps + self.min_steps_between
        return self.plan(movable)

    def plan_islands(self, movable: EvictionCandidates) -> tuple[tuple[int, int], ...]:
        """Moves of islands (cached blocks between two free runs, every one
        movable), smallest first, each into the smallest free run that holds
        it; a run that an island's move joins takes no island, and a run
        that takes one is joined by none."""
        starts = sorted(self._length)
        islands = []
        for left, right in zip(starts, starts[1:]):
            begin = left + self._length[left]
            if right - begin <= self.max_moves and all(b in movable for b in range(begin, right)):
                islands.append((right - begin, begin, left, right))
        islands.sort()
        room = SortedList(self._by_length)  # what is left of each free run, as moves fill them
        joined: set[int] = set()
        filled: set[int] = set()
        moves: list[tuple[int, int]] = []
        for size, begin, left, right in islands:
            if len(moves) + size > self.max_moves or left in filled or right in filled:
                continue
            at = room.bisect_left((size, -1))
            while at < len(room) and room[at][1] in joined | {left, right}:
                at += 1
            if at == len(room):
                continue
            length, start = room.pop(at)
            moves.extend(zip(range(begin, begin + size), range(start, start + size)))
            joined.update((left, right))
            filled.add(start)
            if length > size:
                room.add((length - size, start + size))
        return tuple(moves)

    def plan_gather(self, movable: EvictionCandidates) -> tuple[tuple[int, int], ...]:
        """Moves that fill the shortest free runs, whole, with the movable
        blocks beside a long run, nearest first (those after it, then those
        before it): each filled run is one run fewer, and the blocks moved
        out join the long run (a free run that the blocks after or before it
        reach is joined as well, and so never filled; nor is a run right
        after a request's last block, which it grows into). The long run is the
        longest of the ``GATHER_TRIES`` longest beside which there are blocks
        to move."""
        by_length = self._by_length
        for length, start in list(by_length.islice(max(0, len(by_length) - GATHER_TRIES), reverse=True)):
            donors, joined = self._beside(start, length, movable)
            moves: list[tuple[int, int]] = []
            for run_length, run_start in by_length:
                if run_start == start or run_start in joined or self._tails.is_tail(run_start - 1):
                    continue  # (a run right after a request's last block is where it grows in place)
                if len(moves) + run_length > len(donors):
                    break
                moves.extend(zip(donors[len(moves) :], range(run_start, run_start + run_length)))
            if moves:
                return tuple(moves)
        return ()

    def plan_pieces(self, movable: EvictionCandidates) -> tuple[tuple[int, int], ...]:
        """Moves of *pieces*: the movable blocks right before or after a free
        run, as far as they go on in one request's run (``_joined``) and no
        further, so that no request's run is split. Each piece goes whole,
        in order, to the start of the smallest free run that holds it, and
        only where that leaves a free run fewer: the piece fills that run
        exactly, or its blocks' going joins the free run beside it to the
        one on its other side (both, two fewer). Shortest pieces first, at
        most ``max_moves`` blocks a round; a free run a move fills or joins
        takes part in no other move of the round; nor is a run right after a
        request's last block filled."""
        length, starts, joined = self._length, self._start, self._joined
        n, limit, is_tail = self.num_blocks, self.max_moves, self._tails.is_tail
        pieces = []  # (size, first block, free run beside it, free run on its other side or -1)
        for start, run in length.items():
            end = start + run  # the piece after the run: it begins a request's run (the free block before it)
            b = end
            while b < n and b - end < limit and b in movable and (b == end or joined[b]):
                b += 1
            if b > end and (b == n or not joined[b]):  # a whole piece: the block after it does not follow it
                pieces.append((b - end, end, start, b if b in length else -1))
            b = start - 1  # the piece before the run: back to where a request's run begins
            while b >= 0 and start - b <= limit and b in movable and joined[b]:
                b -= 1
            if b >= 0 and start - b <= limit and b in movable:  # b begins the piece
                other = starts.get(b - 1, -1) if b > 0 else -1
                if other < 0:  # (a piece between two runs is the first run's piece after it)
                    pieces.append((start - b, b, start, other))
        pieces.sort()
        room = SortedList(self._by_length)
        busy: set[int] = set()
        moves: list[tuple[int, int]] = []
        for size, first, beside, other in pieces:
            if len(moves) + size > limit:
                break
            if beside in busy or other in busy:
                continue
            at = room.bisect_left((size, -1))
            while at < len(room) and (
                room[at][1] in busy or room[at][1] in (beside, other) or is_tail(room[at][1] - 1)
            ):
                at += 1  # (a run right after a request's last block is where it grows in place)
            if at == len(room):
                continue
            fits, into = room[at]
            if fits > size and other < 0:
                continue  # neither fills a run nor joins two: no run fewer
            room.pop(at)
            moves.extend(zip(range(first, first + size), range(into, into + size)))
            busy.update((beside, other, into))
        return tuple(moves)

    def _beside(self, start: int, length: int, movable: EvictionCandidates) -> tuple[list[int], set[int]]:
        """The movable blocks after the free run at ``start``, nearest first,
        then those before it, ``max_moves`` at most; and the free runs they
        reach."""
        limit = self.max_moves
        donors: list[int] = []
        joined: set[int] = set()
        after = start + length
        while after < self.num_blocks and len(donors) < limit and after in movable:
            donors.append(after)
            after += 1
        if after in self._length:
            joined.add(after)
        before = start - 1
        while before >= 0 and len(donors) < limit and before in movable:
            donors.append(before)
            before -= 1
        if before in self._start:
            joined.add(self._start[before])
        return donors, joined

    @hookimpl
    def sagellm_blocks_moved(self, moves: tuple[tuple[int, int], ...]) -> None:
        src, dst = sorted(m[0] for m in moves), sorted(m[1] for m in moves)
        if self._kv is not None and self._kv.copy_blocks is not None:
            self._kv.copy_blocks(self._kv.tensor, [m[0] for m in moves], self._kv.tensor, [m[1] for m in moves])
        i = 0
        while i < len(dst):  # each run of destinations begins a free run (the plan fills runs from their start)
            j = i + 1
            while j < len(dst) and dst[j] == dst[j - 1] + 1:
                j += 1
            self._take_range(dst[i], j - i)
            i = j
        joined = self._joined
        follows = [i > 0 and moves[i - 1] == (s - 1, d - 1) and joined[s] for i, (s, d) in enumerate(moves)]
        self._tails.forget(src)
        self._free_sorted(src)
        for (_, d), f in zip(moves, follows):  # a moved block follows the one it followed, moved beside it
            joined[d] = f
        self._usage = None

    def _take_range(self, start: int, count: int) -> None:
        """Take ``start .. start + count - 1``, free blocks of one run."""
        if start not in self._length:  # inside a run: split it there
            run = next(s for s in self._length if s < start < s + self._length[s])
            length = self._drop_run(run)
            self._add_run(run, start - run)
            self._add_run(start, length - (start - run))
        self._take(start, count)
