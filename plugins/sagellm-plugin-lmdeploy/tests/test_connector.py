"""SagellmConnector end to end on the CPU: LMDeploy's real scheduler with the
scheduler-side connector (its load and save-lease protocol), a worker-side
connector over real (small) KV tensors, and sagellm's local transport
reporting the copies."""

from __future__ import annotations

import numpy as np
from sagellm_plugin_lmdeploy import compat as lm
from sagellm_plugin_lmdeploy.connector import SagellmConnector
from sagellm_plugin_lmdeploy.engine import logical_clock
from sagellm_plugin_lmdeploy.install import installed
from sagellm_plugin_lmdeploy.live import runtime_for

from sagellm_core.kit.testing import settings_from_toml

BS = 16
POOL = 8
HOST = 32


def step(scheduler, worker, cache, tag: float):
    """One engine step: schedule, connector metadata, the worker's loads, the
    "model" writing each computed token's id plus ``tag`` (which request
    computed it) into its KV slot, the worker's saves, and the workers'
    progress back to the scheduler."""
    out = scheduler.schedule(is_prefill=True, prealloc_size=0)
    running = list(out.running)
    meta = scheduler.build_connector_meta(running, tuple(seq.num_all_ids for seq in running))
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    for seq in running:
        table = scheduler.get_block_tables([seq])[0]
        for pos in range(seq.num_history_ids, seq.num_all_ids):
            cache[table[pos // BS], pos % BS] = float(seq.history_cache[pos]) + tag
    worker.start_save_kv()
    scheduler.update_connector_output(worker.get_finished())
    worker.clear_connector_metadata()
    return running


def serve(scheduler, worker, cache, number, tokens):
    """Serve one request; its computed KV is tagged with ``number * 1e6``."""
    seq = scheduler.add_session(number).add_sequence(
        np.asarray(tokens, dtype=np.int64), sampling_param=lm.SamplingParam(max_new_tokens=1)
    )
    for _ in range(10):
        running = step(scheduler, worker, cache, number * 1e6)
        if seq in running:
            break
    else:
        raise AssertionError("the request never ran")
    scheduler.activate_seqs(running)
    seq.update_token_ids(np.array([0]), mode=lm.UpdateTokenMode.PREFILL)
    seq.finish()
    scheduler.end_session(number)
    return seq


def test_evicted_prefix_comes_back_from_the_host_tier():
    text = (
        f'[kv_pool]\nnum_blocks = {POOL}\nplugin = "paged"\n[eviction]\nplugin = "lru"\n'
        f'[transport]\nplugin = "local"\nhost_blocks = {HOST}\nbytes_per_block = 64\n[report]\nhook_timing = false\n'
    )
    rt = runtime_for(settings_from_toml(text))
    cache_config = lm.CacheConfig(
        max_batches=1,
        block_size=BS,
        num_cpu_blocks=0,
        num_gpu_blocks=POOL,
        enable_prefix_caching=True,
        device_type="cpu",
        kv_transfer_config=lm.KVTransferConfig(
            kv_connector="SagellmConnector", kv_role="kv_both", kv_connector_extra_config={"host_blocks": HOST}
        ),
    )
    with installed(rt):
        connector = SagellmConnector(lm.KVConnectorRole.SCHEDULER, cache_config, runtime=rt)
        scheduler = lm.Scheduler(
            lm.SchedulerConfig(max_batches=1, max_session_len=4096, eviction_type="recompute"),
            cache_config,
            seq_meta=lm.SequenceMeta(BS, strategy=lm.ARSequenceStrategy()),
            kv_connector=connector,
        )
        logical_clock(scheduler.block_manager.allocator)
        worker = SagellmConnector(lm.KVConnectorRole.WORKER, cache_config)
        cache = lm.torch.zeros((POOL, BS, 1))
        worker.register_kv_caches({"layer": cache})

        a = list(range(1000, 1100))  # 6 full blocks and a partial one
        serve(scheduler, worker, cache, 0, a)
        assert len(connector.host) == 6 and rt.counters.transferred_blocks == 6
        serve(scheduler, worker, cache, 1, list(range(5000, 5120)))  # needs the whole pool: A is evicted
        assert rt.counters.evicted_blocks >= 6

        cache.fill_(-1)  # nothing of A is left on the device
        serve(scheduler, worker, cache, 2, a)
    assert rt.counters.transferred_blocks == 6 + 7 + 6  # A's and B's full blocks out, A's 6 back in
    restored = {tuple(cache[b, :, 0].tolist()) for b in range(POOL)}
    for i in range(6):
        # A's bytes (tag 0), loaded back from the host, not recomputed by C (tag 2e6).
        assert tuple(float(t) for t in a[i * BS : (i + 1) * BS]) in restored
    assert tuple(float(t) + 2e6 for t in a[96:100]) + (-1.0,) * 12 in restored  # C computed only its last 4 tokens
    assert not scheduler.kv_save_coordinator.has_pending()  # every save lease released


def test_install_teaches_lmdeploys_factory_the_connector():
    from lmdeploy.pytorch.engine import engine
    from lmdeploy.pytorch.engine.model_agent import agent

    cache_config = lm.CacheConfig(
        max_batches=1,
        block_size=BS,
        num_cpu_blocks=0,
        num_gpu_blocks=POOL,
        device_type="cpu",
        kv_transfer_config=lm.KVTransferConfig(kv_connector="SagellmConnector", kv_role="kv_both"),
    )
    rt = runtime_for(settings_from_toml(f"[kv_pool]\nnum_blocks = {POOL}\n"))
    with installed(rt):
        for module in (engine, agent):
            built = module.build_kv_connector(lm.KVConnectorRole.SCHEDULER, cache_config)
            assert isinstance(built, SagellmConnector) and built.runtime is rt
    assert engine.build_kv_connector is lm.build_kv_connector  # LMDeploy's own again
