"""Token-identical greedy outputs (fp32, CPU) on 32 multi-turn chats with
shared system prompts: the engine against transformers' own generate, and
against itself with the prefix cache off, with evictions and host-tier
reloads forced, with reloads from a disk tier and after a restart that
reloads it, under preemption, and one request at a time; each serially
and with ``async_scheduling`` (step N+1 packed while step N runs). Each run
asserts that it did what its name says (it hit the cache, it evicted, it
reloaded, it preempted), so no row passes by doing nothing.

Every run is compared with the one reference, so no configuration runs
twice: the batched run with the prefix cache on (test_prefix_cache_on_equals_off)
is what one request at a time is equal to, and the disk tier's two engines
are one of each step loop."""

import pytest
from sagellm_plugin_torch import testing as helpers

pytestmark = pytest.mark.engine

MAX_TOKENS = 12
#: The chats served one request at a time: each question once, each system
#: prompt three times, one- and two-turn chats (a request alone runs the same
#: whatever else was asked before it, but for the cache hits those leave).
ONE_AT_A_TIME = 12


@pytest.fixture(params=[False, True], ids=["serial", "async"])
def overlap(request):
    return request.param


@pytest.fixture(scope="module")
def chats(smollm2):
    return helpers.chat_prompts(smollm2[1], 32)


@pytest.fixture(scope="module")
def reference(smollm2, chats):
    return helpers.hf_generate(smollm2[0], chats, MAX_TOKENS)


def run(tmp_path, chats, overlap=False, **config):
    core = helpers.engine_core(helpers.write_config(tmp_path, **config), async_scheduling=overlap)
    results = core.generate(helpers.requests(chats, MAX_TOKENS))
    core.rt.check_invariants()
    assert not core.has_work() and core.rt.counters.requests_finished == len(chats)
    return [results[f"r{i}"] for i in range(len(chats))], core.rt.counters


def test_equals_transformers_generate(tmp_path, chats, reference, overlap):
    outputs, counters = run(tmp_path, chats, overlap, prefix_cache=False)
    assert outputs == reference
    assert counters.hit_blocks == 0


def test_prefix_cache_on_equals_off(tmp_path, chats, reference, overlap):
    outputs, counters = run(tmp_path, chats, overlap)
    assert counters.hit_blocks > 0  # the shared system prompts were reused
    assert outputs == reference


def test_evictions_and_host_tier_reloads(tmp_path, chats, reference, overlap):
    outputs, counters = run(tmp_path, chats, overlap, num_blocks=24, max_num_seqs=4, offload=True)
    assert counters.evicted_blocks > 0, "the pool was meant to be too small to keep everything"
    assert counters.host_hit_blocks > 0, "evicted blocks were meant to be reloaded from the host tier"
    assert counters.transfer_failures == 0 and counters.preemptions == 0
    assert outputs == reference


def test_disk_tier_reloads_then_a_restart_that_reloads_the_disk(tmp_path, chats, reference):
    # The first engine steps serially, the one after the restart with
    # async_scheduling: each loop evicts to disk and reloads from it.
    disk = f'[kv_stores]\ntiers = ["disk"]\n[kv_stores.disk]\npath = "{tmp_path / "kv"}"\n'
    outputs, counters = run(tmp_path, chats, False, num_blocks=24, max_num_seqs=4, extra=disk)
    assert counters.evicted_blocks > 0 and counters.host_hit_blocks > 0, "blocks were meant to come back from disk"
    assert outputs == reference
    # A new engine and runtime on the same folder: each chat's prefix is on disk.
    (tmp_path / "again").mkdir()
    core = helpers.engine_core(
        helpers.write_config(tmp_path / "again", num_blocks=24, max_num_seqs=4, extra=disk), async_scheduling=True
    )
    results = core.generate(helpers.requests(chats, MAX_TOKENS))
    core.rt.check_invariants()
    assert core.rt.stores.report()["disk"]["store"]["recovered"] > 0 and core.rt.counters.host_hit_blocks > 0
    assert core.rt.counters.evicted_blocks > 0
    assert [results[f"r{i}"] for i in range(len(chats))] == reference


def test_preemption_and_recompute(tmp_path, chats, reference, overlap):
    outputs, counters = run(tmp_path, chats, overlap, num_blocks=40, prefix_cache=False)
    assert counters.preemptions > 0 and counters.reprefill_tokens > 0
    assert outputs == reference


def test_one_at_a_time_equals_batched(tmp_path, chats, reference, overlap):
    # Batched, the same config is test_prefix_cache_on_equals_off's run: both equal the reference.
    outputs, counters = run(tmp_path, chats[:ONE_AT_A_TIME], overlap, max_num_seqs=1)
    assert counters.hit_blocks > 0  # a later chat reuses what an earlier one left
    assert outputs == reference[:ONE_AT_A_TIME]


def test_the_model_stays_usable_by_transformers(smollm2, chats, reference, tmp_path):
    run(tmp_path, chats[:2])  # an engine on the shared model
    assert helpers.hf_generate(smollm2[0], chats[:2], MAX_TOKENS) == reference[:2]
