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
from collections.abc import Callable
from operator import attrgetter

from sagellm_core.runtime import Runtime
from sagellm_core.types import PrefixMatch, Request, RequestOutcome, RequestStatus, ScheduleIR, SequenceState
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

#: vLLM request -> its SequenceState (set at add_request).
_sagellm_state = attrgetter("sagellm_state")


def sagellm_request(request: VllmRequest) -> Request:
    return Request(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids or (),
        output_tokens=request.max_tokens,
        arrival_s=request.arrival_time,
        priority=request.priority,
        cache_salt=request.cache_salt,
    )


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
        self.waiting = FCFSRequestQueue(self.waiting)
        # vLLM's general preemption branch: the victim may be any running
        # request (an already-scheduled one gets its budget back). It takes
        # max(running, key=(priority, arrival_time)); the adapter marks the
        # hook's choice with the highest priority for that one decision.
        self.policy = SchedulingPolicy.PRIORITY
        self._marked: dict[str, tuple[VllmRequest, int]] = {}
        self._limits = (self.max_num_scheduled_tokens, self.max_num_running_reqs)

    # ------------------------------------------------------------ requests --

    def add_request(self, request: VllmRequest) -> None:
        is_new = request.request_id not in self.requests
        super().add_request(request)
        if not is_new:
            return
        if self._wall_clock:
            self.sagellm.set_time(time.time())
        # vLLM's own lookup is the match (sagellm's prefix cache does not
        # run inside vLLM), described as the pool's observer knows the blocks.
        computed, *_ = self.kv_cache_manager.get_computed_blocks(request)
        observer = getattr(self.kv_cache_manager.block_pool, "sagellm", None)
        hit = computed.blocks[0] if computed.blocks and observer is not None else ()
        match = PrefixMatch(tuple(observer.cached[b.block_id] for b in hit if b.block_id in observer.cached))
        # Kept on the request itself: each step maps every waiting request to
        # its state, and an attribute read through map() is C-speed.
        request.sagellm_state = self.sagellm.arrive(sagellm_request(request), match=match)

    def _free_request(self, request: VllmRequest, *args, **kwargs):
        result = super()._free_request(request, *args, **kwargs)
        state = getattr(request, "sagellm_state", None)
        if state is not None:
            del request.sagellm_state  # concluded once
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
        step to step; a waiting one changes when it is preempted)."""
        running = list(map(_sagellm_state, self.running))
        now = self.sagellm.now_s
        for request, state in zip(self.running, running):
            state.num_computed_tokens = request.num_computed_tokens
            state.num_output_tokens = num_output = request.num_output_tokens
            state.status = RequestStatus.RUNNING
            if num_output and state.first_token_s is None:
                state.first_token_s = now  # by the step after it, at the latest
        return running

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
        waiting = list(map(_sagellm_state, self.waiting))
        running = self._running_states()
        ir = ScheduleIR(
            now_s=self.sagellm.now_s,
            waiting=waiting,
            running=running,
            token_budget=self.max_num_scheduled_tokens,
            max_num_seqs=self.max_num_running_reqs,
        )
        moved = self.sagellm.schedule(ir)
        if "waiting" in moved:
            self.waiting.clear()
            self.waiting.extend(self.requests[s.request_id] for s in ir.waiting)
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
