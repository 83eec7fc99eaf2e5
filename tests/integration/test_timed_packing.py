"""The timed replay's step packing (``drivers.step_scheduler.pack``) computes in
line what ``SequenceState``'s properties, ``Runtime.grow`` and the cost model
compute (the step loop was most of a timed replay's time). These
tests hold the in-line figures against the originals at every step of real
replays, with preemptions, and the cost model's totals against its formula."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sagellm_core import hookimpl
from sagellm_core.drivers import step_engine, step_scheduler
from sagellm_core.drivers.arrivals import Arrivals
from sagellm_core.drivers.engines import build_engine
from sagellm_core.drivers.step_scheduler import ScheduledChunk
from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.replay import session, workloads
from sagellm_core.replay.costmodel import HARDWARE, MODELS, CostModel
from sagellm_core.replay.report import build
from sagellm_core.types import PreemptionDecision, Request

TIGHT = """
[engine]
name = "replay"
mode = "timed"
max_num_batched_tokens = {budget}
max_num_seqs = {seqs}
[workload]
source = "generator"
tenants = 3
sessions_per_tenant = 6
turns = 3
system_prompt_tokens = 512
session_rate = 50.0
[prefix_cache]
plugin = "radix"
block_size = 16
[kv_pool]
plugin = "paged"
num_blocks = {blocks}
[eviction]
plugin = "lru"
[scheduler]
passes = ["fcfs"]
[report]
hook_timing = false
"""


class HeadFirstPreemption:
    """Preempts the head of the running list: a request already scheduled in
    the step, whose chunk packing must then take back (the default rule
    preempts the tail, not yet reached)."""

    @hookimpl
    def sagellm_select_preemption(self, running, needed_by):
        return PreemptionDecision(running[0].request_id)


class RandomChunkLimits:
    """A pass that caps the chunks of a random few of the step's requests:
    a running one to 1 or more, a waiting one to 0 (held back) or more."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    @hookimpl
    def sagellm_schedule_pass(self, ir):
        rng, limits = self.rng, ir.chunk_limits
        for state in ir.running:
            if state.in_prefill and rng.random() < 0.5:
                limits[state.request_id] = rng.randint(1, state.num_tokens - state.num_computed_tokens)
        for state in ir.waiting:
            if rng.random() < 0.5:
                limits[state.request_id] = rng.choice([0, 0, rng.randint(1, state.num_tokens)])
        if not ir.running and ir.waiting and all(limits.get(s.request_id) == 0 for s in ir.waiting):
            del limits[ir.waiting[-1].request_id]  # the core refuses a step held back whole


