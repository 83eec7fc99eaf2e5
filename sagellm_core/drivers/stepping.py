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


def pack_step(rt: Runtime, ir: ScheduleIR) -> tuple[StepPlan, list[SequenceState], list[SequenceState]]:
    """Pack one continuous-batching step from ``ir`` (after the passes), as
    vLLM v1 schedules: the token budget goes to running requests first (the
    next prefill chunk, or one decode token), preempting by the
    victim-selection hook when blocks run out; then waiting requests are
    admitted in the passes' order, stopping at the first that does not fit.
    Returns the plan and the new running and waiting lists. Every engine
    that drives the runtime step by step (replay's timed mode, the torch
    engine) packs with this one function."""
    budget = ir.token_budget
    chunks: dict[str, ScheduledChunk] = {}
    running = list(ir.running)
    preempted: list[SequenceState] = []
    for state in list(running):
        if state not in running:
            continue  # preempted earlier in this step
        n = min(state.num_tokens - state.num_computed_tokens, budget)
        if n <= 0:
            continue
        while not rt.grow(state, n):
            victim = rt.select_preemption(running, state)
            running.remove(victim)
            rt.preempt(victim)
            preempted.append(victim)
            dropped = chunks.pop(victim.request_id, None)
            if dropped is not None:
                budget += dropped.num_new_tokens
            if victim is state:
                break
        else:
            chunks[state.request_id] = ScheduledChunk(state.request_id, n, state.num_computed_tokens, state.in_prefill)
            budget -= n
    admitted: set[int] = set()
    if not preempted:  # as vLLM: no new admissions in a step that preempts
        for state in ir.waiting:
            if budget <= 0 or len(running) >= ir.max_num_seqs:
                break
            if blocks_for(state.request.num_prompt_tokens + state.request.output_tokens, rt.block_size) > rt.num_blocks:
                break  # can never finish; rejected by the caller once nothing runs
            n = rt.admit(state, budget)
            if n == 0:
                break
            chunks[state.request_id] = ScheduledChunk(state.request_id, n, state.num_computed_tokens, True)
            budget -= n
            running.append(state)
            admitted.add(id(state))
    # Preempted requests go back to the front of the queue, as in vLLM.
    waiting = preempted[::-1] + [st for st in ir.waiting if id(st) not in admitted]
    plan = StepPlan(tuple(chunks.values()))
    return plan, running, waiting
