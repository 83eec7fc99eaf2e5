"""Prefix lookup and victim selection, sagellm against vLLM, in one process.

    VLLM_TARGET_DEVICE=cpu python plugins/sagellm-plugin-vllm/benchmarks/hot_paths_vs_vllm.py

The same 100,000 cached 16-token blocks in both: 250 prompts of 6,400 tokens
sharing a 1,024-token head, each admitted and finished, so every full block
is cached and evictable. Then, p50 per call:

* prefix lookup of a 2,000-token prompt that hits 124 blocks: sagellm's
  radix tree (``sagellm_lookup_prefix``), and vLLM 0.33's
  ``KVCacheManager.get_computed_blocks`` (``find_longest_cache_hit`` over the
  request's block hashes, which vLLM computes once when the request is made;
  that hashing is timed on its own);
* 64 blocks taken from a pool whose free blocks are all cached: sagellm's
  LRU ``sagellm_select_victims``, and vLLM's ``BlockPool.get_new_blocks(64)``
  (pop from the free queue and evict from the hash table), the blocks then
  freed again outside the timer.
"""

from __future__ import annotations

import random
import statistics
import time

from rich.console import Console
from rich.table import Table
from sagellm_plugin_eviction.lru import LRUEviction
from sagellm_plugin_prefix_cache.radix import RadixPrefixCache, RadixSettings
from sagellm_plugin_vllm import compat as v
from sagellm_plugin_vllm.engine import build_scheduler

from sagellm_core import PluginContext
from sagellm_core.kit.testing import BlockIds, serve_prompt
from sagellm_core.types import Request

BS = 16
NUM_BLOCKS = 100_000
PROMPT, HEAD = 6400, 1024


def p50_us(fn, repeat=2000, setup=None) -> float:
    samples = []
    for _ in range(repeat):
        if setup:
            setup()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    head = [rng.randrange(32000) for _ in range(HEAD)]
    count = (NUM_BLOCKS - HEAD // BS) // ((PROMPT - HEAD) // BS)
    return [head + [rng.randrange(32000) for _ in range(PROMPT - HEAD)] for _ in range(count)]


def sagellm_side(all_prompts):
    cache = RadixPrefixCache(RadixSettings(), PluginContext("radix", BS, NUM_BLOCKS + 1000))
    lru = LRUEviction(None, PluginContext("lru", BS, NUM_BLOCKS + 1000))
    block_ids = BlockIds()
    for i, tokens in enumerate(all_prompts):
        lru.sagellm_blocks_released(blocks=serve_prompt(cache, Request(f"r{i}", tokens, 1), BS, block_ids), now_s=0.0)
    return cache, lru


def vllm_side(all_prompts):
    scheduler = build_scheduler(
        "stock",
        block_size=BS,
        num_blocks=NUM_BLOCKS + 1000,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        max_model_len=PROMPT + 16,
    )
    kv = scheduler.kv_cache_manager
    v.init_none_hash(v.sha256)
    hasher = v.get_request_block_hasher(BS, v.sha256)
    for i, tokens in enumerate(all_prompts):
        req = v.VllmRequest(
            request_id=f"r{i}",
            prompt_token_ids=tokens,
            sampling_params=v.SamplingParams(max_tokens=1),
            pooling_params=None,
            arrival_time=float(i),
            block_hasher=hasher,
        )
        blocks, num_computed, *_ = kv.get_computed_blocks(req)
        kv.allocate_slots(req, len(tokens) - num_computed, num_computed, blocks)
        req.num_computed_tokens = len(tokens)
        kv.free(req)
    return scheduler, hasher


def main() -> None:
    all_prompts = prompts()
    probe_tokens = all_prompts[7][:2000]
    cache, lru = sagellm_side(all_prompts)
    scheduler, hasher = vllm_side(all_prompts)
    kv, pool = scheduler.kv_cache_manager, scheduler.kv_cache_manager.block_pool

    probe = Request("probe", probe_tokens, 1)
    assert cache.sagellm_lookup_prefix(request=probe).num_blocks == 124
    vprobe = v.VllmRequest(
        request_id="probe",
        prompt_token_ids=probe_tokens,
        sampling_params=v.SamplingParams(max_tokens=1),
        pooling_params=None,
        arrival_time=0.0,
        block_hasher=hasher,
    )
    _, hit_tokens, *_ = kv.get_computed_blocks(vprobe)
    assert hit_tokens == 124 * BS, hit_tokens

    ours = p50_us(lambda: cache.sagellm_lookup_prefix(request=probe))
    theirs = p50_us(lambda: kv.get_computed_blocks(vprobe))
    hashing = p50_us(
        lambda: hasher(
            v.VllmRequest(
                request_id="h",
                prompt_token_ids=probe_tokens,
                sampling_params=v.SamplingParams(max_tokens=1),
                pooling_params=None,
                arrival_time=0.0,
                block_hasher=None,
            )
        ),
        repeat=300,
    )

    every = set(range(NUM_BLOCKS + 1000))
    victims = p50_us(lambda: lru.sagellm_select_victims(num_blocks=64, candidates=every), repeat=3000)
    taken: list = []
    take = p50_us(
        lambda: taken.extend(pool.get_new_blocks(64)),
        repeat=500,
        setup=lambda: (pool.free_blocks(taken), taken.clear()),
    )
    rows = [
        ("prefix lookup, 2,000 tokens, 124 blocks hit: sagellm radix", ours, 1.0),
        ("  vLLM get_computed_blocks (hashes precomputed)", theirs, theirs / ours),
        ("  vLLM: hashing the request's 125 blocks (sha256, once per request)", hashing, hashing / ours),
        ("64 blocks from 100k cached: sagellm LRU select_victims", victims, 1.0),
        ("  vLLM BlockPool.get_new_blocks(64), evicting", take, take / victims),
    ]
    table = Table(title="sagellm and vLLM 0.33 hot paths, one process (p50 per call)")
    for column, justify in (("measurement", "left"), ("p50 µs", "right"), ("ratio to sagellm", "right")):
        table.add_column(column, justify=justify)
    for name, us, ratio in rows:
        table.add_row(name, f"{us:.2f}", f"{ratio:.2f}x")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
