"""Class 3: a scheduling pass's chunk limits (``ScheduleIR.chunk_limits``)
of any contents. The core's check either names what is wrong in one line,
or the step is packed with every chunk within its limit and no request
lost, duplicated or held back unless its limit is 0."""

from __future__ import annotations

from conftest import FUZZ
from hypothesis import given
from hypothesis import strategies as st

from sagellm_core import checks
from sagellm_core.drivers import step_scheduler
from sagellm_core.drivers.engines import build_engine
from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.replay import session
from sagellm_core.types import Request, ScheduleIR

CONFIG = """
[engine]
name = "replay"
mode = "timed"
[prefix_cache]
plugin = "radix"
block_size = 16
[kv_pool]
plugin = "paged"
num_blocks = {blocks}
[eviction]
plugin = "lru"
"""

IDS = [f"r{i}" for i in range(6)]
limit_values = st.one_of(st.integers(-3, 400), st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3))
limits = st.dictionaries(st.one_of(st.sampled_from([*IDS, "stranger"]), st.integers()), limit_values, max_size=8)


@FUZZ
@given(
    limits=st.one_of(limits, st.lists(st.integers(), max_size=2)),
    num_running=st.integers(0, 6),
    prompts=st.lists(st.integers(1, 300), min_size=6, max_size=6),
    blocks=st.sampled_from([24, 400]),
    budget=st.integers(1, 1024),
)
def test_class3_any_chunk_limits_are_named_or_honoured(limits, num_running, prompts, blocks, budget):
    settings = settings_from_toml(CONFIG.format(blocks=blocks), "t.toml")
    engine, _ = build_engine(settings)
    rt = session.build_runtime(settings, engine)
    states = [
        rt.arrive(Request(rid, list(range(i * 1000, i * 1000 + n)), 4)) for i, (rid, n) in enumerate(zip(IDS, prompts))
    ]
    first = step_scheduler.pack(rt, ScheduleIR(0.0, states[:num_running], [], 1024, 8))  # some start running
    for state, n in zip(first.states, first.num_new):
        state.num_computed_tokens += n
    ir = ScheduleIR(0.0, first.waiting + states[num_running:], first.running, budget, 8, chunk_limits=limits)
    problem = checks.chunk_limits(ir)
    if problem is not None:
        assert "\n" not in problem and problem.startswith(("set ", "capped ", "held "))
        return
    everyone = {id(s) for s in ir.waiting + ir.running}
    step = step_scheduler.pack(rt, ir)
    assert {id(s) for s in step.waiting + step.running + step.rejected} == everyone  # none lost or duplicated
    assert len(step.waiting) + len(step.running) + len(step.rejected) == len(everyone)
    for state, n in zip(step.states, step.num_new):
        assert 0 < n <= ir.chunk_limits.get(state.request_id, n)
    held = {s.request_id for s in ir.waiting if ir.chunk_limits.get(s.request_id) == 0}
    assert not held & {s.request_id for s in step.states + step.rejected}
    rt.check_invariants()
