"""vLLM's v1 scheduler with sagellm deciding.

``SagellmScheduler`` (and ``SagellmAsyncScheduler``, for vLLM's default async
scheduling) is vLLM's own scheduler; what it adds:

* each step, before vLLM schedules, the sagellm scheduling passes reorder
  ``waiting`` (admission order) and ``running`` (budget order), and may lower
  the step's token budget and sequence slots;
* when memory runs out for a running request, the victim-selection hook
  (``sagellm_select_preemption``) chooses which running request vLLM preempts;
* which free cached block vLLM evicts is chosen by ``sagellm_select_victims``
  (:mod:`sagellm_plugin_vllm.block_pool`);
* with ``SagellmConnector`` as vLLM's KV connector, the transport hook
  places offloaded blocks on the host tier and loads them back
  (:mod:`sagellm_plugin_vllm.connector`);
* every request gets a lifetime prediction at arrival, which passes and
  policies read from its :class:`SequenceState`; arrivals and finishes are
  observed as in ``sagellm replay``.

vLLM's own hash table, block pool and allocation stay: sagellm's
``[prefix_cache]`` and ``[kv_pool]`` sections do not apply inside vLLM.

Live serving (``vllm serve --scheduler-cls
sagellm_plugin_vllm.SagellmScheduler``) reads the sagellm config named by
``--additional-config '{"sagellm_config": "FILE"}'`` or the ``SAGELLM_CONFIG``
environment variable; a harness may pass a built ``Runtime`` instead.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from functools import partial
from itertools import islice, repeat
from operator import attrgetter

from sagellm_core.errors import PluginError
from sagellm_core.runtime import Runtime
from sagellm_core.types import (
    EMPTY_MATCH,
    PrefixMatch,
    Request,
    RequestOutcome,
    RequestStatus,
    ScheduleIR,
    SequenceState,
)
from sagellm_plugin_vllm.block_pool import attach
from sagellm_plugin_vllm.compat import (
    AsyncScheduler,
    FCFSRequestQueue,
    Scheduler,
    SchedulingPolicy,
    VllmRequest,
    VllmRequestStatus,
)
from sagellm_plugin_vllm.connector import SagellmConnector
from sagellm_plugin_vllm.live import load_runtime


def _chunk_limits_refused(rt: Runtime) -> PluginError:
    """A pass capped requests' chunks (``ScheduleIR.chunk_limits``): vLLM
    sizes each request's chunk itself, so the caps would be dropped unsaid."""
    return PluginError(
        f"{rt.host.who('scheduler')} set chunk_limits (per-request chunk caps), which the vllm engine"
        " does not honour: vLLM sizes each request's chunk itself; run chunk-capping passes (tenant-shares)"
        " on the replay or torch engine"
    )


#: vLLM request -> its SequenceState (set at add_request).
_sagellm_state = attrgetter("sagellm_state")
_request_id = attrgetter("request_id")
_num_computed_tokens = attrgetter("num_computed_tokens")
#: The list behind vLLM's ``Request.num_output_tokens`` property (read
#: through map() without a Python frame per request).
_output_token_ids = attrgetter("_output_token_ids")
#: Runs an iterator of C calls (setattr through map) to its end.
_consume = partial(deque, maxlen=0)


def sagellm_request(request: VllmRequest, origin: Request | None = None) -> Request:
    """sagellm's view of a vLLM request. ``origin``: the sagellm request a
    driver made this vLLM request from, where it has one: its prompt array
    is taken as is (not copied back from vLLM's list), and so are the facts
    vLLM does not carry (tenant, session, text, deadline, KV hints), so that
    tenant- and hint-aware policies see them inside vLLM too."""
    if origin is None:
        return Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids or (),
            output_tokens=request.max_tokens,
            arrival_s=request.arrival_time,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
    return Request(
        request_id=request.request_id,
        prompt_token_ids=origin.prompt_token_ids,
        output_tokens=request.max_tokens,
        arrival_s=request.arrival_time,
        tenant=origin.tenant,
        priority=request.priority,
        session_id=origin.session_id,
        cache_salt=request.cache_salt,
        prompt_text=origin.prompt_text,
        deadline_s=origin.deadline_s,
        kv_hints=origin.kv_hints,
    )


