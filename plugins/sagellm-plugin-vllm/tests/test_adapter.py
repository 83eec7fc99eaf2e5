"""sagellm's decisions inside vLLM's real v1 scheduler and block pool."""

from __future__ import annotations

import pytest
from sagellm_plugin_vllm import compat as v
from sagellm_plugin_vllm.engine import build_scheduler, made_up_output
from sagellm_plugin_vllm.live import ENGINE_OWNS

from sagellm_core.drivers.engines import build_engine
from sagellm_core.errors import PluginError
from sagellm_core.kit.testing import declare_plugins, settings_from_toml
from sagellm_core.replay import session
from sagellm_core.runtime import Runtime

from .conftest import HERE


def mooncake_config(trace, engine: str, policy: str, *, scheduler: str = "sagellm", n=300, blocks=3000) -> str:
    replay = engine == "replay"
    return (
        f'[engine]\nname = "{engine}"\n'
        + ('mode = "cache-only"\n' if replay else f'scheduler = "{scheduler}"\nmax_num_batched_tokens = 262144\n')
        + f'[workload]\nsource = "mooncake"\npath = "{trace}"\nmax_requests = {n}\n'
        + "[prefix_cache]\nblock_size = 16\n"
        + ('plugin = "radix"\n' if replay else "")
        + f"[kv_pool]\nnum_blocks = {blocks}\n"
        + ('plugin = "paged"\n' if replay else "")
        + f'[eviction]\nplugin = "{policy}"\n[report]\nhook_timing = false\n'
    )


def hits(text: str) -> tuple[int, int, int]:
    result = session.run(settings_from_toml(text))
    c = result.runtime.counters
    return c.query_blocks, c.hit_blocks, result.report["requests"]


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_vllm_and_replay_hit_the_same_blocks(mooncake, policy):
    """The Mooncake trace through vLLM's scheduler and block pool with a
    sagellm policy, and through sagellm replay with the same policy: equal
    hit counts, to the block; for LRU also equal to stock vLLM. The pool is
    small enough that eviction decides the hits."""
    replay = hits(mooncake_config(mooncake, "replay", policy))
    inside_vllm = hits(mooncake_config(mooncake, "vllm", policy))
    assert replay == inside_vllm
    assert replay[1] > 0 and replay[2] > 250  # the rest do not fit 3,000 blocks: rejected by both
    if policy == "lru":
        assert hits(mooncake_config(mooncake, "vllm", "lru", scheduler="stock")) == replay


def test_policies_change_vllms_hits():
    """A different policy inside vLLM gives different hits: the decision is
    really sagellm's. (The built-in multi-tenant generator, a pool that holds
    a few sessions.)"""
    counts = {
        policy: hits(
            f'[engine]\nname = "vllm"\n[kv_pool]\nnum_blocks = 400\n[eviction]\nplugin = "{policy}"\n'
            "[report]\nhook_timing = false\n"
        )
        for policy in ("lru", "lfu", "s3fifo")
    }
    assert len({c[0] for c in counts.values()}) == 1  # the same queries
    assert len({c[1] for c in counts.values()}) == 3, counts  # different hits


def test_hit_counts_are_vllms_own_stats(mooncake):
    settings = settings_from_toml(mooncake_config(mooncake, "vllm", "lru", n=100))
    engine, _ = build_engine(settings)
    rt = Runtime(settings, engine_owns=engine.owns)
    engine.run(rt, session.workloads.load(settings.workload))
    stats = engine.prefix_cache_stats
    assert stats.requests == rt.counters.requests_finished > 90
    assert stats.hits == rt.counters.hit_tokens and stats.queries == rt.counters.query_tokens


def runtime(text: str) -> Runtime:
    return Runtime(settings_from_toml(text), engine_owns=ENGINE_OWNS)


def requests(n: int, prompt_tokens: int, max_tokens: int, priorities=None):
    v.init_none_hash(v.sha256)
    hasher = v.get_request_block_hasher(16, v.sha256)
    return [
        v.VllmRequest(
            request_id=f"r{i}",
            prompt_token_ids=[100 + i] * prompt_tokens,
            sampling_params=v.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            arrival_time=float(i),
            block_hasher=hasher,
            priority=priorities[i] if priorities else 0,
        )
        for i in range(n)
    ]


