"""Groups of ``n`` choices through the engine thread, with random sizes,
lengths and aborts (a first request aborted before its siblings are
admitted, or later): every choice that is not aborted finishes, every
engine request is counted once, and no block stays held."""

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sagellm_plugin_server.engine_thread import EngineThread
from sagellm_plugin_server.testing import server_config
from sagellm_plugin_torch import testing
from sagellm_plugin_torch.sampling import SamplingParams

from sagellm_core.types import Request

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 20, 21], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


@pytest.fixture(scope="module")
def engine_thread(tmp_path_factory, tiny_model_dir):
    core = testing.engine_core(server_config(tmp_path_factory.mktemp("thread"), tiny_model_dir, max_num_seqs=4))
    thread = EngineThread(core, 256)
    thread.start()
    yield thread
    thread.stop()


groups = st.lists(
    st.tuples(
        st.integers(1, 3),  # n
        st.sampled_from(range(len(PROMPTS))),
        st.integers(1, 6),  # max_tokens
        st.one_of(st.none(), st.integers(0, 4)),  # abort the first choice after this many of the group's outputs
        st.booleans(),  # sampled (seeded) or greedy
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=groups)
def test_every_choice_ends_and_nothing_is_held(engine_thread, plan):
    core = engine_thread.core
    counters = core.rt.counters
    before = counters.requests_finished + counters.requests_rejected

    async def one(g: int, n: int, prompt: int, max_tokens: int, abort_after: int | None, sampled: bool):
        group = [
            (
                Request(f"x{g}-{len(plan)}-{i}-{id(plan)}", PROMPTS[prompt], max_tokens),
                SamplingParams(max_tokens=max_tokens, temperature=1.0 if sampled else 0.0, seed=i if sampled else None),
            )
            for i in range(n)
        ]
        outputs = await engine_thread.submit(group)
        ids = [r.request_id for r, _ in group]
        open_ = set(ids)
        seen = 0
        if abort_after == 0:
            engine_thread.abort_nowait(ids[0])
            open_.discard(ids[0])
        while open_:
            out = await outputs.get()
            seen += 1
            if out.finished:
                open_.discard(out.request_id)
                assert out.finish_reason in ("stop", "length")
            if abort_after is not None and seen == abort_after and ids[0] in open_:
                engine_thread.abort_nowait(ids[0])
                open_.discard(ids[0])

    async def run():
        await asyncio.wait_for(asyncio.gather(*(one(g, *spec) for g, spec in enumerate(plan))), timeout=60)
        for _ in range(200):  # aborts are applied between steps
            if not await engine_thread.call(core.has_work):
                break
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert not core.has_work() and not engine_thread._siblings
    assert counters.requests_finished + counters.requests_rejected - before == sum(n for n, *_ in plan)
    usage = core.rt.pool_usage()
    assert usage.num_free_blocks + core.rt.num_cached_blocks == usage.num_blocks
    core.rt.check_invariants()