class WaitingQueue(FCFSRequestQueue):
    """vLLM's FIFO waiting queue, telling the scheduler how it changed since
    the scheduler last mapped it to states: requests appended at the tail
    (arrivals) and taken from the head (admissions) are counted, anything
    else (preemptions put back at the head, removals, reorders) marks it
    ``reordered``, so the next step maps it all again."""

    def __init__(self, *args):
        super().__init__(*args)
        self.reordered = True
        self.popped = 0

    def add_request(self, request: VllmRequest) -> None:
        deque.append(self, request)  # an arrival: found as the tail the states lack

    def pop_request(self) -> VllmRequest:
        self.popped += 1  # an admission from the head
        return deque.popleft(self)


def _marks_reordered(name: str) -> Callable:
    method = getattr(deque, name)

    def changes(self: WaitingQueue, *args):
        self.reordered = True
        return method(self, *args)

    changes.__name__ = name
    return changes


# Every other way to change a deque: the next step maps the queue again.
for _name in (
    "append",
    "appendleft",
    "clear",
    "extend",
    "extendleft",
    "insert",
    "pop",
    "popleft",
    "remove",
    "reverse",
    "rotate",
    "__delitem__",
    "__setitem__",
    "__iadd__",
):
    setattr(WaitingQueue, _name, _marks_reordered(_name))
del _name