def checked_replay(
    monkeypatch, blocks: int, budget: int, seqs: int = 256, preemption=None, chunk_limits=None
) -> tuple[dict, dict[str, int]]:
    """A timed replay whose every packed step is checked against the
    properties and the cost model it stands in for; returns the report and
    counts of what the steps did."""
    seen = {"steps": 0, "decodes": 0, "prefills": 0, "grown": 0, "dropped": 0, "chunks_taken_back": 0, "held": 0}
    real_pack, real_drop = step_scheduler.pack, step_scheduler.PackedStep._drop

    def drop(step, state):
        scheduled = [s is state for s in step.states]
        chunk = step.num_new[scheduled.index(True)] if any(scheduled) else 0
        n = real_drop(step, state)
        assert n == chunk and all(s is not state for s in step.states)
        assert len(step.states) == len(step.num_new) == len(step.context) == len(step.prefill) == len(step.completes)
        seen["chunks_taken_back"] += bool(n)
        return n

    cost = CostModel(HARDWARE["h100"], MODELS["llama-3.1-8b"])

    def pack(rt, ir):
        before = list(ir.running)
        blocks_before = {id(s): len(s.block_ids) for s in before}
        limits = dict(ir.chunk_limits)
        wants = {id(s): s.num_tokens - s.num_computed_tokens for s in before}
        step = real_pack(rt, ir)
        seen["steps"] += 1
        scheduled = set(map(id, step.states))
        assert len(scheduled) == len(step.states)
        held = [s for s in ir.waiting if limits.get(s.request_id) == 0]
        assert not scheduled & set(map(id, held)) and set(map(id, held)) <= set(map(id, step.waiting))
        seen["held"] += len(held)
        if all(id(s) in scheduled for s in before):  # no preemption: each running request in order gets
            left = ir.token_budget  # what it lacks, up to its limit and the budget left
            for state in before:
                chunk = step.num_new[step.states.index(state)]
                assert chunk == min(wants[id(state)], limits.get(state.request_id, left), left)
                left -= chunk
        for state, n, context, prefill, completes in zip(
            step.states, step.num_new, step.context, step.prefill, step.completes
        ):
            admitted = id(state) not in blocks_before
            assert context == state.num_computed_tokens
            assert 0 < n <= min(state.num_tokens - context, limits.get(state.request_id, n))
            assert prefill == (True if admitted else state.in_prefill)
            assert completes == (context + n == state.num_tokens)
            assert len(state.block_ids) * rt.block_size >= context + n  # blocks for every scheduled token
            if not admitted:
                seen["grown"] += len(state.block_ids) > blocks_before[id(state)]
                seen["decodes" if not prefill else "prefills"] += 1
        # Running stays in its order, less the preempted, then the admitted in theirs.
        kept = set(map(id, step.running))
        admitted_now = [s for s in step.states if id(s) not in blocks_before]
        assert step.running == [s for s in before if id(s) in kept] + admitted_now
        preempted = [s for s in before if id(s) not in kept]
        seen["dropped"] += len(preempted)
        assert not scheduled & set(map(id, preempted))
        if preempted:
            assert not admitted_now  # as vLLM: no admissions in a step that preempts
            assert set(map(id, step.waiting[: len(preempted)])) == set(map(id, preempted))  # at the front
        assert step.num_batched_tokens == sum(step.num_new) <= ir.token_budget
        assert step.all_decode == (bool(step.states) and not any(step.prefill) and set(step.num_new) == {1})
        plan = step.plan()
        assert [c.request_id for c in plan.chunks] == [s.request_id for s in step.states]
        totals = (step.num_batched_tokens, step.attention_pairs, step.kv_tokens)
        assert cost.step_time_of(*totals) == cost.step_time(plan.chunks) == reference_step_time(cost, plan.chunks)
        return step

    monkeypatch.setattr(step_engine, "pack", pack)
    monkeypatch.setattr(step_scheduler.PackedStep, "_drop", drop)
    settings = settings_from_toml(TIGHT.format(blocks=blocks, budget=budget, seqs=seqs), "t.toml")
    replay, _ = build_engine(settings)
    rt = session.build_runtime(settings, replay)
    if preemption is not None:
        rt.host.pm.register(preemption, name="test:preemption")
    if chunk_limits is not None:
        rt.host.pm.register(chunk_limits, name="test:chunk-limits")
    recorder = replay.run(rt, workloads.load(settings.workload))
    rt.check_invariants()
    return build(rt, recorder, "timed", 0.0, "t", recorder.finished), seen


def reference_step_time(cost: CostModel, chunks) -> float:
    """The cost model as it was before its totals became integers (b2237f1):
    attention pairs summed as floats, the model's figures from its properties."""
    m = cost.model
    tokens = 0
    pairs = 0.0
    kv_tokens = 0
    for c in chunks:
        n, ctx = c.num_new_tokens, c.num_context_tokens
        tokens += n
        pairs += n * (ctx + (n + 1) / 2)
        kv_tokens += ctx + n
    if tokens == 0:
        return 0.0
    flops = m.flops_per_token * tokens + m.flops_per_token_pair * pairs
    bytes_moved = m.num_params * m.dtype_bytes + kv_tokens * m.kv_bytes_per_token
    compute = flops / (cost.hardware.flops * cost.flops_efficiency)
    memory = bytes_moved / (cost.hardware.bandwidth * cost.bandwidth_efficiency)
    return max(compute, memory) + cost.step_overhead_s


def test_packing_agrees_with_the_states_under_memory_pressure(monkeypatch):
    report, seen = checked_replay(monkeypatch, blocks=300, budget=2048)
    assert report["requests"] == 54 and report["preemptions"] > 0
    # Every path of the packing ran: decodes in a block with room, decodes and
    # prefill chunks that took a block, preemptions that dropped a chunk.
    assert seen["decodes"] > seen["grown"] > 0 and seen["prefills"] > 0 and seen["dropped"] > 0


def test_a_preempted_request_scheduled_earlier_in_the_step_gives_its_tokens_back(monkeypatch):
    report, seen = checked_replay(monkeypatch, blocks=300, budget=2048, preemption=HeadFirstPreemption())
    assert report["requests"] == 54 and report["preemptions"] > 0
    assert seen["chunks_taken_back"] > 0


