"""sagellm's decisions inside LMDeploy's real PyTorch-engine paging layer."""

from __future__ import annotations

import numpy as np
import pytest

from sagellm_core import hookimpl, session
from sagellm_core.errors import PluginError
from sagellm_core.runtime import Runtime
from sagellm_core.testing import declare_plugins, settings_from_toml

from sagellm_plugin_lmdeploy import compat as lm
from sagellm_plugin_lmdeploy.engine import build_scheduler
from sagellm_plugin_lmdeploy.install import installed, runtime_for
from sagellm_plugin_lmdeploy.trie import SagellmBlockTrie

from .conftest import HERE


def mooncake_config(trace, engine: str, policy: str, *, scheduler: str = "sagellm", n=300, blocks=3000) -> str:
    replay = engine == "replay"
    return (
        f'[engine]\nname = "{engine}"\n'
        + ('mode = "cache-only"\nprealloc_tokens = 16\n' if replay else f'scheduler = "{scheduler}"\n')
        + f'[workload]\nsource = "mooncake"\npath = "{trace}"\nmax_requests = {n}\n'
        + "[prefix_cache]\nblock_size = 16\n" + ('plugin = "radix"\n' if replay else "")
        # sagellm's paged pool also picks LMDeploy's physical blocks when sagellm decides.
        + f"[kv_pool]\nnum_blocks = {blocks}\n" + ('plugin = "paged"\n' if replay or scheduler == "sagellm" else "")
        + f'[eviction]\nplugin = "{policy}"\n[report]\nhook_timing = false\n'
    )


def counts(text: str) -> tuple[int, int, int, int]:
    result = session.run(settings_from_toml(text))
    c = result.runtime.counters
    return c.query_blocks, c.hit_blocks, c.evicted_blocks, result.report["requests"]


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_lmdeploy_and_replay_hit_the_same_blocks(mooncake, policy):
    """The Mooncake trace through LMDeploy's scheduler and trie with a sagellm
    policy, and through sagellm replay with it (reserving LMDeploy's 16
    decode tokens at admission): equal hits and evictions, to the block; for
    LRU also equal to stock LMDeploy (with its access times made a logical
    clock). The pool is small enough that eviction decides the hits."""
    replay = counts(mooncake_config(mooncake, "replay", policy))
    inside = counts(mooncake_config(mooncake, "lmdeploy", policy))
    assert replay == inside
    assert replay[1] > 0 and replay[2] > 0 and replay[3] > 250
    if policy == "lru":
        stock = counts(mooncake_config(mooncake, "lmdeploy", "lru", scheduler="stock"))
        assert stock[:2] == replay[:2]  # stock LMDeploy reports no evictions to sagellm


def test_policies_change_lmdeploys_hits():
    """The built-in multi-tenant generator (shared system prompts), a pool
    that holds a few sessions: each policy evicts differently in LMDeploy."""
    hits = {
        policy: counts(
            f'[engine]\nname = "lmdeploy"\n[kv_pool]\nnum_blocks = 400\n[eviction]\nplugin = "{policy}"\n'
            "[report]\nhook_timing = false\n"
        )
        for policy in ("lru", "lfu", "s3fifo")
    }
    assert len({c[0] for c in hits.values()}) == 1
    assert len({c[1] for c in hits.values()}) == 3, hits


def test_hits_are_lmdeploys_own_stats(mooncake):
    settings = settings_from_toml(mooncake_config(mooncake, "lmdeploy", "lru", n=100))
    engine, _ = session.build_engine(settings)
    rt = runtime_for(settings)
    engine.run(rt, session.workloads.load(settings.workload))
    stats = engine.block_trie.stats
    assert stats.num_hit_tokens == rt.counters.hit_tokens > 0
    assert stats.num_query_tokens == rt.counters.query_tokens


def runtime(text: str) -> Runtime:
    return runtime_for(settings_from_toml(text))


