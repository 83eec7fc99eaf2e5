"""A workload replayed through a :class:`~.step_engine.StepEngine`: each
request added when the engine's clock reaches its arrival, steps run while
there is work, the clock let run to the next arrival when there is none
(:func:`serve_arrivals`). The replay engine's timed mode runs it on
simulated time, the torch engine on the wall clock."""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterator

import attrs

from sagellm_core.drivers.recorder import Recorder
from sagellm_core.drivers.step_engine import StepEngine
from sagellm_core.runtime import Runtime
from sagellm_core.types import Request


class Arrivals:
    """The workload's requests in arrival order. In a closed loop, a turn of
    a conversation whose previous turn is still in flight is held until that
    turn is :meth:`done`, and then arrives at the later of its own arrival
    time and that turn's finish."""

    def __init__(self, requests: Iterator[Request], closed_loop: bool):
        self._upcoming = iter(requests)
        self._next = next(self._upcoming, None)
        self._closed_loop = closed_loop
        self._released: list[tuple[float, int, Request]] = []  # heap: turns let go by done()
        self._serial = 0
        self._in_flight: set[str] = set()  # sessions with a turn sent and not finished
        self._held: dict[str, deque[Request]] = {}

    def any_due(self, now_s: float) -> bool:
        """Whether :meth:`due` has a request for ``now_s``: asked every
        step, before a generator is made for the few steps that have one."""
        upcoming, released = self._next, self._released
        return (upcoming is not None and upcoming.arrival_s <= now_s) or bool(released and released[0][0] <= now_s)

    def next_arrival_s(self) -> float | None:
        """When the next request may arrive (a held one does not count)."""
        upcoming = self._next.arrival_s if self._next is not None else math.inf
        released = self._released[0][0] if self._released else math.inf
        when = min(upcoming, released)
        return None if when == math.inf else when

    def due(self, now_s: float) -> Iterator[Request]:
        """The requests arriving by ``now_s``, in arrival order."""
        while True:
            upcoming, released = self._next, self._released
            if released and (upcoming is None or released[0][0] <= upcoming.arrival_s) and released[0][0] <= now_s:
                yield heapq.heappop(released)[2]  # its session is still marked in flight
                continue
            if upcoming is None or upcoming.arrival_s > now_s:
                return
            self._next = next(self._upcoming, None)
            session = upcoming.session_id
            if self._closed_loop and session is not None:
                if session in self._in_flight:
                    self._held.setdefault(session, deque()).append(upcoming)
                    continue
                self._in_flight.add(session)
            yield upcoming

    def done(self, request: Request, now_s: float) -> None:
        """``request`` finished (or was rejected) at ``now_s``."""
        session = request.session_id
        if not self._closed_loop or session is None:
            return
        held = self._held.get(session)
        if not held:
            self._in_flight.discard(session)
            return
        turn = held.popleft()
        if not held:
            del self._held[session]
        self._serial += 1
        arrival = max(turn.arrival_s, now_s)
        # A deadline is an SLO from arrival: it moves with the arrival.
        deadline = None if turn.deadline_s is None else turn.deadline_s + arrival - turn.arrival_s
        sent = attrs.evolve(turn, arrival_s=arrival, deadline_s=deadline)
        heapq.heappush(self._released, (arrival, self._serial, sent))


def _nothing() -> None:
    pass


def serve_arrivals(
    rt: Runtime,
    engine: StepEngine,
    requests: Iterator[Request],
    recorder: Recorder,
    on_request: Callable[[], None] = _nothing,
    *,
    add: Callable[[Request], bool] | None = None,
    closed_loop: bool = False,
) -> Recorder:
    """Replay ``requests`` (in arrival order) through ``engine`` on ``rt``.

    A request is added once ``engine.clock()`` reaches its arrival: by
    ``add(request)``, which queues it or rejects it (counted) and returns
    whether it queued it (default: ``engine.add_request``, which queues
    every request). With nothing to do, the engine waits for the next
    arrival (``engine.wait_until``). Every finished request's outcome is
    recorded, every executed step sampled (the pool's usage), and
    ``on_request`` called for each request that ends, finished or
    rejected. ``closed_loop``: see :class:`Arrivals`. Returns ``recorder``,
    its simulated time the engine's clock at the end.
    """

    def queue(request: Request) -> bool:
        engine.add_request(request)
        return True

    add = add or queue
    arrivals = Arrivals(requests, closed_loop)
    #: Closed loop: the requests in flight, whose end lets their session's next turn go.
    sent: dict[str, Request] = {}
    steps = 0
    while True:
        now = engine.clock()
        if arrivals.any_due(now):
            for request in arrivals.due(now):
                if not add(request):
                    arrivals.done(request, now)
                    on_request()
                elif closed_loop:
                    sent[request.request_id] = request
        if not engine.has_work():
            upcoming = arrivals.next_arrival_s()
            if upcoming is None:
                break
            engine.wait_until(upcoming)
            continue
        outputs = engine.step()
        for out in outputs:
            if out.outcome is not None:
                recorder.record(out.outcome)
            if out.finished:
                if closed_loop:
                    arrivals.done(sent.pop(out.request_id), engine.clock())
                on_request()
        if engine.steps != steps:  # it executed (a step that rejects the queue's head does not)
            steps = engine.steps
            recorder.steps, recorder.batched_tokens = steps, engine.batched_tokens
            recorder.sample(rt, rt.now_s, rt.pool_usage())
    recorder.simulated_s = engine.clock()
    return recorder