def test_packing_agrees_with_the_states_with_chunked_prefill_and_few_seqs(monkeypatch):
    report, seen = checked_replay(monkeypatch, blocks=2048, budget=256, seqs=4)
    assert report["requests"] == 54 and report["preemptions"] == 0
    assert seen["prefills"] > 0 and seen["decodes"] > 0


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), blocks=st.sampled_from([300, 2048]), budget=st.sampled_from([256, 2048]))
def test_chunk_limits_cap_chunks_and_hold_requests_back_without_losing_work(monkeypatch, seed, blocks, budget):
    """Random chunk limits every step, with and without memory pressure:
    no chunk passes its limit, a request held at 0 stays waiting in its
    place, and every request still computes each of its tokens once and
    finishes (the checked replay's per-chunk checks, the ledger's
    invariants, every request finished)."""
    report, seen = checked_replay(monkeypatch, blocks=blocks, budget=budget, chunk_limits=RandomChunkLimits(seed))
    assert report["requests"] == 54 and report["rejected"] == 0
    assert seen["held"] > 0  # the limits held requests back (about a third of those capped are held at 0)


def test_a_held_request_keeps_its_place_and_the_next_is_admitted():
    settings = settings_from_toml(TIGHT.format(blocks=2048, budget=512, seqs=8), "t.toml")
    eng, _ = build_engine(settings)
    rt = session.build_runtime(settings, eng)
    from sagellm_core.types import ScheduleIR

    states = [rt.arrive(Request(f"r{i}", list(range(i * 1000, i * 1000 + 300)), 5)) for i in range(4)]
    ir = ScheduleIR(0.0, list(states), [], 512, 8, chunk_limits={"r0": 0, "r1": 100, "r3": 0})
    step = step_scheduler.pack(rt, ir)
    assert step.plan().chunks == (ScheduledChunk("r1", 100, 0, True), ScheduledChunk("r2", 300, 0, True))
    assert step.running == [states[1], states[2]] and step.waiting == [states[0], states[3]]
    for state, n, completes in zip(step.states, step.num_new, step.completes):  # what the engine applies
        state.num_computed_tokens += n
        state.num_output_tokens += completes
    # The next step, no request held: r1 runs on, capped, r2 decodes, r0 and r3 are admitted in their order.
    step = step_scheduler.pack(rt, ScheduleIR(0.0, step.waiting, step.running, 512, 8, chunk_limits={"r1": 50}))
    chunks = [(c.request_id, c.num_new_tokens) for c in step.plan().chunks]
    assert chunks == [("r1", 50), ("r2", 1), ("r0", 300), ("r3", 512 - 50 - 1 - 300)] and step.waiting == []


def test_a_packed_steps_plan_is_its_chunks():
    text = TIGHT.format(blocks=2048, budget=512, seqs=8)
    settings = settings_from_toml(text, "t.toml")
    eng, _ = build_engine(settings)
    rt = session.build_runtime(settings, eng)
    from sagellm_core.types import ScheduleIR

    states = [rt.arrive(Request(f"r{i}", list(range(i * 1000, i * 1000 + 300)), 5)) for i in range(3)]
    step = step_scheduler.pack(rt, ScheduleIR(0.0, list(states), [], 512, 8))
    plan = step.plan()
    # 512 tokens of budget: the first prompt whole, the second's first 212 tokens.
    assert plan.chunks == (ScheduledChunk("r0", 300, 0, True), ScheduledChunk("r1", 212, 0, True))
    assert plan.num_batched_tokens == 512
    assert step.running == states[:2] and step.waiting == states[2:]


@pytest.mark.parametrize("seed", range(5))
def test_step_time_from_integer_totals_is_the_float_formula_exactly(seed):
    rng = random.Random(seed)
    for hardware in HARDWARE.values():
        for model in MODELS.values():
            cost = CostModel(hardware, model, step_overhead_s=rng.choice([0.0, 0.002]))
            chunks = [
                ScheduledChunk(str(i), rng.choice([1, 1, 1, rng.randrange(1, 8193)]), rng.randrange(0, 1 << 22), False)
                for i in range(rng.randrange(0, 257))
            ]
            assert cost.step_time(chunks) == reference_step_time(cost, chunks)


def test_any_due_is_whether_due_yields():
    turns = [
        Request("a1", [1], 1, arrival_s=0.0, session_id="a"),
        Request("b1", [1], 1, arrival_s=0.5),
        Request("a2", [1], 1, arrival_s=1.0, session_id="a"),
        Request("c1", [1], 1, arrival_s=9.0),
    ]
    arrivals = Arrivals(iter(turns), closed_loop=True)
    assert not arrivals.any_due(-1.0) and list(arrivals.due(-1.0)) == []
    assert arrivals.any_due(0.0)
    assert [r.request_id for r in arrivals.due(5.0)] == ["a1", "b1"]  # a2 held for a1
    assert not arrivals.any_due(5.0)
    arrivals.done(turns[0], 6.0)  # a2 released at 6.0
    assert not arrivals.any_due(5.9) and arrivals.any_due(6.0)
    assert [r.request_id for r in arrivals.due(6.0)] == ["a2"]
    assert not arrivals.any_due(8.9) and arrivals.any_due(9.0)
