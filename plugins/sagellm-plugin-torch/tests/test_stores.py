"""The torch engine with KV stores below its pool (a tiny random Llama, CPU,
fp32): greedy outputs token-identical to a pool large enough to keep
everything, when evicted blocks come back from host memory, from a local
disk, and from the disk after a restart (a new engine, a new runtime, the
same folder). Each run asserts that blocks did come back from the store.
And the engine loads from a store only where its measured load is faster
than recomputing: a store whose reads are slowed is recomputed instead,
with the same tokens."""

import random
import time

import attrs
import pytest
import torch
from sagellm_plugin_torch import testing as helpers

MAX_TOKENS = 6


def stores(*tiers: str, path=None) -> str:
    text = f"[kv_stores]\ntiers = {list(tiers)}\n".replace("'", '"')
    return text + (f'[kv_stores.disk]\npath = "{path}"\n' if path else "")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    shared = [rng.randrange(5, 120) for _ in range(40)]  # a system prompt of ten blocks
    chats = [shared + [rng.randrange(5, 120) for _ in range(rng.randrange(3, 30))] for _ in range(8)]
    return chats + chats  # each asked again once the pool has evicted it


def run(folder, model_dir, prompts, extra="", num_blocks=24):
    folder.mkdir(exist_ok=True)
    core = helpers.engine_core(
        helpers.write_config(
            folder, model=str(model_dir), num_blocks=num_blocks, block_size=4, max_num_seqs=2, extra=extra
        )
    )
    results = core.generate(helpers.requests(prompts, MAX_TOKENS))
    core.rt.check_invariants()
    return [results[f"r{i}"] for i in range(len(prompts))], core.rt


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir, prompts):
    outputs, rt = run(tmp_path_factory.mktemp("big"), tiny_model_dir, prompts, num_blocks=512)
    assert rt.counters.evicted_blocks == 0
    return outputs


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_blocks_back_from_a_store_give_the_same_tokens(tmp_path, tiny_model_dir, prompts, reference, tier):
    outputs, rt = run(tmp_path, tiny_model_dir, prompts, stores(tier, path=tmp_path / "kv" if tier == "disk" else None))
    report = rt.stores.report()[tier]
    assert rt.counters.evicted_blocks > 0 and report["loaded_blocks"] == rt.counters.host_hit_blocks > 0
    assert report["corrupt_blocks"] == 0
    assert outputs == reference


def test_a_restarted_engine_reloads_the_disk_and_gives_the_same_tokens(tmp_path, tiny_model_dir, prompts, reference):
    first, rt = run(tmp_path / "first", tiny_model_dir, prompts, stores("disk", path=tmp_path / "kv"))
    rt.reset_prefix_cache()  # what the device still caches goes to the disk too (the shared prompt)
    written = rt.stores.report()["disk"]["written_blocks"]
    assert written > 0 and first == reference
    # A new engine on the same folder: the first request already finds its prefix on disk.
    again, rt = run(tmp_path / "again", tiny_model_dir, prompts[:1], stores("disk", path=tmp_path / "kv"))
    report = rt.stores.report()["disk"]
    assert report["store"]["recovered"] > 0 and report["loaded_blocks"] == rt.counters.host_hit_blocks > 0
    assert again == reference[:1]


class SlowReads:
    """A real store whose every read waits ``delay_s`` first: a store behind
    a slow link (the engine measures it as it measures any store)."""

    def __init__(self, store, delay_s: float):
        self.store, self.delay_s = store, delay_s

    def __getattr__(self, name):
        return getattr(self.store, name)

    def get(self, keys):
        time.sleep(self.delay_s)
        return self.store.get(keys)


@pytest.fixture
def one_thread():
    """torch on one thread for the test: steps on this shared machine stall
    less, so the measured recompute cost is steadier (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def measured_run(folder, model_dir, prompts, delay_s=None):
    """The prompts through an engine with a host store (its reads slowed by
    ``delay_s`` where given) that decides load or recompute from its costs."""
    folder.mkdir(exist_ok=True)
    core = helpers.engine_core(
        helpers.write_config(
            folder, model=str(model_dir), num_blocks=24, block_size=4, max_num_seqs=2, extra=stores("host")
        )
    )
    assert core.rt.stores.costs is core.costs is not None
    if delay_s is not None:
        tiers = core.rt.host.plugins["kv_stores"]
        tiers[0] = attrs.evolve(tiers[0], instance=SlowReads(tiers[0].instance, delay_s))
    results = core.generate(helpers.requests(prompts, MAX_TOKENS))
    core.rt.check_invariants()
    return [results[f"r{i}"] for i in range(len(prompts))], core


def test_a_store_slower_than_recomputing_is_measured_once_then_recomputed(
    tmp_path, tiny_model_dir, prompts, reference, one_thread
):
    outputs, core = measured_run(tmp_path, tiny_model_dir, prompts, delay_s=1.0)
    report = core.rt.stores.report()["host"]
    # The first run found on the store is loaded (it is how the store is
    # measured: a second at least); every later one is recomputed.
    assert report["get_rounds"] == 1 and report["loaded_blocks"] == core.rt.counters.host_hit_blocks > 0
    assert report["recomputed_blocks"] > 0 and report["written_blocks"] > 0
    assert core.costs.load_s("host", 1) > core.costs.recompute_s(4 * 16, 0)
    assert outputs == reference


def test_a_store_faster_than_recomputing_is_loaded_from(tmp_path, tiny_model_dir, prompts, reference, one_thread):
    outputs, core = measured_run(tmp_path, tiny_model_dir, prompts)
    report = core.rt.stores.report()["host"]
    assert report["get_rounds"] > 1 and report["loaded_blocks"] == core.rt.counters.host_hit_blocks > 0
    assert report["recomputed_blocks"] == 0
    assert outputs == reference