def drive(scheduler, steps: int):
    preempted, admitted = [], []
    for _ in range(steps):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        preempted += sorted(out.preempted_req_ids)
        admitted += [r.req_id for r in out.scheduled_new_reqs]
        scheduler.update_from_output(out, made_up_output(scheduler, out))
    return preempted, admitted


def small_scheduler(rt: Runtime, num_blocks: int, max_num_seqs: int = 8):
    return build_scheduler(
        "sagellm",
        block_size=16,
        num_blocks=num_blocks,
        max_num_batched_tokens=512,
        max_num_seqs=max_num_seqs,
        max_model_len=4096,
        runtime=rt,
    )


@pytest.fixture
def test_policies(tmp_path):
    declare_plugins(
        tmp_path,
        {
            "sagellm.eviction": {
                "oldest-first": "sagellm_core.kit.testing:OldestFirstPreemption",
                "stranger": "sagellm_core.kit.testing:StrangerVictims",
            }
        },
        name="sagellm-vllm-test-policies",
    )


def test_the_hook_chooses_vllms_preemption_victim(test_policies):
    """Four requests grow until the pool runs out: stock vLLM preempts the
    last one scheduled, the hook here the first to arrive."""
    base = '[kv_pool]\nnum_blocks = 24\n[prefix_cache]\nblock_size = 16\n[scheduler]\npasses = ["fcfs"]\n'
    victims = {}
    for policy in ("lru", "oldest-first"):
        scheduler = small_scheduler(runtime(base + f'[eviction]\nplugin = "{policy}"\n'), num_blocks=24)
        for request in requests(4, prompt_tokens=40, max_tokens=60):
            scheduler.add_request(request)
        preempted, _ = drive(scheduler, 400)
        assert preempted, "the pool is small enough to force a preemption"
        victims[policy] = preempted[0]
        assert not scheduler.has_unfinished_requests()
    assert victims == {"lru": "r3", "oldest-first": "r0"}


def test_the_passes_order_vllms_admissions():
    """One sequence slot, requests of priorities 2, 0, 1 waiting: the
    priority pass admits r1, then r2, then r0."""
    rt = runtime('[kv_pool]\nnum_blocks = 64\n[scheduler]\npasses = ["priority"]\n')
    scheduler = small_scheduler(rt, num_blocks=64, max_num_seqs=1)
    for request in requests(3, prompt_tokens=20, max_tokens=3, priorities=[2, 0, 1]):
        scheduler.add_request(request)
    _, admitted = drive(scheduler, 50)
    assert admitted == ["r1", "r2", "r0"]


def test_a_victim_that_is_not_evictable_is_named(test_policies):
    rt = runtime('[kv_pool]\nnum_blocks = 8\n[eviction]\nplugin = "stranger"\n')
    scheduler = small_scheduler(rt, num_blocks=8)
    first, second = requests(2, prompt_tokens=100, max_tokens=1)
    scheduler.add_request(first)
    drive(scheduler, 10)  # leaves 6 cached blocks, 2 free
    scheduler.add_request(second)
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    with pytest.raises(PluginError, match="eviction plugin 'stranger'.*not evictable candidates"):
        drive(scheduler, 10)
    # No block was lost: the two free blocks taken before the bad answer are back.
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free
    assert len(scheduler.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()) == free


def test_engine_without_vllm_config_error_names_the_fix(monkeypatch):
    from sagellm_plugin_vllm.live import load_runtime

    from sagellm_core.errors import ConfigError

    monkeypatch.delenv("SAGELLM_CONFIG", raising=False)
    with pytest.raises(ConfigError, match="SAGELLM_CONFIG"):
        load_runtime(100, 16)


def test_vllms_test_suite_passes_with_sagellm_classes(tmp_path):
    """vLLM's own tests/v1/core test_scheduler.py and test_prefix_caching.py
    with sagellm's classes substituted fail nothing that stock vLLM passes
    (vllm_suite/run.py; needs PyPI for vLLM's sdist)."""
    import os
    import subprocess
    import sys

    cache = os.environ.get("VLLM_SUITE_CACHE", str(tmp_path))
    result = subprocess.run(
        [sys.executable, str(HERE / "vllm_suite" / "run.py"), "--cache", cache], capture_output=True, text=True
    )
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "sagellm substituted:  4" in result.stdout


