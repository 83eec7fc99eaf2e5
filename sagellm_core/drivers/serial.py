"""Requests one at a time: the cache-only driver loop.

Cache simulators (and ``mode = "cache-only"`` of the replay, vLLM and
LMDeploy engines) serve a workload one request at a time, in arrival order,
each to its end before the next arrives: no batching, no time model, so
prefix-cache and eviction policies compare without engine dynamics. What
differs from engine to engine is how one request is served; the loop around
it is :func:`serve_serially`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from sagellm_core.drivers.recorder import Recorder
from sagellm_core.runtime import Runtime
from sagellm_core.types import PoolUsage, Request, RequestOutcome, SequenceState


def _nothing() -> None:
    pass


def serve_serially(
    rt: Runtime,
    requests: Iterable[Request],
    serve: Callable[[SequenceState], PoolUsage | None],
    recorder: Recorder,
    on_request: Callable[[], None] = _nothing,
    *,
    arrive: Callable[[Request], SequenceState] | None = None,
    finish: Callable[[SequenceState], RequestOutcome | None] | None = None,
) -> Recorder:
    """Serve ``requests`` one at a time, in the order given (arrival order).

    For each request: the clock set to its arrival; ``arrive(request)``
    makes its state (default :meth:`Runtime.arrive`: lifetime predicted,
    prefix looked up, observed); ``serve(state)`` runs it to its end in the
    engine and returns the pool's usage after it, or ``None`` when it can
    never run, which rejects it. A served request's usage is sampled, then
    ``finish(state)`` ends it (default :meth:`Runtime.conclude`, for an
    engine that returned the blocks itself; :meth:`Runtime.finish` for one
    whose blocks the runtime owns) and its outcome is recorded (``None``:
    the engine recorded it already). ``on_request`` is called after each
    request, served or rejected. Returns ``recorder``, its simulated time
    the last arrival's.
    """
    arrive = arrive or rt.arrive
    finish = finish or rt.conclude
    for request in requests:
        rt.set_time(request.arrival_s)
        state = arrive(request)
        usage = serve(state)
        if usage is None:
            rt.reject(state)
        else:
            recorder.sample(rt, rt.now_s, usage)
            outcome = finish(state)
            if outcome is not None:
                recorder.record(outcome)
        on_request()
    recorder.simulated_s = rt.now_s
    return recorder
