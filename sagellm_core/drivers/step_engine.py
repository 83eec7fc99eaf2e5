"""The engine protocol, and the step loop that the engines whose blocks the
runtime owns share.

An :class:`Engine` (vLLM's ``EngineCore`` is the model) takes requests
(``add_request``), runs one step at a time (``step``, returning what each
request produced), stops a request (``abort``) and says whether anything is
left to do (``has_work``). The server's engine thread drives the engine an
engine plugin starts (``LiveEngine.start``) through these four; the replay
loop (:func:`.arrivals.serve_arrivals`) also moves a step engine's clock.

:class:`StepEngine` is that protocol on a runtime that owns the blocks (the
replay engine's timed mode, the torch engine). Each step is vLLM's
``schedule``, execute, ``update_from_output``:

1. a compacting pool moves cached blocks to rejoin free runs
   (``Runtime.compact``), then the scheduling passes order the waiting and
   running requests (``Runtime.schedule``);
2. the step scheduler packs the step under the token budget and memory
   (:func:`.step_scheduler.pack`), admitting, growing and preempting
   through the runtime;
3. the executor runs it: a subclass's :meth:`StepEngine.execute` (the cost
   model in replay, a model on a device in torch), which returns the tokens
   sampled;
4. the step's outputs are applied (:meth:`StepEngine.apply_outputs`), the
   half every step engine shares: tokens computed, one token for each chunk
   that completes its sequence, the first token stamped, a prompt's blocks
   cached once its prefill is done, a finished request's blocks cached and
   released.

The step scheduler rejects what can never run (a request that needs more
blocks than the pool has, one the admission decision rejects, one deferred
while nothing runs); the step reports those as ``rejected``.

An executor that launches a step without waiting for its tokens (the torch
engine with ``async_scheduling``: :attr:`StepEngine.overlap`) has step N+1
packed while step N runs, as vLLM's asynchronous scheduling and SGLang's
overlap scheduler do. Each :meth:`StepEngine.step` then returns the outputs
of the step launched by the call before it, and leaves the next one running:

1. step N was launched at the end of the last call. If it was decodes only,
   its counters were advanced when it was launched (each sequence computed
   one token and samples one: vLLM's output placeholders), and a sequence
   that reaches its ``output_tokens`` with it left the running list then;
2. step N+1 is scheduled and packed as above, and the executor writes its
   inputs (:meth:`StepEngine.prepare`), its decodes reading the tokens
   step N samples where they lie, on the device;
3. the loop waits for step N's tokens (:meth:`StepEngine.collect`) and
   applies them: a sequence whose token is a stop token ends now, its
   blocks (a block step N+1 grew for it too) cached and released as in
   the serial loop, and leaves step N+1, whose inputs are written again;
4. step N+1 is launched (:meth:`StepEngine.launch`).

Where step N and step N+1 are both decodes only and the executor can run
step N+1 without step N's tokens on the host
(:meth:`StepEngine.may_launch_ahead`), step N+1 is launched before step
N's tokens are waited for (3 and 4 swap), so the device goes from one
step to the next without waiting for the host. A sequence that stops at
step N then runs in step N+1 all the same: it ends when step N is
applied, as above (its counters as step N left them), and step N+1's
token for it is dropped when step N+1 is applied
(:attr:`StepEngine.tokens_dropped`). The KV step N+1 writes for it lies
past its computed tokens, in a block that ending it does not cache, and
the device runs a later step's use of that block after step N+1.

A step with a prompt chunk is applied before the next is packed, as in the
serial loop (its prompt's blocks are cached, its first token stamped). The
tokens are the serial loop's; what may differ is when blocks come back: a
sequence that stops at step N held its blocks while step N+1 was packed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from itertools import count, repeat
from typing import Any, Protocol, runtime_checkable

from attrs import define, field

from sagellm_core.drivers.step_scheduler import PackedStep, pack
from sagellm_core.errors import RequestError
from sagellm_core.runtime import Runtime
from sagellm_core.types import Request, RequestOutcome, RequestStatus, ScheduleIR, SequenceState


@define
class StepOutput:
    """What one step produced for one request; nothing changes it once the
    step returned it. Not a frozen class: a step builds one per sequence,
    and a frozen attrs instance costs about four times as much to build."""

    request_id: str
    #: The token sampled this step; ``None`` for a rejected or aborted
    #: request, and from an engine that samples no token ids (replay).
    token_id: int | None
    finished: bool
    #: ``stop`` (end-of-sequence or a stop token), ``length``, ``abort``,
    #: ``rejected``; ``None`` while running.
    finish_reason: str | None = None
    outcome: RequestOutcome | None = None
    #: The token's log-probabilities, from an engine that computes them for
    #: a request that asked (the torch engine's ``TokenLogprobs``).
    logprobs: Any = None


@define(eq=False)
class Launched:
    """A step launched and not yet applied (:attr:`StepEngine.overlap`)."""

    step: PackedStep
    #: What the executor's :meth:`StepEngine.launch` returned for it.
    handle: Any
    #: Its counters were advanced at launch (a step of decodes only).
    advanced: bool
    #: Sequences of the step that end with it at their ``output_tokens``
    #: (out of the running list since the launch).
    finishing: list[SequenceState] = field(factory=list)


@runtime_checkable
class Engine(Protocol):
    """An engine as its drivers see it: the replay loop, the server."""

    def add_request(self, request: Request) -> None:
        """Queue ``request``; a ``RequestError`` (and nothing queued) when it
        can never be served."""

    def step(self) -> list[StepOutput]:
        """Schedule and run one step; what each request produced in it (an
        engine that samples no token ids reports the requests that ended)."""

    def abort(self, request_id: str) -> StepOutput | None:
        """End a request now (a client went away); ``None`` if it is not in flight."""

    def has_work(self) -> bool:
        """Whether a request waits or runs."""


class StepEngine:
    """:class:`Engine` over a runtime that owns the blocks, the executor left
    to a subclass: :meth:`execute`, :meth:`clock` and :meth:`wait_until`, and
    where it samples real tokens :meth:`sampled`, :meth:`generated_ids` and
    :meth:`ended`. ``add_request`` is the subclass's too: it checks what
    its engine cannot serve, then :meth:`arrive`.
    Not thread-safe: one caller drives it."""

    #: Launch a step and pack the next while it runs (the executor
    #: implements :meth:`prepare`, :meth:`launch` and :meth:`collect`).
    overlap = False

    def __init__(self, rt: Runtime, max_num_batched_tokens: int, max_num_seqs: int):
        self.rt = rt
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: list[SequenceState] = []
        self.running: list[SequenceState] = []
        #: Every request in flight (waiting or running), by id.
        self.requests: dict[str, SequenceState] = {}
        #: Steps executed, and the tokens they computed.
        self.steps = 0
        self.batched_tokens = 0
        #: With :attr:`overlap`: the step launched and not yet applied.
        self.launched: Launched | None = None
        #: With :attr:`overlap`: steps launched before the step ahead of
        #: them was applied, and the tokens such steps computed for
        #: sequences that had stopped (dropped).
        self.steps_launched_ahead = 0
        self.tokens_dropped = 0

    # ------------------------------------------------- the executor's part --

    def clock(self) -> float:
        """The engine's time: simulated seconds in replay, wall seconds in a real engine."""
        raise NotImplementedError

    def wait_until(self, when_s: float) -> None:
        """Nothing to do before ``when_s``: let the clock get there (or part of the way)."""
        raise NotImplementedError

    def execute(self, step: PackedStep) -> Sequence[int] | None:
        """Run ``step``; return the token sampled for each chunk that
        completes its sequence, in step order (``None``: no token ids)."""
        raise NotImplementedError

    def prepare(self, step: PackedStep, after: Any) -> None:
        """With :attr:`overlap`: write ``step``'s inputs; ``after`` is the
        handle of the step still running (or ``None``), whose sampled tokens
        are the inputs of ``step``'s decodes of the same sequences. Called
        again if sequences left ``step`` since."""
        raise NotImplementedError

    def launch(self, step: PackedStep) -> Any:
        """With :attr:`overlap`: start the prepared ``step`` without waiting
        for its tokens; return a handle for :meth:`collect`."""
        raise NotImplementedError

    def collect(self, handle: Any) -> Sequence[int] | None:
        """With :attr:`overlap`: wait for a launched step; its tokens, as
        :meth:`execute` returns them."""
        raise NotImplementedError

    def may_launch_ahead(self, step: PackedStep) -> bool:
        """With :attr:`overlap`: whether ``step`` (decodes only, prepared
        against the running step) may be launched before the running step's
        tokens are collected and applied: nothing of its launch reads them
        on the host (a constrained sampler does). No, by default."""
        return False

    def sampled(self, states: Sequence[SequenceState], token_ids: Sequence[int]) -> Collection[int]:
        """The requests of ``states`` (a step's chunks that complete their
        sequence, in step order) sampled ``token_ids``, one each: keep
        them; return the positions in ``states`` of those whose token ends
        the request (``stop``). Called once a step, before the outputs are
        applied."""
        return ()

    def generated_ids(self, state: SequenceState) -> Sequence[int] | None:
        """The token ids ``state``'s request generated, for the prefix cache
        (``None``: the workload's, ``Request.output_token_ids``)."""
        return None

    def ended(self, state: SequenceState) -> None:
        """``state``'s request left the engine (finished, aborted, rejected)."""

    # ------------------------------------------------------------ requests --

    def arrive(self, request: Request) -> SequenceState:
        """``request`` arrives (``Runtime.arrive``: its lifetime predicted,
        its prefix looked up) and waits. A RequestError, and nothing
        changed, if a request with its id is in flight."""
        request_id = request.request_id
        if request_id in self.requests:
            raise RequestError(f"request {request_id}: a request with this id is in flight")
        state = self.rt.arrive(request)
        self.requests[request_id] = state
        self.waiting.append(state)
        return state

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.launched)

    def abort(self, request_id: str) -> StepOutput | None:
        """End a request now: a running one finishes with what it generated
        (its blocks cached and freed at once), a waiting one is concluded."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        rt = self.rt
        rt.set_time(self.clock())
        if state in self.waiting:
            self.waiting.remove(state)
        if state in self.running:
            self.running.remove(state)
        launched = self.launched
        if launched is not None and launched.advanced and state in launched.step.states:
            # Its token in the running step is not known: it ends with what it has.
            state.num_computed_tokens -= 1
            state.num_output_tokens -= 1
        state.finish_s = rt.now_s
        if state.status is RequestStatus.RUNNING:
            outcome = rt.finish(state, self.generated_ids(state))
        else:
            outcome = rt.conclude(state)
        self._end(state)
        return StepOutput(request_id, None, True, "abort", outcome)

    def _end(self, state: SequenceState) -> None:
        del self.requests[state.request_id]
        self.ended(state)

    # ---------------------------------------------------------------- step --

    def step(self) -> list[StepOutput]:
        if self.overlap:
            return self._overlapped_step()
        rt = self.rt
        rejected, step = self._pack(True)
        if not step.states:
            return rejected
        self.steps += 1
        self.batched_tokens += step.num_batched_tokens
        tokens = self.execute(step)
        now = self.clock()
        rt.set_time(now)
        outputs = self.apply_outputs(step, tokens, now)
        return rejected + outputs if rejected else outputs

    def _pack(self, may_reject: bool) -> tuple[list[StepOutput], PackedStep]:
        """Schedule and pack the next step (the serial :meth:`step`'s first
        half): the rejected requests' outputs, and the step. Without
        ``may_reject``, a step in which nothing runs rejects no request for
        memory (:func:`.step_scheduler.pack`)."""
        rt = self.rt
        now = self.clock()
        rt.set_time(now)
        if rt.compacts:
            rt.compact()  # before the step takes blocks: the moves' KV is copied before anything is written
        # The passes reorder these lists in place; pack returns new ones.
        ir = ScheduleIR(
            now_s=now,
            waiting=self.waiting,
            running=self.running,
            token_budget=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
        )
        rt.schedule(ir)
        step = pack(rt, ir) if may_reject else pack(rt, ir, may_reject=False)
        self.running, self.waiting = step.running, step.waiting
        rejected = []
        for state in step.rejected:  # by the admission decision, or never to run
            self._end(state)
            rejected.append(StepOutput(state.request_id, None, True, "rejected"))
        return rejected, step

    def _overlapped_step(self) -> list[StepOutput]:
        """:meth:`step` with :attr:`overlap`: pack the next step while the
        launched one runs, apply the launched one, launch the next."""
        launched, self.launched = self.launched, None
        outputs: list[StepOutput] = []
        if launched is not None and not launched.advanced:
            outputs = self._land(launched)  # a step with a prompt chunk: applied before the next is packed
            launched = None
        rejected, step = self._pack(launched is None)
        if step.states:
            self.prepare(step, None if launched is None else launched.handle)
        if launched is not None and step.states and step.all_decode and self.may_launch_ahead(step):
            handle = self.launch(step)
            outputs = self._land(launched)
            gone = sum(1 for state in step.states if state.status is RequestStatus.FINISHED)
            self.steps_launched_ahead += 1
            self.tokens_dropped += gone
            self._launched(step, handle)
            return rejected + outputs if rejected else outputs
        if launched is not None:
            outputs = self._land(launched)
            gone = [state for state in step.states if state.status is RequestStatus.FINISHED]
            if gone:  # stopped at the launched step: out of this one
                for state in gone:
                    step._drop(state)
                step._sum()
                if step.states:
                    self.prepare(step, launched.handle)
        if step.states:
            self._launched(step, self.launch(step))
        return rejected + outputs if rejected else outputs

    def _launched(self, step: PackedStep, handle: Any) -> None:
        """``step`` was launched: it is the step in flight. A step of
        decodes only has its counters advanced now (the next is packed
        before its tokens are known), but for a sequence that stopped since
        it was launched (ended, its token to be dropped)."""
        self.steps += 1
        self.batched_tokens += step.num_batched_tokens
        self.launched = launched = Launched(step, handle, step.all_decode)
        if step.all_decode:
            running = self.running
            for state in step.states:
                if state.status is RequestStatus.FINISHED:
                    continue
                state.num_computed_tokens += 1
                state.num_output_tokens += 1
                if state.num_output_tokens >= state.request.output_tokens:
                    launched.finishing.append(state)
            if launched.finishing:
                ending = set(map(id, launched.finishing))
                self.running = [state for state in running if id(state) not in ending]

    def _land(self, launched: Launched) -> list[StepOutput]:
        """Wait for a launched step and apply its outputs (the requests
        that ended since it was launched have none)."""
        step = launched.step
        tokens = self.collect(launched.handle)
        now = self.clock()
        self.rt.set_time(now)
        requests = self.requests
        ended = [state for state in step.states if requests.get(state.request_id) is not state]
        if ended:  # aborted while it ran: its token is dropped with its chunk
            if tokens is not None:
                kept = iter(tokens)
                sampled = [(s, next(kept)) for s, c in zip(step.states, step.completes) if c]
                tokens = [t for s, t in sampled if requests.get(s.request_id) is s]
            for state in ended:
                step._drop(state)
            step._sum()
        if not launched.advanced:
            return self.apply_outputs(step, tokens, now)
        return self._apply_advanced(step.states, tokens, now)

    def _apply_advanced(
        self, states: list[SequenceState], tokens: Sequence[int] | None, now: float
    ) -> list[StepOutput]:
        """:meth:`_apply_decodes` of a step whose counters were advanced when
        it was launched: the tokens kept, the stops and the ends applied. A
        sequence preempted since (by the next step's packing) keeps its
        token and waits; one whose token was a stop ends from the queue."""
        outputs: list[StepOutput] = []
        append = outputs.append
        stops = frozenset(self.sampled(states, tokens)) if tokens is not None else frozenset()
        for k, state, token in zip(count(), states, repeat(None) if tokens is None else tokens):
            request = state.request
            if stops and k in stops:
                if state.status is RequestStatus.WAITING:  # preempted since: its blocks are already back
                    self.waiting.remove(state)
                    state.finish_s = now
                    outcome = self.rt.conclude(state)
                    self._end(state)
                    append(StepOutput(request.request_id, token, True, "stop", outcome))
                else:
                    append(self._finish(state, token, "stop", now))
            elif state.num_output_tokens < request.output_tokens:
                if token is not None:
                    append(StepOutput(request.request_id, token, False))
            else:
                append(self._finish(state, token, "length", now))
        return outputs

    def apply_outputs(self, step: PackedStep, tokens: Sequence[int] | None, now: float) -> list[StepOutput]:
        """Apply what ``step`` computed at ``now``: each chunk's tokens are
        in KV; a chunk that completes its sequence brings one token (from
        ``tokens``, in step order, kept by :meth:`sampled`), the first
        stamps ``first_token_s``; a finished prefill caches the prompt's
        blocks for the requests that share them; a request ends at a stop
        token or at its ``output_tokens`` (``length``), cached and released.
        Returns an output per token sampled, or with no token ids
        (``tokens`` is ``None``: nothing to stream) per request that ended,
        in step order."""
        if step.all_decode:
            return self._apply_decodes(step.states, tokens, now)
        rt, outputs = self.rt, []
        if tokens is None:
            sampled, stops = repeat(None), frozenset()
        else:
            completing = [state for state, completes in zip(step.states, step.completes) if completes]
            sampled, stops = iter(tokens), frozenset(self.sampled(completing, tokens))
        k = -1  # the position of the chunk among those that complete their sequence
        for state, n, prefill, completes in zip(step.states, step.num_new, step.prefill, step.completes):
            state.num_computed_tokens += n
            if not completes:
                continue  # a prefill chunk that is not the last
            k += 1
            num_output = state.num_output_tokens + 1
            state.num_output_tokens = num_output
            if state.first_token_s is None:
                state.first_token_s = now
            token = next(sampled)
            if prefill:
                rt.cache(state, self.generated_ids(state))
            if stops and k in stops:
                outputs.append(self._finish(state, token, "stop", now))
            elif num_output < state.request.output_tokens:
                if token is not None:
                    outputs.append(StepOutput(state.request_id, token, False))
            else:
                outputs.append(self._finish(state, token, "length", now))
        return outputs

    def _apply_decodes(self, states: list[SequenceState], tokens: Sequence[int] | None, now: float) -> list[StepOutput]:
        """:meth:`apply_outputs` of a step of decodes only (``PackedStep.all_decode``),
        as most steps are: each sequence computed one token and sampled the next."""
        outputs: list[StepOutput] = []
        append = outputs.append
        stops = frozenset(self.sampled(states, tokens)) if tokens is not None else frozenset()
        for k, state, token in zip(count(), states, repeat(None) if tokens is None else tokens):
            state.num_computed_tokens += 1
            num_output = state.num_output_tokens = state.num_output_tokens + 1
            if state.first_token_s is None:
                state.first_token_s = now
            request = state.request
            if stops and k in stops:
                append(self._finish(state, token, "stop", now))
            elif num_output < request.output_tokens:
                if token is not None:
                    append(StepOutput(request.request_id, token, False))
            else:
                append(self._finish(state, token, "length", now))
        return outputs

    def _finish(self, state: SequenceState, token: int | None, reason: str, now: float) -> StepOutput:
        """``state``'s request ends at ``now`` with ``reason``: its blocks cached and released."""
        state.finish_s = now
        if state in self.running:  # (one that ends at its length with a launched step left it then)
            self.running.remove(state)
        outcome = self.rt.finish(state, self.generated_ids(state))
        self._end(state)
        return StepOutput(state.request_id, token, True, reason, outcome)
