"""SagellmConnector end to end on the CPU: vLLM's real scheduler with the
scheduler-side connector, a worker-side connector over real (small) KV
tensors, and sagellm's local transport reporting the copies."""

from __future__ import annotations

import torch
from sagellm_plugin_vllm import compat as v
from sagellm_plugin_vllm.connector import SagellmConnector, register
from sagellm_plugin_vllm.engine import build_scheduler, made_up_output
from sagellm_plugin_vllm.live import ENGINE_OWNS

from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.runtime import Runtime

BS = 16
POOL = 8  # usable device blocks
HOST = 32


def prompt(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def step(scheduler, worker, cache):
    """One engine step: the worker runs the connector's saves and loads, the
    "model" writes each computed token's id into its KV slot, outputs go back."""
    out = scheduler.schedule()
    worker.bind_connector_metadata(out.kv_connector_metadata)
    worker.start_load_kv(None)
    for req_id, n in out.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        blocks = scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        end = request.num_computed_tokens  # schedule() already advanced it
        for pos in range(end - n, end):
            cache[blocks[pos // BS], pos % BS] = request.all_token_ids[pos]
    sent, _ = worker.get_finished(set())
    worker.clear_connector_metadata()
    output = v.KVConnectorOutput(finished_sending=sent or set())
    return out, scheduler.update_from_output(out, made_up_output(scheduler, out, output))


def serve(scheduler, worker, cache, request, hasher):
    scheduler.add_request(request)
    stats = []
    while request.request_id in scheduler.requests:
        _, outputs = step(scheduler, worker, cache)
        for client in outputs.values():
            if client.scheduler_stats and client.scheduler_stats.connector_prefix_cache_stats:
                stats.append(client.scheduler_stats.connector_prefix_cache_stats)
    return stats


def test_evicted_prefix_comes_back_from_the_host_tier():
    text = (
        f'[kv_pool]\nnum_blocks = {POOL}\n[eviction]\nplugin = "lru"\n'
        f'[transport]\nplugin = "local"\nhost_blocks = {HOST}\nbytes_per_block = 64\n[report]\nhook_timing = false\n'
    )
    rt = Runtime(settings_from_toml(text), engine_owns=ENGINE_OWNS)
    scheduler = build_scheduler(
        "sagellm",
        block_size=BS,
        num_blocks=POOL,
        max_num_batched_tokens=512,
        max_num_seqs=4,
        max_model_len=1024,
        runtime=rt,
        host_blocks=HOST,
    )
    assert isinstance(scheduler.connector, SagellmConnector) and scheduler.connector.runtime is rt
    worker = SagellmConnector(scheduler.vllm_config, v.KVConnectorRole.WORKER, scheduler.kv_cache_config)
    cache = torch.zeros((POOL + 1, BS, 1), dtype=torch.float32)
    worker.register_kv_caches({"layer": cache})

    v.init_none_hash(v.sha256)
    hasher = v.get_request_block_hasher(BS, v.sha256)

    def request(rid, tokens):
        return v.VllmRequest(
            request_id=rid,
            prompt_token_ids=tokens,
            sampling_params=v.SamplingParams(max_tokens=1, ignore_eos=True),
            pooling_params=None,
            arrival_time=0.0,
            block_hasher=hasher,
        )

    a = prompt(1000, 100)  # 6 full blocks and a partial one
    serve(scheduler, worker, cache, request("A", a), hasher)
    assert len(scheduler.connector.host) == 6  # A's full blocks were offloaded
    assert rt.counters.transferred_blocks == 6

    serve(scheduler, worker, cache, request("B", prompt(5000, 120)), hasher)  # fills the pool: A is evicted
    assert rt.counters.evicted_blocks >= 6

    cache[1:] = -1  # nothing of A is left on the device
    stats = serve(scheduler, worker, cache, request("C", a), hasher)
    # vLLM counts 96 tokens (6 blocks) as hits from the host tier.
    assert sum(s.hits for s in stats) == 96
    assert any(s.hits_by_source.get(v.CacheHitSource.HOST) == 96 for s in stats)
    # Those blocks hold A's KV again: loaded back, not recomputed.
    restored = {tuple(cache[b, :, 0].tolist()) for b in range(1, POOL + 1)}
    for i in range(6):
        assert tuple(float(t) for t in a[i * BS : (i + 1) * BS]) in restored


def test_register_makes_the_name_known():
    register()
    register()  # every vLLM process calls it; a second call is harmless
    assert v.KVConnectorFactory.get_connector_class_by_name("SagellmConnector") is SagellmConnector
