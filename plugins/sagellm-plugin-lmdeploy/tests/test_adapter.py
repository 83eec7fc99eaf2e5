"""sagellm's decisions inside LMDeploy's real PyTorch-engine paging layer."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from sagellm_plugin_lmdeploy import compat as lm
from sagellm_plugin_lmdeploy.engine import build_scheduler
from sagellm_plugin_lmdeploy.install import installed
from sagellm_plugin_lmdeploy.live import runtime_for
from sagellm_plugin_lmdeploy.trie import SagellmBlockTrie

from sagellm_core import hookimpl
from sagellm_core.drivers.engines import build_engine
from sagellm_core.errors import ConfigError, PluginError
from sagellm_core.kit.testing import declare_plugins, settings_from_toml
from sagellm_core.replay import session
from sagellm_core.runtime import Runtime

from .conftest import HERE


def mooncake_config(
    trace, engine: str, policy: str, *, scheduler: str = "sagellm", matching: str | None = None, n=300, blocks=3000
) -> str:
    """``matching``: the prefix-cache plugin (replay needs one; inside
    LMDeploy it replaces LMDeploy's trie walk)."""
    replay = engine == "replay"
    if replay:
        matching = matching or "radix"
    return (
        f'[engine]\nname = "{engine}"\n'
        + ('mode = "cache-only"\nprealloc_tokens = 16\n' if replay else f'scheduler = "{scheduler}"\n')
        + f'[workload]\nsource = "mooncake"\npath = "{trace}"\nmax_requests = {n}\n'
        + "[prefix_cache]\nblock_size = 16\n"
        + (f'plugin = "{matching}"\n' if matching else "")
        # sagellm's paged pool also picks LMDeploy's physical blocks when sagellm decides.
        + f"[kv_pool]\nnum_blocks = {blocks}\n"
        + ('plugin = "paged"\n' if replay or scheduler == "sagellm" else "")
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


@pytest.mark.parametrize("plugin", ["radix", "hash"])
def test_the_prefix_cache_plugin_decides_lmdeploys_matches(mooncake, plugin):
    """With ``[prefix_cache] plugin`` named, the plugin's index and not
    LMDeploy's trie walk decides every match inside LMDeploy's scheduler:
    LMDeploy's trie stays empty, the plugin holds exactly the blocks sagellm
    sees cached, and LMDeploy's own hit statistics are the plugin's hits.
    The hits and evictions equal replay with the plugin, and LMDeploy's own
    trie with the same policy (both match exactly)."""
    text = mooncake_config(mooncake, "lmdeploy", "s3fifo", matching=plugin)
    settings = settings_from_toml(text)
    engine, _ = build_engine(settings)
    rt = runtime_for(settings)
    engine.run(rt, session.workloads.load(settings.workload))
    trie = engine.block_trie
    assert trie.matcher is not None
    assert not any(root.children for root in trie._roots.values()), "LMDeploy's trie walk cached blocks"
    assert rt.num_cached_blocks == len(trie.sagellm.cached) > 0
    assert set(rt.evictable()) == trie.sagellm.evictable  # every sequence ended: only the cache holds blocks
    assert trie.stats.num_hit_tokens == rt.counters.hit_tokens > 0
    # A block's logical id (what the trie and the plugin hold) is the id the
    # pool chose: LMDeploy's own logical ids drift from it.
    memory = trie.allocator._log_mem
    cached = np.array(sorted(trie.sagellm.cached), dtype=np.int64)
    assert (memory.phy_map[cached] == cached + trie.allocator._gpu_allocator.offset).all()
    inside = counts(text)
    assert inside == counts(mooncake_config(mooncake, "replay", "s3fifo", matching=plugin))
    assert inside == counts(mooncake_config(mooncake, "lmdeploy", "s3fifo"))
    assert inside[2] > 0


def test_kv_events_from_inside_lmdeploy(tmp_path):
    """The radix plugin's KV events (blocks stored / removed, for a router)
    describe LMDeploy's cache: replayed in order they leave exactly the
    blocks cached at the end."""
    events = tmp_path / "events.jsonl"
    text = (
        f'[engine]\nname = "lmdeploy"\n[prefix_cache]\nplugin = "radix"\nevents = "{events}"\n'
        '[kv_pool]\nnum_blocks = 400\n[eviction]\nplugin = "lru"\n[report]\nhook_timing = false\n'
    )
    settings = settings_from_toml(text)
    engine, _ = build_engine(settings)
    rt = runtime_for(settings)
    engine.run(rt, session.workloads.load(settings.workload))
    held: set[int] = set()
    removed = 0
    for line in events.read_text().splitlines():
        event = json.loads(line)
        if event["type"] == "stored":
            held.update(event["keys"])
        else:
            removed += len(event["keys"])
            held.difference_update(event["keys"])
    assert removed == rt.counters.evicted_blocks > 0
    assert held == {b.key for b in engine.block_trie.sagellm.cached.values()}


@pytest.mark.parametrize("pin_after_hits", [0, 2])
def test_pinned_prefixes_survive_inside_lmdeploy(pin_after_hits):
    """The radix plugin pins a prefix once it has been matched often enough;
    inside LMDeploy a pinned block is never offered to the policy. System
    prompt A is matched twice (pinned), then B once, then a long unrelated
    prompt flushes all but two blocks of the pool: LRU keeps B's (used
    last), so the next request of A misses, unless A is pinned."""
    rt = runtime(
        f'[prefix_cache]\nplugin = "radix"\npin_after_hits = {pin_after_hits}\nmax_pinned_share = 0.25\n'
        '[kv_pool]\nnum_blocks = 32\n[eviction]\nplugin = "lru"\n'
    )

    def prompt(system: int, n: int):  # a 2-block system prompt, then 200 tokens of the request's own
        return np.concatenate([np.arange(system, system + 32), np.arange(100 * n, 100 * n + 200)]).astype(np.int64)

    flush = np.arange(50_000, 50_464, dtype=np.int64)  # 29 blocks, 30 with LMDeploy's decode reserve
    order = [
        prompt(5000, 0),
        prompt(5000, 1),
        prompt(5000, 2),
        prompt(7000, 3),
        prompt(7000, 4),
        flush,
        prompt(5000, 5),
    ]
    hits = []
    with installed(rt):
        scheduler = build_scheduler(32, 16, max_batches=1)
        for number, tokens in enumerate(order):
            seq = scheduler.add_session(number).add_sequence(tokens, sampling_param=lm.SamplingParam(max_new_tokens=1))
            out = scheduler.schedule(is_prefill=True, prealloc_size=16)
            assert out.running == [seq]
            hits.append(seq.num_history_ids)
            scheduler.activate_seqs(out.running)
            seq.update_token_ids(np.array([0]), mode=lm.UpdateTokenMode.PREFILL)
            seq.finish()
            scheduler.end_session(number)
    assert hits[:6] == [0, 32, 32, 0, 32, 0]
    pinned = set(rt.pinned_blocks())
    if pin_after_hits:
        assert len(pinned) == 2 and pinned <= set(scheduler.block_trie.sagellm.cached)
        assert hits[6] == 32
    else:
        assert not pinned and hits[6] == 0


def test_a_model_with_ssm_checkpoints_keeps_lmdeploys_matching():
    rt = runtime('[prefix_cache]\nplugin = "radix"\n[kv_pool]\nnum_blocks = 16\n[eviction]\nplugin = "lru"\n')
    allocator = build_scheduler(16, 16, max_batches=1).block_manager.allocator
    with installed(rt), pytest.raises(ConfigError, match="radix.*SSM state checkpoints.*leave out"):
        SagellmBlockTrie(allocator=allocator, block_size=16, enabled=True, checkpoint_state_manager=object())


def test_a_prefix_cache_plugin_must_page_as_lmdeploy_does():
    """A plugin paging prompts in 16-token pages while LMDeploy's blocks
    hold 4 tokens would cache pages no block holds (a hypothesis example
    corrupted the radix tree so): refused, naming both sizes."""
    rt = runtime('[prefix_cache]\nplugin = "radix"\n[kv_pool]\nnum_blocks = 16\n[eviction]\nplugin = "lru"\n')
    allocator = build_scheduler(16, 4, max_batches=1).block_manager.allocator
    with installed(rt), pytest.raises(ConfigError, match="block_size is 16 and LMDeploy's block size is 4"):
        SagellmBlockTrie(allocator=allocator, block_size=4, enabled=True)


def test_a_kv_pool_plugin_refuses_lmdeploys_cpu_swap():
    """The pool's block ids are LMDeploy's logical ids, which a swap to the
    CPU would remap: refused with a one-line reason."""
    rt = runtime('[kv_pool]\nplugin = "paged"\nnum_blocks = 16\n[eviction]\nplugin = "lru"\n')
    allocator = lm.LogicalAllocator(num_cpu_blocks=8, num_gpu_blocks=16)
    with installed(rt), pytest.raises(ConfigError, match="num_cpu_blocks = 0"):
        SagellmBlockTrie(allocator=allocator, block_size=16, enabled=True)


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
    engine, _ = build_engine(settings)
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

    rt.host.pm.register(arrivals := Arrivals())
    with installed(rt):
        scheduler = build_scheduler(64, 16, max_batches=1)
        assert isinstance(scheduler.block_trie, SagellmBlockTrie)
        warm = scheduler.add_session(0).add_sequence(
            np.arange(64, dtype=np.int64), sampling_param=lm.SamplingParam(max_new_tokens=1)
        )
        out = scheduler.schedule(is_prefill=True, prealloc_size=16)
        scheduler.activate_seqs(out.running)
        warm.update_token_ids(np.array([0]), mode=lm.UpdateTokenMode.PREFILL)
        warm.finish()
        scheduler.end_session(0)
        seqs = []
        for number, prompt in enumerate([np.arange(1000, 1040), np.arange(2000, 2040), np.arange(0, 70)], start=1):
            seqs.append(
                scheduler.add_session(number).add_sequence(
                    prompt.astype(np.int64), sampling_param=lm.SamplingParam(max_new_tokens=1)
                )
            )
        out = scheduler.schedule(is_prefill=True, prealloc_size=16)
    assert out.running == [seqs[2]]  # the cached 64-token prefix first
    assert seqs[2].num_history_ids == 64
    # Each arrival was told the cached prefix it will hit: the warm prompt's 4 blocks.
    warm_blocks = tuple(b.block_id for b in sorted(scheduler.block_trie.sagellm.cached.values(), key=lambda b: b.depth))
    assert sorted(map(len, arrivals.matches.values())) == [0, 0, 0, 4]  # the warm-up request arrived too
    assert arrivals.matches[f"3/{seqs[2].seq_id}"] == warm_blocks


def test_lmdeploys_requests_are_observed_arriving_and_finishing():
    """A live engine's requests, through LMDeploy's scheduler: each arrives
    once (told its cached prefix) and finishes once, when its sequence
    stops, with the tokens LMDeploy generated (what online lifetime
    predictors learn from). A session's second turn (LMDeploy's interactive
    mode: new input tokens, the stopped sequence woken) is a request of its
    own. sagellm keeps no state for a sequence LMDeploy let go of."""
    from sagellm_plugin_lmdeploy import reorder

    rt = runtime('[kv_pool]\nnum_blocks = 64\n[eviction]\nplugin = "lru"\n')

    class Requests:
        arrived, finished = [], []

        @hookimpl
        def sagellm_request_arrived(self, request, match):
            self.arrived.append((request.request_id, request.num_prompt_tokens, match.num_blocks))

        @hookimpl
        def sagellm_request_finished(self, outcome):
            self.finished.append((outcome.request.request_id, outcome.num_output_tokens))

    def generate(scheduler, seq, tokens: int) -> None:
        out = scheduler.schedule(is_prefill=True, prealloc_size=0)
        assert out.running == [seq]
        scheduler.activate_seqs(out.running)
        seq.update_token_ids(np.array([1]), mode=lm.UpdateTokenMode.PREFILL)
        for _ in range(tokens - 1):
            assert scheduler.schedule_running([seq], num_required_tokens=1, prealloc_size=1) == [True]
            seq.update_token_ids(np.array([1]), mode=lm.UpdateTokenMode.DECODE)
        seq.finish()

    rt.host.pm.register(seen := Requests())
    seqs = []
    with installed(rt):
        scheduler = build_scheduler(64, 16, max_batches=2)
        for number, generated in enumerate([3, 5]):
            seq = scheduler.add_session(number).add_sequence(
                np.arange(40, dtype=np.int64), sampling_param=lm.SamplingParam(max_new_tokens=8)
            )
            seqs.append(seq)
            assert id(seq) in reorder._states
            generate(scheduler, seq, generated)
            assert id(seq) not in reorder._states
        # Session 1's second turn: 20 new tokens after its 45.
        seq.update_token_ids(np.arange(500, 520, dtype=np.int64), mode=lm.UpdateTokenMode.INPUTS)
        seq.activate()
        generate(scheduler, seq, 2)
        for number in range(2):
            scheduler.end_session(number)
    assert seen.arrived == [("0/0", 40, 0), ("1/1", 40, 2), ("1/1", 65, 2)]  # 2 full blocks cached by the first
    assert seen.finished == [("0/0", 3), ("1/1", 5), ("1/1", 2)]
    assert rt.counters.requests_finished == 3
    assert not any(id(seq) in reorder._states for seq in seqs)


@pytest.fixture
def test_policies(tmp_path):
    declare_plugins(
        tmp_path,
        {
            "sagellm.eviction": {
                "stranger": "sagellm_core.kit.testing:StrangerVictims",
                "oldest-first": "sagellm_core.kit.testing:OldestFirstPreemption",
            }
        },
        name="sagellm-lmdeploy-test-policies",
    )


def decode_until_preempted(policy: str | None):
    """Two sequences prefilled into a full 6-block pool: A (40 tokens, room
    to grow in its 3 blocks) and B (48 tokens, its 3 blocks full). One
    sampled token each; LMDeploy's decode admission (``schedule_running``)
    must then find B a 4th block. Returns the batch's valid mask, and the
    sequences."""
    rt = runtime(f'[kv_pool]\nnum_blocks = 6\n[eviction]\nplugin = "{policy}"\n') if policy else None
    with installed(rt) if rt else contextlib.nullcontext():
        scheduler = build_scheduler(6, 16, max_batches=2)
        a = scheduler.add_session(0).add_sequence(
            np.arange(40, dtype=np.int64), sampling_param=lm.SamplingParam(max_new_tokens=8)
        )
        b = scheduler.add_session(1).add_sequence(
            np.arange(100, 148, dtype=np.int64), sampling_param=lm.SamplingParam(max_new_tokens=8)
        )
        out = scheduler.schedule(is_prefill=True, prealloc_size=0)
        assert out.running == [a, b] and scheduler.block_manager.get_num_free_gpu_blocks() == 0
        scheduler.activate_seqs(out.running)
        for seq in (a, b):
            seq.update_token_ids(np.array([7]), mode=lm.UpdateTokenMode.PREFILL)
        valid = scheduler.schedule_running([a, b], num_required_tokens=1, prealloc_size=1)
    return valid, a, b


def test_the_hook_chooses_lmdeploys_preemption_victim(test_policies):
    """Stock LMDeploy preempts the sequence that cannot grow (B), and so
    does sagellm's LRU (vLLM's FCFS rule: the last of the batch). A policy
    that preempts the oldest request instead makes LMDeploy preempt A, whose
    blocks B then grows into; A waits to be recomputed."""
    stock, lru, oldest = (decode_until_preempted(policy) for policy in (None, "lru", "oldest-first"))
    for valid, a, b in (stock, lru):
        assert valid == [True, False]
        assert a.status == lm.MessageStatus.RUNNING and b.status != lm.MessageStatus.RUNNING
    valid, a, b = oldest
    assert valid == [False, True]
    assert b.status == lm.MessageStatus.RUNNING and b.num_blocks == 4
    assert a.status == lm.MessageStatus.WAITING and a.num_blocks == 0


def test_a_victim_that_is_not_evictable_is_named(test_policies):
    rt = runtime('[kv_pool]\nnum_blocks = 8\n[eviction]\nplugin = "stranger"\n')
    with installed(rt):
        scheduler = build_scheduler(8, 16, max_batches=1)
        first = scheduler.add_session(0).add_sequence(
            np.arange(96, dtype=np.int64), sampling_param=lm.SamplingParam(max_new_tokens=1)
        )
        out = scheduler.schedule(is_prefill=True, prealloc_size=0)
        scheduler.activate_seqs(out.running)
        first.update_token_ids(np.array([0]), mode=lm.UpdateTokenMode.PREFILL)
        first.finish()
        scheduler.end_session(0)
        scheduler.add_session(1).add_sequence(
            np.arange(500, 596, dtype=np.int64), sampling_param=lm.SamplingParam(max_new_tokens=1)
        )
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
        seq = scheduler.add_session(0).add_sequence(
            np.arange(40, dtype=np.int64), sampling_param=lm.SamplingParam(max_new_tokens=1)
        )
        scheduler.schedule(is_prefill=True, prealloc_size=16)
    table = scheduler.get_block_tables([seq])[0]
    assert len(table) == 4 and rt.pool_usage().num_free_blocks == 12
    assert set(table.tolist()) == set(range(16)) - set(
        rt.host.plugins["kv_pool"][0].instance._free
    )  # the paged pool's ids


def test_a_pass_that_caps_chunks_is_refused_not_dropped():
    """LMDeploy sizes each prefill itself: a pass's chunk limits (two
    waiting prefills, tenant-shares capping their tenant at one token) end the step with
    one line naming the pass, rather than being dropped unsaid."""
    rt = runtime(
        '[kv_pool]\nnum_blocks = 64\n[eviction]\nplugin = "lru"\n[scheduler]\npasses = ["fcfs", "tenant-shares"]\n'
        '[scheduler.tenant-shares]\ncaps = {"default" = 0.0}\n'
    )
    with installed(rt):
        scheduler = build_scheduler(64, 16, max_batches=2)
        for number, start in enumerate([1000, 2000], start=1):
            scheduler.add_session(number).add_sequence(
                np.arange(start, start + 70, dtype=np.int64), sampling_param=lm.SamplingParam(max_new_tokens=1)
            )
        with pytest.raises(PluginError) as caught:
            scheduler.schedule(is_prefill=True, prealloc_size=16)
    message = str(caught.value)
    assert message.splitlines() == [message]
    assert "tenant-shares" in message and "chunk_limits" in message and "lmdeploy engine does not honour" in message
