"""Property: whatever the prompts and the policy, LMDeploy's trie and
allocator with sagellm choosing victims stay consistent: sagellm's cached
blocks are exactly the trie's nodes, its evictable set exactly the nodes
only the trie references, and every block is either free or referenced."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sagellm_core.testing import settings_from_toml

from sagellm_plugin_lmdeploy import compat as lm
from sagellm_plugin_lmdeploy.engine import build_scheduler
from sagellm_plugin_lmdeploy.install import installed, runtime_for

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


def check(scheduler) -> None:
    trie, allocator = scheduler.block_trie, scheduler.block_manager.allocator
    nodes = trie_nodes(trie)
    ids = [n.block_id for n in nodes]
    assert set(trie.sagellm.cached) == set(ids), "sagellm's cached blocks are not the trie's"
    refs = allocator.get_ref_count(np.array(ids, dtype=np.int64)) if ids else np.array([])
    assert trie.sagellm.evictable == {b for b, r in zip(ids, refs.tolist()) if r == 1}
    assert (refs >= 1).all()
    used = int((allocator._log_mem.ref_count[:POOL] > 0).sum())
    assert used + scheduler.block_manager.get_num_free_gpu_blocks() == POOL, "a block is lost or doubly free"
    # Physical blocks (LMDeploy's allocator or sagellm's paged pool) match.
    assert allocator._gpu_allocator.get_num_free_blocks() == scheduler.block_manager.get_num_free_gpu_blocks()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=prompts, policy=st.sampled_from(["lru", "lfu", "s3fifo"]), pool=st.sampled_from(["", 'plugin = "paged"']))
def test_trie_stays_consistent(requests, policy, pool):
    rt = runtime_for(
        settings_from_toml(
            f'[kv_pool]\nnum_blocks = {POOL}\n{pool}\n[eviction]\nplugin = "{policy}"\n[report]\nhook_timing = false\n'
        )
    )
    with installed(rt):
        scheduler = build_scheduler(POOL, BS, max_batches=1)
        for number, (prefix, length) in enumerate(requests):
            tokens = np.array([1000 * (prefix + 1) + t for t in range(length)], dtype=np.int64)
            seq = scheduler.add_session(number).add_sequence(tokens, sampling_param=lm.SamplingParam(max_new_tokens=1))
            out = scheduler.schedule(is_prefill=True, prealloc_size=4)
            assert out.running == [seq]
            check(scheduler)
            scheduler.activate_seqs(out.running)
            seq.update_token_ids(np.array([0]), mode=lm.UpdateTokenMode.PREFILL)
            seq.finish()
            scheduler.end_session(number)
            check(scheduler)
