"""Step packing: the one continuous-batching rule every step-driven engine
uses (the replay engine's timed mode simulates it, the torch engine runs it
on a real model)."""

from __future__ import annotations

from attrs import frozen

from sagellm_core.runtime import Runtime, blocks_for
from sagellm_core.types import ScheduleIR, SequenceState


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
    with the totals a cost model reads. It is what :func:`pack_step` builds
    its :class:`StepPlan` from; the replay engine reads it directly, since a
    chunk object per running sequence per step was a large share of a timed
    replay's time."""

    __slots__ = (
        "states",
        "num_new",
        "context",
        "prefill",
        "completes",
        "num_batched_tokens",
        "attention_pairs",
        "kv_tokens",
        "running",
        "waiting",
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

    def _drop(self, state: SequenceState) -> int:
        """Take ``state``'s chunk (if any) out of the step; return its tokens."""
        for i, scheduled in enumerate(self.states):
            if scheduled is state:
                n, context = self.num_new[i], self.context[i]
                for column in (self.states, self.num_new, self.context, self.prefill, self.completes):
                    del column[i]
                self.num_batched_tokens -= n
                self.attention_pairs -= n * context + n * (n + 1) // 2
                self.kv_tokens -= context + n
                return n
        return 0

    def plan(self) -> StepPlan:
        return StepPlan(
            tuple(
                ScheduledChunk(state.request_id, n, context, prefill)
                for state, n, context, prefill in zip(self.states, self.num_new, self.context, self.prefill)
            )
        )


def pack_step(rt: Runtime, ir: ScheduleIR) -> tuple[StepPlan, list[SequenceState], list[SequenceState]]:
    """Pack one continuous-batching step from ``ir`` (after the passes), as
    vLLM v1 schedules: the token budget goes to running requests first (the
    next prefill chunk, or one decode token), preempting by the
    victim-selection hook when blocks run out; then waiting requests are
    admitted in the passes' order, stopping at the first that does not fit.
    Returns the plan and the new running and waiting lists. Every engine
    that drives the runtime step by step (replay's timed mode, the torch
    engine) packs with this one function (the replay engine through
    :func:`pack`, the same packing without the chunk objects)."""
    packed = pack(rt, ir)
    return packed.plan(), packed.running, packed.waiting


def pack(rt: Runtime, ir: ScheduleIR) -> PackedStep:
    """:func:`pack_step`'s packing, as a :class:`PackedStep`."""
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
    running = list(ir.running)
    preempted: list[SequenceState] = []
    gone: set[int] = set()  # id() of the states preempted so far in this step
    # The loop runs once per running sequence per step: SequenceState's
    # num_tokens and in_prefill, Runtime.grow's test of whether a new block
    # is needed, and the step's totals are computed in line (most running
    # sequences decode, and fill a block only every block_size steps).
    tokens = pairs = kv_tokens = 0
    add_state, add_new, add_context = states.append, num_new.append, contexts.append
    add_prefill, add_completes = prefills.append, completes.append
    for state in tuple(running):
        if gone and id(state) in gone:
            continue  # preempted earlier in this step
        context = state.num_computed_tokens
        num_output = state.num_output_tokens
        num_tokens = len(state.request.prompt_token_ids) + num_output
        if num_tokens - context == 1 and budget > 0 and num_output and context < len(state.block_ids) * block_size:
            # A decode in a block with room, as most are: one token, no new
            # block, not a prefill, and the step samples for it.
            add_state(state)
            add_new(1)
            add_context(context)
            add_prefill(False)
            add_completes(True)
            tokens += 1
            pairs += context + 1
            kv_tokens += context + 1
            budget -= 1
            continue
        n = num_tokens - context
        if n > budget:
            n = budget
        if n <= 0:
            continue
        if context + n > len(state.block_ids) * block_size:
            step.num_batched_tokens, step.attention_pairs, step.kv_tokens = tokens, pairs, kv_tokens
            while not rt.grow(state, n):
                victim = rt.select_preemption(running, state)
                running.remove(victim)
                rt.preempt(victim)
                preempted.append(victim)
                gone.add(id(victim))
                budget += step._drop(victim)
                if victim is state:
                    break
            tokens, pairs, kv_tokens = step.num_batched_tokens, step.attention_pairs, step.kv_tokens
            if gone and id(state) in gone:
                continue
            # The preemptions reset only their victims: context and num_tokens stand.
        add_state(state)
        add_new(n)
        add_context(context)
        add_prefill(num_output == 0 or context < num_tokens - 1)
        add_completes(context + n == num_tokens)
        tokens += n
        pairs += n * context + n * (n + 1) // 2
        kv_tokens += context + n
        budget -= n
    admitted = 0
    if not preempted:  # as vLLM: no new admissions in a step that preempts
        for state in ir.waiting:
            if budget <= 0 or len(running) >= ir.max_num_seqs:
                break
            request = state.request
            num_prompt = len(request.prompt_token_ids)
            if blocks_for(num_prompt + request.output_tokens, block_size) > rt.num_blocks:
                break  # can never finish; rejected by the caller once nothing runs
            n = rt.admit(state, budget)
            if n == 0:
                break
            context = state.num_computed_tokens
            states.append(state)
            num_new.append(n)
            contexts.append(context)
            prefills.append(True)
            completes.append(context + n == num_prompt + state.num_output_tokens)
            tokens += n
            pairs += n * context + n * (n + 1) // 2
            kv_tokens += context + n
            budget -= n
            running.append(state)
            admitted += 1
    step.num_batched_tokens, step.attention_pairs, step.kv_tokens = tokens, pairs, kv_tokens
    step.running = running
    # Preempted requests go back to the front of the queue, as in vLLM. The
    # admitted ones are the head of the waiting list (admission stops at the
    # first that does not fit).
    step.waiting = preempted[::-1] + list(ir.waiting) if preempted else ir.waiting[admitted:]
    return step