def test_the_passes_order_lmdeploys_prefills():
    """Three waiting sequences of priorities... by prompt length here: with
    the prefix-aware pass, the one whose prefix is cached goes first; in
    LMDeploy's own order (arrival) it would go last."""
    rt = runtime('[kv_pool]\nnum_blocks = 64\n[eviction]\nplugin = "lru"\n[scheduler]\npasses = ["prefix-aware"]\n')

    class Arrivals:
        matches = {}

        @hookimpl
        def sagellm_request_arrived(self, request, match):
            self.matches[request.request_id] = match.block_ids

    rt.pm.register(arrivals := Arrivals())
    with installed(rt):
        scheduler = build_scheduler(64, 16, max_batches=1)
        assert isinstance(scheduler.block_trie, SagellmBlockTrie)
        warm = scheduler.add_session(0).add_sequence(np.arange(64, dtype=np.int64), sampling_param=lm.SamplingParam(max_new_tokens=1))
        out = scheduler.schedule(is_prefill=True, prealloc_size=16)
        scheduler.activate_seqs(out.running)
        warm.update_token_ids(np.array([0]), mode=lm.UpdateTokenMode.PREFILL)
        warm.finish()
        scheduler.end_session(0)
        seqs = []
        for number, prompt in enumerate([np.arange(1000, 1040), np.arange(2000, 2040), np.arange(0, 70)], start=1):
            seqs.append(scheduler.add_session(number).add_sequence(prompt.astype(np.int64), sampling_param=lm.SamplingParam(max_new_tokens=1)))
        out = scheduler.schedule(is_prefill=True, prealloc_size=16)
    assert out.running == [seqs[2]]  # the cached 64-token prefix first
    assert seqs[2].num_history_ids == 64
    # Each arrival was told the cached prefix it will hit: the warm prompt's 4 blocks.
    warm_blocks = tuple(b.block_id for b in sorted(scheduler.block_trie.sagellm.cached.values(), key=lambda b: b.depth))
    assert sorted(map(len, arrivals.matches.values())) == [0, 0, 4]
    assert arrivals.matches[f"3/{seqs[2].seq_id}"] == warm_blocks


@pytest.fixture
def test_policies(tmp_path):
    declare_plugins(
        tmp_path, {"sagellm.eviction": {"stranger": "sagellm_core.testing:StrangerVictims"}}, name="sagellm-lmdeploy-test-policies"
    )


def test_a_victim_that_is_not_evictable_is_named(test_policies):
    rt = runtime('[kv_pool]\nnum_blocks = 8\n[eviction]\nplugin = "stranger"\n')
    with installed(rt):
        scheduler = build_scheduler(8, 16, max_batches=1)
        first = scheduler.add_session(0).add_sequence(np.arange(96, dtype=np.int64), sampling_param=lm.SamplingParam(max_new_tokens=1))
        out = scheduler.schedule(is_prefill=True, prealloc_size=0)
        scheduler.activate_seqs(out.running)
        first.update_token_ids(np.array([0]), mode=lm.UpdateTokenMode.PREFILL)
        first.finish()
        scheduler.end_session(0)
        scheduler.add_session(1).add_sequence(np.arange(500, 596, dtype=np.int64), sampling_param=lm.SamplingParam(max_new_tokens=1))
        with pytest.raises(PluginError, match="eviction plugin 'stranger'.*not evictable candidates"):
            scheduler.schedule(is_prefill=True, prealloc_size=0)


def test_lmdeploy_paging_suite_passes_with_sagellm_classes():
    """LMDeploy's own tests/pytorch/paging with sagellm's classes installed
    fail nothing that stock LMDeploy passes. LMDeploy publishes no tests on
    PyPI: set LMDEPLOY_PAGING_TESTS to a checkout's tests/pytorch/paging."""
    import os
    import subprocess
    import sys

    tests = os.environ.get("LMDEPLOY_PAGING_TESTS")
    if not tests:
        pytest.skip("LMDEPLOY_PAGING_TESTS is not set (LMDeploy's tests come only from its repository)")
    result = subprocess.run(
        [sys.executable, str(HERE / "lmdeploy_suite" / "run.py"), "--tests", tests], capture_output=True, text=True
    )
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_the_kv_pool_plugin_picks_lmdeploys_physical_blocks():
    from sagellm_plugin_lmdeploy.trie import SagellmPhysicalAllocator

    rt = runtime('[kv_pool]\nnum_blocks = 16\nplugin = "paged"\n[eviction]\nplugin = "lru"\n')
    with installed(rt):
        scheduler = build_scheduler(16, 16, max_batches=1)
        assert isinstance(scheduler.block_manager.allocator._gpu_allocator, SagellmPhysicalAllocator)
        seq = scheduler.add_session(0).add_sequence(np.arange(40, dtype=np.int64), sampling_param=lm.SamplingParam(max_new_tokens=1))
        scheduler.schedule(is_prefill=True, prealloc_size=16)
    table = scheduler.get_block_tables([seq])[0]
    assert len(table) == 4 and rt.pool_usage().num_free_blocks == 12
    assert set(table.tolist()) == set(range(16)) - set(rt.plugins["kv_pool"][0].instance._free)  # the paged pool's ids