def test_replay_through_vllm_with_the_host_tier(mooncake):
    """The connector in the replay driver: blocks evicted from a small device
    pool come back from the host tier, counted apart from device hits."""
    text = (
        mooncake_config(mooncake, "vllm", "lru", n=200, blocks=3000).replace(
            "max_num_batched_tokens = 262144\n", "max_num_batched_tokens = 262144\nhost_blocks = 60000\n"
        )
        + '[transport]\nplugin = "local"\nhost_blocks = 60000\nbytes_per_block = 16\n'
    )
    report = session.run(settings_from_toml(text)).report
    assert report["host_hit_blocks"] > 0 and report["transfers"]["failures"] == 0
    assert report["transfers"]["blocks"] >= report["host_hit_blocks"]


@pytest.mark.parametrize("passes", ['[scheduler]\npasses = ["fcfs"]\n', ""])
def test_first_tokens_are_stamped_with_and_without_passes(passes):
    """The first token is stamped the step after it (not at finish), also
    when no pass runs and the scheduler maps no state per step; the states
    the passes read are refreshed from vLLM's requests."""
    rt = runtime("[kv_pool]\nnum_blocks = 64\n" + passes)
    outcomes = []
    scheduler = build_scheduler(
        "sagellm",
        block_size=16,
        num_blocks=64,
        max_num_batched_tokens=512,
        max_num_seqs=8,
        max_model_len=4096,
        runtime=rt,
        on_finished=outcomes.append,
    )
    for request in requests(3, prompt_tokens=20, max_tokens=5):
        scheduler.add_request(request)
    for step in range(50):
        if not scheduler.has_unfinished_requests():
            break
        rt.set_time(float(step))
        # The passes run (and the states are refreshed) before vLLM schedules.
        before = {r.request_id: (r.num_computed_tokens, r.num_output_tokens) for r in scheduler.running}
        out = scheduler.schedule()
        if passes:
            for request in scheduler.running:
                state = request.sagellm_state
                if request.request_id in before:
                    assert (state.num_computed_tokens, state.num_output_tokens) == before[request.request_id]
        scheduler.update_from_output(out, made_up_output(scheduler, out))
    assert len(outcomes) == 3
    for outcome in outcomes:
        assert outcome.num_output_tokens == 5
        assert outcome.first_token_s < outcome.finish_s  # stamped when it came, 4 steps before the last


def test_a_pass_that_caps_chunks_is_refused_not_dropped():
    """vLLM sizes each request's chunk itself: a pass's chunk limits
    (tenant-shares capping one of the generator's tenants) end the run with
    one line naming the pass, rather than being dropped unsaid."""
    config = (
        '[engine]\nname = "vllm"\n[kv_pool]\nnum_blocks = 400\n[eviction]\nplugin = "lru"\n'
        '[scheduler]\npasses = ["fcfs", "tenant-shares"]\n[scheduler.tenant-shares]\ncaps = {"tenant-0" = 0.01}\n'
        "[report]\nhook_timing = false\n"
    )
    with pytest.raises(PluginError) as caught:
        session.run(settings_from_toml(config))
    message = str(caught.value)
    assert message.splitlines() == [message]
    assert "tenant-shares" in message and "chunk_limits" in message and "vllm engine does not honour" in message


def test_each_request_keeps_its_tenant_inside_vllm():
    """The built-in generator's tenants reach the requests sagellm's policies
    see inside vLLM: the per-tenant hit rates name the same tenants as
    sagellm replay's, each with the same queried blocks."""
    config = (
        '[engine]\nname = "{engine}"\n[kv_pool]\nnum_blocks = 400\n{pool}[eviction]\nplugin = "lru"\n'
        "[report]\nhook_timing = false\n"
    )
    replay_plugins = 'plugin = "paged"\n[prefix_cache]\nplugin = "radix"\n'
    per_tenant = {}
    for engine, pool in (("vllm", ""), ("replay", replay_plugins)):
        result = session.run(settings_from_toml(config.format(engine=engine, pool=pool)))
        per_tenant[engine] = {t: q for t, (q, _) in result.runtime.counters.tenant_blocks.items()}
    assert len(per_tenant["replay"]) > 1
    assert per_tenant["vllm"] == per_tenant["replay"]
