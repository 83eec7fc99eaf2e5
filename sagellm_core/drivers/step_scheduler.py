"""The step scheduler: the one continuous-batching rule every step engine
uses (:class:`~sagellm_core.drivers.step_engine.StepEngine`: the replay
engine's timed mode simulates it, the torch engine runs it on a real
model). :func:`pack` fills one step under the token budget and memory,
after the scheduling passes have ordered the queues."""

from __future__ import annotations

from operator import mul

from attrs import frozen

from sagellm_core.runtime import Runtime, blocks_for
from sagellm_core.types import Admission, ScheduleIR, SequenceState

#: Why a request is rejected that needs more blocks than an empty pool has.
NEVER_FITS = "never fits the pool"


@frozen
class ScheduledChunk:
    request_id: str
    num_new_tokens: int
    #: Tokens already in KV before this step (cached or computed).
    num_context_tokens: int
    is_prefill: bool


@frozen
class StepPlan:
    """The batch one step executes, after packing under budget and memory."""

    chunks: tuple[ScheduledChunk, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class PackedStep:
    """One packed step as parallel lists, entry ``i`` a chunk in batch order,
    with the totals a cost model reads. :meth:`plan` makes it a
    :class:`StepPlan` for an executor that wants chunk objects (the torch
    engine); the replay engine reads the lists, since a chunk object per
    running sequence per step was a large share of a timed replay's time."""

    __slots__ = (
        "states",
        "num_new",
        "context",
        "prefill",
        "completes",
        "all_decode",
        "num_batched_tokens",
        "attention_pairs",
        "kv_tokens",
        "running",
        "waiting",
        "deferred",
        "rejected",
    )

    def __init__(self) -> None:
        self.states: list[SequenceState] = []
        self.num_new: list[int] = []
        #: Tokens in KV before the step (``ScheduledChunk.num_context_tokens``).
        self.context: list[int] = []
        self.prefill: list[bool] = []
        #: The chunk computes the sequence's last missing token: the step
        #: samples one token for it.
        self.completes: list[bool] = []
        #: Every chunk is a decode: one token of a sequence whose prompt
        #: (and recomputed output) is in KV, which the step samples.
        self.all_decode = False
        self.num_batched_tokens = 0
        #: Sum over chunks of the (query, key) pairs their new tokens attend
        #: to, causally: ``n * ctx + n * (n + 1) / 2``, an integer for every
        #: chunk, so kept exactly as one.
        self.attention_pairs = 0
        #: Sum over chunks of the tokens in KV after the step.
        self.kv_tokens = 0
        #: The running and waiting lists after the step is packed.
        self.running: list[SequenceState] = []
        self.waiting: list[SequenceState] = []
        #: Waiting requests the admission decision deferred in this step
        #: (still waiting), and the requests rejected in it (gone).
        self.deferred: list[SequenceState] = []
        self.rejected: list[SequenceState] = []

    def _drop(self, state: SequenceState) -> int:
        """Take ``state``'s chunk (if any) out of the step's columns; return
        its tokens (the totals are summed from the columns once packed)."""
        for i, scheduled in enumerate(self.states):
            if scheduled is state:
                n = self.num_new[i]
                for column in (self.states, self.num_new, self.context, self.prefill, self.completes):
                    del column[i]
                return n
        return 0

    def _sum(self) -> None:
        """The step's totals from its columns."""
        num_new, context = self.num_new, self.context
        tokens = sum(num_new)
        self.num_batched_tokens = tokens
        self.kv_tokens = sum(context) + tokens
        self.all_decode = 0 < tokens == len(num_new) and not any(self.prefill)
        if self.all_decode:  # each chunk attends to its context and itself
            self.attention_pairs = self.kv_tokens
        else:
            self.attention_pairs = sum(map(mul, num_new, context)) + sum(n * (n + 1) // 2 for n in num_new)

    def plan(self) -> StepPlan:
        return StepPlan(
            tuple(
                ScheduledChunk(state.request_id, n, context, prefill)
                for state, n, context, prefill in zip(self.states, self.num_new, self.context, self.prefill)
            )
        )


def pack(rt: Runtime, ir: ScheduleIR, may_reject: bool = True) -> PackedStep:
    """Pack one continuous-batching step from ``ir`` (after the passes), as
    vLLM v1 schedules: the token budget goes to running requests first (the
    next prefill chunk, or one decode token), preempting by the
    victim-selection hook when blocks run out; then waiting requests are
    admitted in the passes' order (:func:`_admit`), stopping at the first
    that does not fit. A request computes at most its ``ir.chunk_limits``
    tokens. A step in which nothing runs rejects the request that keeps the
    queue from moving: one that never fits, else one deferred, else the one
    memory refused; not with ``may_reject`` false (a step packed while the
    one before runs, whose ending requests still hold their blocks: the
    next step packed with nothing running decides). The step's running and
    waiting lists are new lists."""
    step = PackedStep()
    states, num_new, contexts, prefills, completes = (
        step.states,
        step.num_new,
        step.context,
        step.prefill,
        step.completes,
    )
    budget = ir.token_budget
    block_size = rt.block_size
    limits = ir.chunk_limits
    running = list(ir.running)
    preempted: list[SequenceState] = []
    gone: set[int] = set()  # id() of the states preempted so far in this step
    # The loop runs once per running sequence per step: SequenceState's
    # num_tokens and in_prefill, and Runtime.grow's test of whether a new
    # block is needed, are computed in line. A decode in a block with room,
    # as most are, is its state and context alone: the columns that are the
    # same for every decode (one token, not a prefill, sampled) are filled
    # in bulk where another chunk follows, and at the end; the step's
    # totals are summed from the columns once (PackedStep._sum).
    add_state, add_context = states.append, contexts.append
    for state in tuple(running):
        if gone and id(state) in gone:
            continue  # preempted earlier in this step
        context = state.num_computed_tokens
        num_output = state.num_output_tokens
        num_tokens = len(state.request.prompt_token_ids) + num_output
        if num_tokens - context == 1 and budget > 0 and num_output and context < len(state.block_ids) * block_size:
            add_state(state)
            add_context(context)
            budget -= 1
            continue
        _fill_decodes(step)
        n = num_tokens - context
        if n > budget:
            n = budget
        if limits and n > limits.get(state.request_id, n):
            n = limits[state.request_id]
        if n <= 0:
            continue
        if context + n > len(state.block_ids) * block_size:
            while not rt.grow(state, n):
                victim = rt.select_preemption(running, state)
                running.remove(victim)
                rt.preempt(victim)
                preempted.append(victim)
                gone.add(id(victim))
                budget += step._drop(victim)
                if victim is state:
                    break
            if gone and id(state) in gone:
                continue
            # The preemptions reset only their victims: context and num_tokens stand.
        add_state(state)
        num_new.append(n)
        add_context(context)
        prefills.append(num_output == 0 or context < num_tokens - 1)
        completes.append(context + n == num_tokens)
        budget -= n
    _fill_decodes(step)
    step.running = running
    never_fits = refused = None
    if preempted:
        # As vLLM: no admissions in a step that preempts, and the preempted
        # go back to the front of the queue.
        step.waiting = preempted[::-1] + list(ir.waiting)
    else:
        never_fits, refused = _admit(rt, ir, step, budget)
    step._sum()
    if not states and step.waiting and not step.rejected and may_reject:
        # Nothing runs, and the request that stopped admission never will.
        if never_fits is None and step.deferred:
            stuck, reason = step.deferred[0], "deferred with nothing running"
        else:
            stuck, reason = never_fits or refused or step.waiting[0], NEVER_FITS
        step.waiting.remove(stuck)
        rt.reject(stuck, reason)
        step.rejected.append(stuck)
    return step


def _fill_decodes(step: PackedStep) -> None:
    """The columns of the decodes added since the last chunk of another kind."""
    k = len(step.states) - len(step.num_new)
    if k:
        step.num_new.extend([1] * k)
        step.prefill.extend([False] * k)
        step.completes.extend([True] * k)


def _admit(
    rt: Runtime, ir: ScheduleIR, step: PackedStep, budget: int
) -> tuple[SequenceState | None, SequenceState | None]:
    """Admit waiting requests into ``step`` in the passes' order, each as the
    admission decision says (``Runtime.decide_admission``, with an admission
    plugin) and memory allows, until the budget or the sequences run out or
    one does not fit; a deferred one, or one its chunk limit holds back,
    keeps its place and the next is asked. Sets the step's waiting list;
    returns the request that can never fit the pool and the one memory
    refused, where admission stopped at one."""
    decide = rt.decide_admission if rt.decides_admission else None
    running, block_size, limits = step.running, rt.block_size, ir.chunk_limits
    admitted = 0
    never_fits = refused = None
    held = False
    for state in ir.waiting:
        if budget <= 0 or len(running) >= ir.max_num_seqs:
            break
        request = state.request
        num_prompt = len(request.prompt_token_ids)
        if blocks_for(num_prompt + request.output_tokens, block_size) > rt.num_blocks:
            never_fits = state
            break
        limit = limits.get(state.request_id, budget) if limits else budget
        if limit == 0:
            held = True
            continue
        if decide is not None:
            verdict = (decision := decide(state)).verdict
            if verdict is Admission.DEFER:
                step.deferred.append(state)
                continue
            if verdict is Admission.REJECT:
                rt.reject(state, decision.reason)
                step.rejected.append(state)
                continue
        n = rt.admit(state, min(budget, limit))
        if n == 0:
            refused = state
            break
        context = state.num_computed_tokens
        step.states.append(state)
        step.num_new.append(n)
        step.context.append(context)
        step.prefill.append(True)
        step.completes.append(context + n == num_prompt + state.num_output_tokens)
        budget -= n
        running.append(state)
        admitted += 1
    if held or step.deferred or step.rejected:  # the admitted are not the queue's head: keep the rest in order
        gone = {id(s) for s in step.rejected}.union(map(id, running[len(running) - admitted :]))
        step.waiting = [s for s in ir.waiting if id(s) not in gone]
    else:  # the admitted are the head of the queue (admission stops at the first that does not fit)
        step.waiting = ir.waiting[admitted:]
    return never_fits, refused
