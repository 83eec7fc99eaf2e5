"""Property: whatever the requests and the policy, vLLM's pool with sagellm
choosing victims stays consistent: no block lost or doubly free, the
evictable set is exactly vLLM's free cached blocks, reference counts match
the requests holding the blocks; and the match a request arrives with is
the hit vLLM's own lookup finds then."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sagellm_plugin_vllm import compat as v
from sagellm_plugin_vllm.engine import build_scheduler, made_up_output
from sagellm_plugin_vllm.live import ENGINE_OWNS

from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.runtime import Runtime

BS = 4
POOL = 24

# Prompts drawn from a few shared prefixes, so blocks are hit, shared and evicted.
prompts = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(1, 6)),  # prefix, length, output tokens
    min_size=1,
    max_size=12,
)


def check(scheduler) -> None:
    pool = scheduler.kv_cache_manager.block_pool
    queue = pool.free_block_queue.get_all_free_blocks()
    ids = [b.block_id for b in queue]
    assert len(ids) == len(set(ids)) == pool.get_num_free_blocks(), "a block is lost or doubly free"
    assert all(b.ref_cnt == 0 and not b.is_null for b in queue)
    free_cached = {b.block_id for b in queue if b.block_hash is not None}  # (a copy is never free)
    assert pool.sagellm.evictable == free_cached
    copies = pool.sagellm.original_of
    assert set(pool.sagellm.cached) == {b.block_id for b in pool.blocks if b.block_hash is not None} - set(copies)
    holders: dict[int, int] = {}
    manager = scheduler.kv_cache_manager
    for req_id in scheduler.requests:
        for block_id in manager.get_block_ids(req_id)[0]:
            holders[block_id] = holders.get(block_id, 0) + 1
    # A request that recomputed a cached block keeps its copy private and
    # holds the cached original instead (sagellm caches a block once).
    for copy_id, original_id in copies.items():
        assert copy_id in holders and original_id in pool.sagellm.cached
        holders[original_id] = holders.get(original_id, 0) + 1
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0), f"block {block.block_id} refcount"
    # The waiting states the passes get, kept up to date step to step.
    if scheduler._has_passes:
        assert scheduler._waiting_states_now() == [r.sagellm_state for r in scheduler.waiting]
    # The hash index the arrival match walks: every cached block, by its hash.
    index = pool.sagellm.by_hash
    assert len(index) == len(pool.sagellm.cached)
    for block_hash, block in index.items():
        assert pool.blocks[block.block_id].block_hash[:-4] == block_hash


def arrive(scheduler, request) -> None:
    """Add ``request``; its arrival match must be vLLM's own lookup's hit."""
    _, vllm_hit_tokens, _ = scheduler.kv_cache_manager.get_computed_blocks(request)
    scheduler.add_request(request)
    # (In blocks: the runtime here counts the default 16 tokens a block.)
    hint_blocks = request.sagellm_state.cached_tokens_hint // scheduler.sagellm.block_size
    assert hint_blocks == vllm_hit_tokens // BS


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=prompts,
    policy=st.sampled_from(["lru", "lfu", "s3fifo", "slo"]),  # slo observes arrivals: their matched blocks
    seqs=st.integers(1, 4),
    passes=st.sampled_from(["", '[scheduler]\npasses = ["priority"]\n']),
)
def test_pool_stays_consistent(requests, policy, seqs, passes):
    rt = Runtime(
        settings_from_toml(
            f'[kv_pool]\nnum_blocks = {POOL}\n[eviction]\nplugin = "{policy}"\n[report]\nhook_timing = false\n' + passes
        ),
        engine_owns=ENGINE_OWNS,
    )
    scheduler = build_scheduler(
        "sagellm",
        block_size=BS,
        num_blocks=POOL,
        max_num_batched_tokens=64,
        max_num_seqs=seqs,
        max_model_len=256,
        runtime=rt,
    )
    v.init_none_hash(v.sha256)
    hasher = v.get_request_block_hasher(BS, v.sha256)
    arrivals = [
        v.VllmRequest(
            request_id=f"r{i}",
            prompt_token_ids=[1000 * (prefix + 1) + t for t in range(length)],
            sampling_params=v.SamplingParams(max_tokens=out, ignore_eos=True),
            pooling_params=None,
            arrival_time=float(i),
            block_hasher=hasher,
            priority=(prefix + i) % 3,  # the priority pass reorders some
        )
        for i, (prefix, length, out) in enumerate(requests)
    ]
    # Half arrive at once, the rest one per step, onto a cache that holds
    # (and evicts) the earlier ones' blocks.
    for request in arrivals[: len(arrivals) // 2 + 1]:
        arrive(scheduler, request)
    later = iter(arrivals[len(arrivals) // 2 + 1 :])
    for _ in range(500):
        request = next(later, None)
        if request is not None:
            arrive(scheduler, request)
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        check(scheduler)
        scheduler.update_from_output(out, made_up_output(scheduler, out))
        check(scheduler)
    assert not scheduler.has_unfinished_requests()


def test_the_arrival_hint_stops_at_a_gap_vllm_evicted():
    """vLLM evicting one block of a cached chain itself (a KV connector's
    ``evict_blocks``) leaves its cached descendants behind it: the length
    read off the hash index (no plugin observes arrivals) stops at the gap,
    as vLLM's own lookup does."""
    rt = Runtime(
        settings_from_toml(f"[kv_pool]\nnum_blocks = {POOL}\n[report]\nhook_timing = false\n"), engine_owns=ENGINE_OWNS
    )
    assert not rt.observes_arrivals
    scheduler = build_scheduler(
        "sagellm",
        block_size=BS,
        num_blocks=POOL,
        max_num_batched_tokens=64,
        max_num_seqs=2,
        max_model_len=256,
        runtime=rt,
    )
    v.init_none_hash(v.sha256)
    hasher = v.get_request_block_hasher(BS, v.sha256)

    def request(request_id: str):
        return v.VllmRequest(
            request_id=request_id,
            prompt_token_ids=list(range(1, 23)),  # 5 full blocks and a part
            sampling_params=v.SamplingParams(max_tokens=1, ignore_eos=True),
            pooling_params=None,
            arrival_time=0.0,
            block_hasher=hasher,
        )

    first = request("first")
    arrive(scheduler, first)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, made_up_output(scheduler, out))
    pool = scheduler.kv_cache_manager.block_pool
    chain = [pool.sagellm.by_hash[h].block_id for h in first.block_hashes[:5]]
    pool.evict_blocks({chain[1]})  # a binary search over the hashes would find 5
    assert pool.sagellm.gapped and pool.sagellm.by_hash.keys() >= set(first.block_hashes[2:5])
    second = request("second")
    arrive(scheduler, second)  # the hint is vLLM's own hit: 1 block
    assert second.sagellm_state.cached_tokens_hint == rt.block_size
    # vLLM evicts the rest of the chain below the gap: no gap is left, and
    # length-only matches are the binary search again.
    pool.evict_blocks(set(chain[2:5]))
    assert not pool.sagellm.gapped and chain[0] in pool.sagellm.cached
