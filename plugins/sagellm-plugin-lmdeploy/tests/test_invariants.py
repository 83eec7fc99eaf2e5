"""Property: whatever the prompts, the policy and who matches (LMDeploy's
trie walk, or sagellm's prefix-cache plugin, with pinning), LMDeploy's
allocator and sagellm's view stay consistent: sagellm's cached blocks are
exactly the trie's nodes (or the plugin's blocks, LMDeploy's trie staying
empty), its evictable set exactly the cached blocks only the cache
references, a pinned block is never evicted nor exceeds the pinned share,
and every block is either free or referenced."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sagellm_plugin_lmdeploy import compat as lm
from sagellm_plugin_lmdeploy.engine import build_scheduler
from sagellm_plugin_lmdeploy.install import installed
from sagellm_plugin_lmdeploy.live import runtime_for

from sagellm_core.kit.testing import settings_from_toml

BS = 4
POOL = 24

prompts = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40)), min_size=1, max_size=12)


def trie_nodes(trie) -> list:
    nodes, stack = [], list(trie._roots.values())
    while stack:
        node = stack.pop()
        if node.parent is not None:
            nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def check(scheduler, rt) -> None:
    trie, allocator = scheduler.block_trie, scheduler.block_manager.allocator
    if trie.matcher is None:
        ids = [n.block_id for n in trie_nodes(trie)]
        assert set(trie.sagellm.cached) == set(ids), "sagellm's cached blocks are not the trie's"
    else:
        ids = list(trie.sagellm.cached)
        assert not trie_nodes(trie), "LMDeploy's trie walk cached blocks"
        assert rt.num_cached_blocks == len(ids), "the plugin's cached blocks are not sagellm's"
        pinned = set(rt.pinned_blocks())
        assert pinned <= set(ids) and len(pinned) <= POOL // 4, "a pinned block was evicted, or too many are pinned"
        # The plugin's locks are dropped after each call: all its blocks but the pinned are evictable to it.
        assert set(rt.evictable()) | pinned == set(ids)
    refs = allocator.get_ref_count(np.array(ids, dtype=np.int64)) if ids else np.array([])
    assert trie.sagellm.evictable == {b for b, r in zip(ids, refs.tolist()) if r == 1}
    assert (refs >= 1).all()
    used = int((allocator._log_mem.ref_count[:POOL] > 0).sum())
    assert used + scheduler.block_manager.get_num_free_gpu_blocks() == POOL, "a block is lost or doubly free"
    # Physical blocks (LMDeploy's allocator or sagellm's paged pool) match.
    assert allocator._gpu_allocator.get_num_free_blocks() == scheduler.block_manager.get_num_free_gpu_blocks()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=prompts,
    policy=st.sampled_from(["lru", "lfu", "s3fifo"]),
    pool=st.sampled_from(["", 'plugin = "paged"']),
    matching=st.sampled_from(["", 'plugin = "radix"\npin_after_hits = 2\nmax_pinned_share = 0.25', 'plugin = "hash"']),
)
def test_trie_stays_consistent(requests, policy, pool, matching):
    rt = runtime_for(
        settings_from_toml(
            f"[prefix_cache]\nblock_size = {BS}\n{matching}\n[kv_pool]\nnum_blocks = {POOL}\n{pool}\n"
            f'[eviction]\nplugin = "{policy}"\n[report]\nhook_timing = false\n'
        )
    )
    with installed(rt):
        scheduler = build_scheduler(POOL, BS, max_batches=1)
        for number, (prefix, length) in enumerate(requests):
            tokens = np.array([1000 * (prefix + 1) + t for t in range(length)], dtype=np.int64)
            seq = scheduler.add_session(number).add_sequence(tokens, sampling_param=lm.SamplingParam(max_new_tokens=1))
            out = scheduler.schedule(is_prefill=True, prealloc_size=4)
            assert out.running == [seq]
            check(scheduler, rt)
            scheduler.activate_seqs(out.running)
            seq.update_token_ids(np.array([0]), mode=lm.UpdateTokenMode.PREFILL)
            seq.finish()
            scheduler.end_session(number)
            check(scheduler, rt)
    event("evicted" if rt.counters.evicted_blocks else "nothing evicted")
    if "prefix_cache" in rt.host.plugins:
        event("pinned" if rt.pinned_blocks() else "nothing pinned")
