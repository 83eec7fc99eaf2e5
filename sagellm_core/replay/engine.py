"""The replay engine (engine name ``replay``): drives the runtime over a
workload in simulated time.

* ``timed``: continuous batching as vLLM v1 schedules it. Each step gives a
  token budget first to running requests (decode, or the next prefill chunk),
  preempting by the victim-selection hook when blocks run out, then admits
  waiting requests in the order the scheduling passes left them (stopping at
  the first that does not fit). Step time comes from the roofline cost model.
* ``cache-only``: each request is served alone, in arrival order, as cache
  simulators do; no batching, no time model. For comparing prefix-cache and
  eviction policies without engine dynamics.
"""

from __future__ import annotations

import gc
import heapq
import math
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import attrs
from attrs import field, frozen, validators

from sagellm_core.drivers.serial import serve_serially
from sagellm_core.drivers.stepping import pack
from sagellm_core.registry import PluginContext
from sagellm_core.replay.costmodel import HARDWARE, MODELS, CostModel
from sagellm_core.runtime import Runtime
from sagellm_core.types import PoolUsage, Request, RequestOutcome, ScheduleIR, SequenceState

MODES = ("timed", "cache-only")


@frozen
class ReplaySettings:
    mode: str = field(default="timed", validator=validators.in_(MODES))
    hardware: str = field(default="h100", validator=validators.in_(sorted(HARDWARE)))
    model: str = field(default="llama-3.1-8b", validator=validators.in_(sorted(MODELS)))
    max_num_batched_tokens: int = field(default=8192, validator=[validators.instance_of(int), validators.gt(0)])
    max_num_seqs: int = field(default=256, validator=[validators.instance_of(int), validators.gt(0)])
    flops_efficiency: float = field(default=0.6, validator=[validators.gt(0), validators.le(1)])
    bandwidth_efficiency: float = field(default=0.8, validator=[validators.gt(0), validators.le(1)])
    step_overhead_s: float = field(default=0.002, validator=validators.ge(0))
    #: cache-only: blocks for this many tokens beyond the prompt are taken at
    #: admission, as LMDeploy's prefill reserves 16 tokens of decode room.
    prealloc_tokens: int = field(default=0, validator=[validators.instance_of(int), validators.ge(0)])
    #: timed: a conversation's turn (same ``session_id``) is sent only once
    #: its previous turn has finished, at the later of its own arrival and
    #: that finish, as a user waits for the answer before writing again.
    #: Off, turns arrive when the workload says, answered or not.
    closed_loop: bool = field(default=False, validator=validators.instance_of(bool))


@attrs.define
class Recorder:
    """What the replay observed, beyond the runtime's counters: per finished
    request its latencies (numbers only: keeping the outcomes would keep every
    prompt's tokens alive), and a timeline (at most ``max_samples`` points)."""

    ttft_s: array = attrs.field(factory=lambda: array("d"))
    tpot_s: array = attrs.field(factory=lambda: array("d"))
    e2e_s: array = attrs.field(factory=lambda: array("d"))
    finished: int = 0
    #: Finished requests that had a deadline, and those whose first token
    #: came by it.
    deadlines: int = 0
    deadlines_met: int = 0
    output_tokens: int = 0
    first_arrival_s: float = math.inf
    #: (time s, cumulative block hit rate, used blocks, cached blocks)
    timeline: list[tuple[float, float, int, int]] = attrs.field(factory=list)
    steps: int = 0
    batched_tokens: int = 0
    used_block_sum: float = 0.0
    used_block_samples: int = 0
    used_block_peak: int = 0
    fragmentation_sum: float = 0.0
    simulated_s: float = 0.0
    #: The engine's prefill cost: (FLOPs per token, FLOPs per causal token
    #: pair), for the share of prefill compute that cache hits saved.
    prefill_flops: tuple[float, float] | None = None
    max_samples: int = 2000
    _every: int = 1
    _events: int = 0

    def record(self, outcome: RequestOutcome) -> None:
        self.finished += 1
        self.output_tokens += outcome.num_output_tokens
        self.first_arrival_s = min(self.first_arrival_s, outcome.arrival_s)
        self.ttft_s.append(outcome.ttft_s)
        deadline = outcome.request.deadline_s
        if deadline is not None:
            self.deadlines += 1
            self.deadlines_met += outcome.first_token_s <= deadline
        self.e2e_s.append(outcome.finish_s - outcome.arrival_s)
        if outcome.tpot_s is not None:
            self.tpot_s.append(outcome.tpot_s)

    def sample(self, rt: Runtime, now_s: float, usage: PoolUsage) -> None:
        used_blocks = usage.num_used_blocks
        self.fragmentation_sum += usage.external_fragmentation
        self.used_block_sum += used_blocks
        self.used_block_samples += 1
        self.used_block_peak = max(self.used_block_peak, used_blocks)
        self._events += 1
        if self._events % self._every:
            return
        c = rt.counters
        rate = c.hit_blocks / c.query_blocks if c.query_blocks else 0.0
        self.timeline.append((now_s, rate, used_blocks, rt.num_cached_blocks))
        if len(self.timeline) >= self.max_samples:
            self.timeline = self.timeline[::2]
            self._every *= 2


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


