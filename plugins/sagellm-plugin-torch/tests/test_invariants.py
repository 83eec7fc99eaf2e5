"""Random arrivals, steps and cancellations through the real engine (a tiny
random-weight Llama, so hundreds of examples run in seconds): the runtime's
block accounting holds after every operation, and every request ends
finished, aborted or rejected with its blocks returned."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sagellm_plugin_torch import testing as helpers

from sagellm_core.errors import RequestError
from sagellm_core.types import Request

PREFIXES = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25], [40, 41, 42]]

operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(0, len(PREFIXES) - 1),
            st.lists(st.integers(2, 120), min_size=0, max_size=14),
            st.integers(1, 10),
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 40)),
    ),
    max_size=40,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(ops=operations, offload=st.booleans(), cache=st.booleans(), num_blocks=st.integers(6, 24))
def test_block_accounting_holds(tmp_path, tiny_model_dir, ops, offload, cache, num_blocks):
    path = helpers.write_config(
        tmp_path,
        model=str(tiny_model_dir),
        num_blocks=num_blocks,
        block_size=4,
        prefix_cache=cache,
        offload=offload,
        host_blocks=16,
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )
    core = helpers.engine_core(path)
    rt = core.rt
    ended: set[str] = set()
    added: list[str] = []
    refused: set[str] = set()
    for op in ops:
        if op[0] == "add":
            _, prefix, suffix, max_tokens = op
            rid = f"q{len(added)}"
            try:
                core.add_request(Request(rid, PREFIXES[prefix] + suffix or [1], max_tokens))
            except RequestError:
                refused.add(rid)  # refused up front: nothing queued, nothing counted
                assert rid not in {s.request_id for s in core.waiting}
            added.append(rid)
        elif op[0] == "step":
            ended.update(out.request_id for out in core.step() if out.finished)
        elif added:
            out = core.abort(added[op[1] % len(added)])
            if out is not None:
                ended.add(out.request_id)
        rt.check_invariants()
    while core.has_work():
        ended.update(out.request_id for out in core.step() if out.finished)
        rt.check_invariants()
    assert ended | refused == set(added) and not ended & refused
    c = rt.counters
    assert c.requests_finished + c.requests_rejected == len(ended)
    # Every block is free or held by the cache; nothing is held by a request.
    usage = rt.pool_usage()
    assert usage.num_free_blocks + rt.num_cached_blocks == rt.num_blocks
