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
@given(ops=operations, offload=st.booleans(), cache=st.booleans(), num_blocks=st.integers(6, 24), overlap=st.booleans())
def test_block_accounting_holds(tmp_path, tiny_model_dir, ops, offload, cache, num_blocks, overlap):
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
    core = helpers.engine_core(path, async_scheduling=overlap)  # overlap: aborts land while a step runs
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


streams = st.lists(
    st.tuples(
        st.lists(st.integers(2, 120), min_size=1, max_size=20),  # the prompt
        st.integers(1, 12),  # max_tokens
        st.sets(st.integers(0, 127), max_size=24),  # stop tokens
        st.booleans(),  # asks for log-probabilities
    ),
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(requests=streams, arrive_every=st.integers(1, 3), overlap=st.booleans())
def test_each_request_streams_its_generated_tokens_and_ends_once(
    tmp_path, tiny_model_dir, requests, arrive_every, overlap
):
    """Requests arriving between steps, most steps decodes only: each
    request's outputs are its generated tokens in order, one a step; it
    ends once, at its first stop token or at max_tokens; a request that
    asked for log-probabilities gets its own token's with every output (the
    greedy token is the most probable)."""
    from sagellm_plugin_torch.engine import SamplingParams

    path = helpers.write_config(
        tmp_path, model=str(tiny_model_dir), num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32
    )
    core = helpers.engine_core(path, async_scheduling=overlap)
    streamed: dict[str, list] = {}
    generated, params = {}, {}
    pending = list(enumerate(requests))
    steps = 0
    while pending or core.has_work():
        if pending and steps % arrive_every == 0:
            i, (prompt, max_tokens, stops, logprobs) = pending.pop(0)
            rid = f"s{i}"
            params[rid] = SamplingParams(
                max_tokens=max_tokens, stop_token_ids=tuple(sorted(stops)), logprobs=1 if logprobs else None
            )
            core.add_request(Request(rid, prompt, max_tokens), params[rid])
            generated[rid] = core.generated_ids(core.requests[rid])
            streamed[rid] = []
        outputs = core.step()
        steps += 1
        assert len({o.request_id for o in outputs}) == len(outputs)  # one output a request a step
        for out in outputs:
            assert not (streamed[out.request_id] and streamed[out.request_id][-1].finished)
            streamed[out.request_id].append(out)
    for rid, outs in streamed.items():
        tokens, p = [o.token_id for o in outs], params[rid]
        assert tokens == generated[rid] and [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        stops = set(p.stop_token_ids) | core.eos_token_ids
        first_stop = next((k for k, t in enumerate(tokens) if t in stops), None)
        if first_stop is not None:
            assert first_stop == len(tokens) - 1 and outs[-1].finish_reason == "stop"
        else:
            assert len(tokens) == p.max_tokens and outs[-1].finish_reason == "length"
        for out in outs:
            if p.logprobs is None:
                assert out.logprobs is None
            else:
                assert out.logprobs.top[0][0] == out.token_id
    core.rt.check_invariants()


table_ops = st.lists(
    st.tuples(
        st.integers(0, 5),  # which request
        st.sampled_from(["grow", "rewrite", "same", "release"]),
        st.lists(st.integers(0, 99), min_size=1, max_size=4),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops=table_ops, batch_every=st.integers(1, 4))
def test_block_table_rows_at_once_are_its_rows_one_at_a_time(ops, batch_every):
    """``BlockTables.rows`` (a decode step's rows in one call) writes and
    answers what ``row`` does request by request: each request keeps its
    row, and the row holds its block ids."""
    import torch
    from sagellm_plugin_torch.runner import BlockTables

    at_once, one_by_one = (BlockTables(12, 24, torch.device("cpu"), pin=False) for _ in range(2))
    blocks: dict[str, list[int]] = {}
    for i, (who, what, ids) in enumerate(ops):
        rid = f"r{who}"
        if what == "release":
            blocks.pop(rid, None)
            at_once.release(rid)
            one_by_one.release(rid)
        elif what == "grow":
            blocks[rid] = (blocks.get(rid, []) + ids)[:24]
        elif what == "rewrite":
            blocks[rid] = ids
        if i % batch_every:
            continue
        at_once.begin_step()
        one_by_one.begin_step()
        ids_now, lists = list(blocks), [list(b) for b in blocks.values()]
        rows = at_once.rows(ids_now, lists)
        assert rows == [one_by_one.row(r, b) for r, b in zip(ids_now, lists)]
        assert len(set(rows)) == len(rows)
        for r, b in zip(rows, lists):
            assert at_once.device[r, : len(b)].tolist() == b