class SagellmDecisions:
    """The decisions, mixed into vLLM's ``Scheduler`` or ``AsyncScheduler``."""

    def __init__(
        self,
        *args,
        sagellm_runtime: Runtime | None = None,
        on_finished: Callable[[RequestOutcome], None] | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self._on_finished = on_finished
        harness = sagellm_runtime is not None
        pool = self.kv_cache_manager.block_pool
        # The null block is not a KV block anyone can use.
        num_blocks = len(pool.blocks) - 1
        if sagellm_runtime is None:
            path = (self.vllm_config.additional_config or {}).get("sagellm_config")
            sagellm_runtime = load_runtime(num_blocks, self.block_size, path)
        self.sagellm = sagellm_runtime
        #: In a live engine, sagellm's clock is wall time; a harness that
        #: passes its runtime keeps its own (simulated) clock.
        self._wall_clock = not harness
        attach(pool, self.sagellm)
        if isinstance(self.connector, SagellmConnector):
            self.connector.bind_runtime(self.sagellm)  # one runtime, one transport
        # The sagellm passes order admissions, so waiting is a plain FIFO.
        self.waiting = WaitingQueue(self.waiting)
        #: The waiting requests' states, in queue order, as of the last step
        #: (kept up to date from what the queue says changed).
        self._waiting_states: list[SequenceState] = []
        # vLLM's general preemption branch: the victim may be any running
        # request (an already-scheduled one gets its budget back). It takes
        # max(running, key=(priority, arrival_time)); the adapter marks the
        # hook's choice with the highest priority for that one decision.
        self.policy = SchedulingPolicy.PRIORITY
        self._marked: dict[str, tuple[VllmRequest, int]] = {}
        self._limits = (self.max_num_scheduled_tokens, self.max_num_running_reqs)
        #: Without scheduling passes nothing reads the ScheduleIR: no state
        #: is mapped or refreshed per step (first tokens are still stamped).
        self._has_passes = bool(self.sagellm.host.plugins.get("scheduler"))
        #: Requests whose first token is not stamped yet (by id): each step
        #: looks only at those of them that run.
        self._awaiting_first_token: set[str] = set()

    # ------------------------------------------------------------ requests --

    def add_request(self, request: VllmRequest) -> None:
        is_new = request.request_id not in self.requests
        super().add_request(request)
        if not is_new:
            return
        if self._wall_clock:
            self.sagellm.set_time(time.time())
        # The match vLLM's own lookup would find now (sagellm's prefix cache
        # does not run inside vLLM), read off the pool observer's hash index
        # instead of a second get_computed_blocks: vLLM looks up again when
        # it admits the request, and its hit is the one counted.
        manager = self.kv_cache_manager
        observer = getattr(manager.block_pool, "sagellm", None)
        match: PrefixMatch | int = EMPTY_MATCH
        if observer is not None and manager.prefix_cache_lookup_enabled(request):
            # At least one token is always computed, as vLLM's lookup leaves it.
            limit = (request.num_tokens - 1) // self.block_size
            if self.sagellm.observes_arrivals:
                match = observer.match(request.block_hashes, limit)
            else:  # only its length is read
                match = observer.match_length(request.block_hashes, limit)
        # A driver that made this request from a sagellm one hands that over
        # (``sagellm_request``): its prompt array and the facts vLLM lacks.
        origin = request.__dict__.pop("sagellm_request", None)
        # Kept on the request itself: each step maps every waiting request to
        # its state, and an attribute read through map() is C-speed.
        request.sagellm_state = self.sagellm.arrive(sagellm_request(request, origin), match=match)
        self._awaiting_first_token.add(request.request_id)

    def _free_request(self, request: VllmRequest, *args, **kwargs):
        result = super()._free_request(request, *args, **kwargs)
        state = getattr(request, "sagellm_state", None)
        if state is not None:
            del request.sagellm_state  # concluded once
            self._awaiting_first_token.discard(request.request_id)
            now = time.time() if self._wall_clock else self.sagellm.now_s
            state.num_output_tokens = request.num_output_tokens
            state.num_preemptions = request.num_preemptions
            if state.first_token_s is None:
                state.first_token_s = now
            state.finish_s = now
            outcome = self.sagellm.conclude(state)
            if self._on_finished is not None:
                self._on_finished(outcome)
        return result

    def _running_states(self) -> list[SequenceState]:
        """The running requests' states, refreshed (only these change from
        step to step; a waiting one changes when it is preempted). The
        copies run as setattr through map(): no Python step per request."""
        running_requests = self.running
        running = list(map(_sagellm_state, running_requests))
        _consume(map(setattr, running, repeat("num_computed_tokens"), map(_num_computed_tokens, running_requests)))
        output_counts = map(len, map(_output_token_ids, running_requests))
        _consume(map(setattr, running, repeat("num_output_tokens"), output_counts))
        _consume(map(setattr, running, repeat("status"), repeat(RequestStatus.RUNNING)))
        return running

    def _waiting_states_now(self) -> list[SequenceState]:
        """The waiting requests' states, in queue order. Mapping all of
        them each step would touch every waiting request (1,024 of them
        cost more than a step of stock vLLM's work on them); here only the
        arrivals and admissions since the last step are applied, unless the
        queue was reordered otherwise."""
        queue = self.waiting
        states = self._waiting_states
        if not queue.reordered:
            if queue.popped:
                del states[: queue.popped]  # admitted from the head
            missing = len(queue) - len(states)  # arrived at the tail
            if missing > 0:
                arrived = list(islice(reversed(queue), missing))
                arrived.reverse()
                states.extend(map(_sagellm_state, arrived))
            # A cheap guard against a change the queue did not see.
            if len(states) != len(queue) or (states and states[0] is not queue[0].sagellm_state):
                queue.reordered = True
        if queue.reordered:
            states = self._waiting_states = list(map(_sagellm_state, queue))
            queue.reordered = False
        queue.popped = 0
        return states

    def _stamp_first_tokens(self) -> None:
        """Stamp ``first_token_s`` on running requests that have output now
        (by the step after their first token, at the latest)."""
        awaiting = self._awaiting_first_token
        if not awaiting:
            return
        now = self.sagellm.now_s
        requests = self.requests
        for request_id in awaiting.intersection(map(_request_id, self.running)):
            request = requests[request_id]
            if request.num_output_tokens:
                request.sagellm_state.first_token_s = now
                awaiting.discard(request_id)

    def _preempt_request(self, request: VllmRequest, *args, **kwargs):
        # A waiting request's state changes only here (and at arrival), so
        # only running states are refreshed each step.
        super()._preempt_request(request, *args, **kwargs)
        state = request.sagellm_state
        state.num_computed_tokens = request.num_computed_tokens
        state.num_output_tokens = request.num_output_tokens
        state.num_preemptions = request.num_preemptions
        state.status = RequestStatus.WAITING

    # ------------------------------------------------------------ schedule --

    def schedule(self, *args, **kwargs):
        if self._wall_clock:
            self.sagellm.set_time(time.time())
        self._run_passes()
        # Allocation can fail (and vLLM preempt) only if the free blocks
        # cannot cover the step's worst case: every scheduled token and
        # lookahead slot in a new block, plus a partial block per sequence.
        # Only then is allocate_slots watched, sparing the common step a
        # Python frame per request.
        manager = self.kv_cache_manager
        worst = (
            -(
                -(self.max_num_scheduled_tokens + self.max_num_running_reqs * self.num_lookahead_tokens)
                // self.block_size
            )
            + self.max_num_running_reqs
        )
        watch = manager.block_pool.get_num_free_blocks() <= worst
        if watch:
            manager.allocate_slots = self._allocate_slots
        try:
            return super().schedule(*args, **kwargs)
        finally:
            if watch:
                del manager.allocate_slots  # back to the class's method
            for request, priority in self._marked.values():
                request.priority = priority
            self._marked.clear()
            self.max_num_scheduled_tokens, self.max_num_running_reqs = self._limits

    def _run_passes(self) -> None:
        if not self.waiting and not self.running:
            return
        self._stamp_first_tokens()
        if not self._has_passes:
            return
        waiting = self._waiting_states_now()
        running = self._running_states()
        ir = ScheduleIR(
            now_s=self.sagellm.now_s,
            waiting=waiting,
            running=running,
            token_budget=self.max_num_scheduled_tokens,
            max_num_seqs=self.max_num_running_reqs,
        )
        try:
            moved = self.sagellm.schedule(ir)
            if ir.chunk_limits:
                raise _chunk_limits_refused(self.sagellm)
        except BaseException:
            self.waiting.reordered = True  # a pass may have reordered the list in place
            raise
        if "waiting" in moved:
            self.waiting.clear()
            self.waiting.extend(self.requests[s.request_id] for s in ir.waiting)
            self._waiting_states, self.waiting.reordered = ir.waiting, False
        if "running" in moved:
            self.running[:] = [self.requests[s.request_id] for s in ir.running]
        self.max_num_scheduled_tokens = min(ir.token_budget, self._limits[0])
        self.max_num_running_reqs = min(ir.max_num_seqs, self._limits[1])

    def _allocate_slots(self, request: VllmRequest, *args, **kwargs):
        manager = self.kv_cache_manager  # the current one: callers may replace it
        blocks = type(manager).allocate_slots(manager, request, *args, **kwargs)
        if blocks is None and request.status == VllmRequestStatus.RUNNING and self.running:
            # vLLM preempts next: make the hook's choice the one it takes.
            victim = self.sagellm.select_preemption(self._running_states(), request.sagellm_state).request_id
            for r in self.running:
                self._marked.setdefault(r.request_id, (r, r.priority))
                r.priority = 1 if r.request_id == victim else 0
        return blocks


class SagellmScheduler(SagellmDecisions, Scheduler):
    """``--scheduler-cls sagellm_plugin_vllm.SagellmScheduler``"""


class SagellmAsyncScheduler(SagellmDecisions, AsyncScheduler):
    """``--scheduler-cls sagellm_plugin_vllm.SagellmAsyncScheduler`` (with
    vLLM's async scheduling, its default)."""