@contextmanager
def _fewer_collections() -> Iterator[None]:
    """Run the cyclic garbage collector less often during a replay: a replay
    allocates objects by the million, few of them in cycles, and a young
    collection every 700 allocations (Python's default) traverses them again
    and again. The objects built before the run (the plugins, the config)
    are moved out of the collector's sight meanwhile, as vLLM's engine does
    after its start (``gc.freeze``), unless the process froze some itself.
    Both are undone after the run."""
    threshold, freeze = gc.get_threshold(), gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(10_000, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if freeze:
            gc.unfreeze()


class ReplayEngine:
    """The embedded default engine."""

    Settings = ReplaySettings

    def __init__(self, settings: ReplaySettings, context: PluginContext):
        self.settings = settings
        self.cost = CostModel(
            HARDWARE[settings.hardware],
            MODELS[settings.model],
            settings.flops_efficiency,
            settings.bandwidth_efficiency,
            settings.step_overhead_s,
        )

    def run(self, rt: Runtime, requests: Iterator[Request], on_request: Callable[[], None] = lambda: None) -> Recorder:
        recorder = Recorder(prefill_flops=(self.cost.model.flops_per_token, self.cost.model.flops_per_token_pair))
        with _fewer_collections():
            if self.settings.mode == "cache-only":
                self._cache_only(rt, requests, recorder, on_request)
            else:
                self._timed(rt, requests, recorder, on_request)
        return recorder

    # ---------------------------------------------------------- cache-only --

    def _cache_only(self, rt: Runtime, requests, recorder: Recorder, on_request) -> None:
        prealloc = self.settings.prealloc_tokens

        def serve(state: SequenceState) -> PoolUsage | None:
            request = state.request
            if not rt.admit(state, state.num_tokens, prealloc):
                return None
            state.num_computed_tokens = request.num_prompt_tokens
            state.first_token_s = rt.now_s
            out = request.output_tokens
            # Outputs whose ids are known are computed and cached like a real
            # engine caches them; unknown ones hold no KV here.
            if request.output_token_ids is not None and rt.grow(state, out):
                state.num_computed_tokens += out
            state.num_output_tokens = out
            state.finish_s = rt.now_s
            return rt.pool_usage()

        serve_serially(rt, requests, serve, recorder, on_request, finish=rt.finish)

    # --------------------------------------------------------------- timed --

    def _timed(self, rt: Runtime, requests, recorder: Recorder, on_request) -> None:
        s = self.settings
        cost = self.cost
        arrivals = Arrivals(requests, s.closed_loop)
        waiting: list[SequenceState] = []
        running: list[SequenceState] = []
        now = 0.0
        while True:
            if arrivals.any_due(now):
                for request in arrivals.due(now):
                    rt.set_time(request.arrival_s)
                    waiting.append(rt.arrive(request))
            if not waiting and not running:
                nxt = arrivals.next_arrival_s()
                if nxt is None:
                    break
                now = nxt
                continue
            rt.set_time(now)
            # The passes reorder these lists in place: pack returns new ones,
            # so nothing else holds them.
            ir = ScheduleIR(
                now_s=now,
                waiting=waiting,
                running=running,
                token_budget=s.max_num_batched_tokens,
                max_num_seqs=s.max_num_seqs,
            )
            rt.schedule(ir)
            step = pack(rt, ir)
            running, waiting = step.running, step.waiting
            if not step.states:
                # Nothing runs and the head of the queue does not fit even an
                # empty pool (its prompt and output need more blocks than
                # there are): it can never be served.
                head = waiting.pop(0)
                rt.reject(head)
                arrivals.done(head.request, now)
                on_request()
                continue
            now += cost.step_time_of(step.num_batched_tokens, step.attention_pairs, step.kv_tokens)
            rt.set_time(now)
            for state, n, prefill, completes in zip(step.states, step.num_new, step.prefill, step.completes):
                state.num_computed_tokens += n
                if not completes:
                    continue  # a prefill chunk that is not the last
                num_output = state.num_output_tokens + 1  # the step samples one token
                state.num_output_tokens = num_output
                if state.first_token_s is None:
                    state.first_token_s = now
                if prefill:
                    rt.cache(state)
                if num_output >= state.request.output_tokens:
                    state.finish_s = now
                    running.remove(state)
                    recorder.record(rt.finish(state))
                    arrivals.done(state.request, now)
                    on_request()
            recorder.steps += 1
            recorder.batched_tokens += step.num_batched_tokens
            recorder.sample(rt, now, rt.pool_usage())
        recorder.simulated_s = now
