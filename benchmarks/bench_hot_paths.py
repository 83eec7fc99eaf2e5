"""Hot-path latencies, each with a baseline run in the same process.

    .venv/bin/python benchmarks/bench_hot_paths.py

* a hook call's cost: through pluggy's plugin manager, and through
  sagellm's dispatch (the call the runtime makes, from a cached plan), with
  and without the hook timer, against calling the same plugin method
  directly;
* prefix match of a 2,000-token prompt (16-token blocks) in a radix tree of
  100,000 cached blocks, and the share of it spent building page keys;
* choosing 64 victims among 100,000 evictable blocks: LRU, LFU, the
  predictive, continuation-aware, cost-aware, SLO-aware and dead-block
  (hawkeye, revisit: each with none and about half predicted dead) policies,
  and the
  adaptive policy led by each of its experts (it answers with the leader's
  choice).
* a block's content key for a 4 KB page: ``chain_key`` (SHA-256) against
  the BLAKE2b chain it replaced;
* an engine's prompt of 2,048 ids as a list, into a token array:
  ``array()`` element by element against ``as_token_array``.
Prints p50 per call and the ratios.
"""

from __future__ import annotations

import hashlib
import inspect
import random
import statistics
import time
from array import array

import pluggy
from rich.console import Console
from rich.table import Table
from sagellm_plugin_eviction.adaptive import AdaptiveEviction, AdaptiveSettings
from sagellm_plugin_eviction.continuation import ContinuationEviction, ContinuationSettings
from sagellm_plugin_eviction.cost import CostAwareEviction, CostSettings
from sagellm_plugin_eviction.hawkeye import HawkeyeEviction, HawkeyeSettings
from sagellm_plugin_eviction.lfu import LFUEviction
from sagellm_plugin_eviction.lru import LRUEviction
from sagellm_plugin_eviction.predictive import PredictiveEviction, PredictiveSettings
from sagellm_plugin_eviction.revisit import RevisitEviction, RevisitSettings
from sagellm_plugin_eviction.slo import SLOEviction
from sagellm_plugin_prefix_cache.radix import RadixPrefixCache, RadixSettings

from sagellm_core import PluginContext, hookspecs
from sagellm_core.dispatch import Dispatch, PluginManager
from sagellm_core.kit.testing import BlockIds, serve_prompt
from sagellm_core.timing import HookTimer
from sagellm_core.types import CachedBlock, PrefixMatch, Request, as_token_array, chain_key

BS = 16
NUM_BLOCKS = 100_000


def p50_us(fn, repeat=2000, number=1):
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples) * 1e6


def build_cache():
    """100k cached blocks: 250 prompts of 6,400 tokens sharing a 1,024-token head."""
    ctx = PluginContext("radix", BS, NUM_BLOCKS + 1000)
    cache = RadixPrefixCache(RadixSettings(), ctx)
    rng = random.Random(0)
    head = [rng.randrange(32000) for _ in range(1024)]
    block_ids = BlockIds()
    prompts = []
    while block_ids.next < NUM_BLOCKS - 400:
        tokens = head + [rng.randrange(32000) for _ in range(6400 - 1024)]
        serve_prompt(cache, Request(f"r{block_ids.next}", tokens, 1), BS, block_ids)
        prompts.append(tokens)
    return cache, prompts


def managers(plugin: object) -> tuple[pluggy.PluginManager, Dispatch, Dispatch]:
    """``plugin`` registered, and the two dispatches (untimed, timed) over it."""
    pm = PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(plugin)
    return pm, Dispatch(pm), Dispatch(pm, HookTimer())


def deep_half_dead(policy: HawkeyeEviction) -> HawkeyeEviction:
    """Trained as OPTgen would after seeing the last 32 blocks of 64-block
    releases never come back: half the blocks below are then predicted dead,
    and a choice merges the two queues."""
    for from_end in range(32):
        signature = policy.signature(CachedBlock(0, 63 - from_end, None, key=0), from_end, 64)
        for _ in range(policy.settings.memory):
            policy._train(signature, False)
    return policy


def revisit_released(ctx: PluginContext, blocks: tuple[CachedBlock, ...], half_dead: bool) -> RevisitEviction:
    """``revisit`` with the blocks released in 64-block chains by one
    session's requests; with ``half_dead``, trained before each release as
    if the deeper half of the chain never came back and the rest did (its
    weights then call the deeper half dead, and a choice merges queues)."""
    policy = RevisitEviction(RevisitSettings(), ctx)
    policy.sagellm_blocks_cached(blocks=blocks)
    request = Request("turn", [0] * 64, 1, session_id="session")
    for i in range(0, len(blocks), 64):
        chain = blocks[i : i + 64]
        if half_dead:
            signatures = policy.signatures(chain, request)
            for live, half in ((True, signatures[:32]), (False, signatures[32:])):
                for signature in half:
                    for _ in range(200):
                        policy._train(signature, live)
        policy.sagellm_blocks_released(blocks=chain, now_s=0.0, request=request)
    return policy


def main() -> None:
    rows = []
    cache, prompts = build_cache()
    probe = Request("probe", prompts[7][:2000], 1)
    match = cache.sagellm_lookup_prefix(request=probe)
    assert match.num_blocks == 124, match.num_blocks  # (2000 - 1) // 16

    direct = p50_us(lambda: cache.sagellm_lookup_prefix(request=probe))
    keys = p50_us(lambda: probe.prompt_token_ids[: 124 * BS].tobytes())
    pm, dispatch, timed_dispatch = managers(cache)
    hooked = p50_us(lambda: pm.hook.sagellm_lookup_prefix(request=probe))
    planned = p50_us(lambda: dispatch.call("sagellm_lookup_prefix", {"request": probe}))
    timed = p50_us(lambda: timed_dispatch.call("sagellm_lookup_prefix", {"request": probe}))
    rows += [
        ("prefix match, 2,000 tokens, 100k blocks: direct call", direct, 1.0),
        ("  of which copying the 124 pages to bytes", keys, keys / direct),
        ("  through pluggy", hooked, hooked / direct),
        ("  through sagellm's dispatch", planned, planned / direct),
        ("  through sagellm's dispatch + hook timer", timed, timed / direct),
    ]

    ctx = PluginContext("p", BS, NUM_BLOCKS)
    blocks = tuple(CachedBlock(i, i % 64, None, key=i) for i in range(NUM_BLOCKS))
    every_block = set(range(NUM_BLOCKS))
    results = {}
    policies = (
        ("LRU", LRUEviction(None, ctx)),
        ("LFU", LFUEviction(None, ctx)),
        ("predictive (512 samples)", PredictiveEviction(PredictiveSettings(), ctx)),
        ("continuation-aware, 1,563 turns of 64 blocks", ContinuationEviction(ContinuationSettings(), ctx)),
        ("cost-aware (GDSF)", CostAwareEviction(CostSettings(), ctx)),
        ("SLO-aware, the 10k least recent protected", SLOEviction(None, ctx)),
        ("hawkeye, none predicted dead yet", HawkeyeEviction(HawkeyeSettings(), ctx)),
        ("hawkeye, about half predicted dead (deep blocks)", deep_half_dead(HawkeyeEviction(HawkeyeSettings(), ctx))),
        ("revisit, none predicted dead", revisit_released(ctx, blocks, half_dead=False)),
        ("revisit, about half predicted dead (deep blocks)", revisit_released(ctx, blocks, half_dead=True)),
    )
    for name, policy in policies:
        # as pluggy does, pass ``now_s`` only to the policies that take it
        def timed(hook, policy=policy):
            return {"now_s": 0.0} if "now_s" in inspect.signature(getattr(policy, hook)).parameters else {}

        if not isinstance(policy, RevisitEviction):  # (released by its own requests above)
            if hasattr(policy, "sagellm_blocks_cached"):
                policy.sagellm_blocks_cached(blocks=blocks, **timed("sagellm_blocks_cached"))
            for i in range(0, NUM_BLOCKS, 64):
                policy.sagellm_blocks_released(blocks=blocks[i : i + 64], **timed("sagellm_blocks_released"))
        if isinstance(policy, SLOEviction):
            # a waiting request, its deadline ahead, whose prefix is LRU's first 10k victims
            waiting = Request("waiting", [0], 1, deadline_s=60.0)
            policy.sagellm_request_arrived(request=waiting, prediction=None, match=PrefixMatch(blocks[:10_000]))
        if "about half predicted dead" in name:  # the row's label says half
            assert 0.45 * NUM_BLOCKS <= policy.predicted_dead <= 0.55 * NUM_BLOCKS, (name, policy.predicted_dead)
        if "none predicted dead" in name:
            assert policy.predicted_dead == 0, (name, policy.predicted_dead)
        # the row's label says 64 victims: a choice that names fewer is not that row
        assert len(policy.sagellm_select_victims(num_blocks=64, candidates=every_block).victim_ids) == 64, name
        results[name] = p50_us(
            lambda p=policy: p.sagellm_select_victims(num_blocks=64, candidates=every_block), repeat=3000
        )
    adaptive = AdaptiveEviction(AdaptiveSettings(), ctx)
    adaptive.sagellm_blocks_cached(blocks=blocks, now_s=0.0)
    for i in range(0, NUM_BLOCKS, 64):
        adaptive.sagellm_blocks_released(blocks=blocks[i : i + 64], now_s=0.0, request=None)
    for leader, expert in enumerate(adaptive.experts):
        adaptive.leader = leader
        assert len(adaptive.sagellm_select_victims(num_blocks=64, candidates=every_block).victim_ids) == 64
        results[f"adaptive, leading: {expert.name}"] = p50_us(
            lambda: adaptive.sagellm_select_victims(num_blocks=64, candidates=every_block), repeat=3000
        )
    rows += [(f"select 64 victims of 100k evictable: {name}", us, us / results["LRU"]) for name, us in results.items()]

    class Nothing:
        @hookspecs.hookimpl
        def sagellm_pool_usage(self):
            return 1

    plugin = Nothing()
    empty, bare_dispatch, bare_timed_dispatch = managers(plugin)
    bare_direct = p50_us(lambda: plugin.sagellm_pool_usage(), number=100)
    bare_hook = p50_us(lambda: empty.hook.sagellm_pool_usage(), number=100)
    bare_planned = p50_us(lambda: bare_dispatch.call("sagellm_pool_usage", {}), number=100)
    bare_timed = p50_us(lambda: bare_timed_dispatch.call("sagellm_pool_usage", {}), number=100)
    rows += [
        ("trivial hook: direct method call", bare_direct, 1.0),
        ("trivial hook: through pluggy", bare_hook, bare_hook / bare_direct),
        ("trivial hook: through sagellm's dispatch", bare_planned, bare_planned / bare_direct),
        ("trivial hook: through sagellm's dispatch + hook timer", bare_timed, bare_timed / bare_direct),
    ]

    # The content key of one 512-token page (4 KB, a Mooncake block), as
    # chain_key computes it (SHA-256), against the BLAKE2b chain it replaced.
    page = random.Random(1).randbytes(512 * 8)

    def blake2b_key() -> int:
        digest = hashlib.blake2b(page, digest_size=8, key=(12345).to_bytes(8, "little"))
        return int.from_bytes(digest.digest(), "little")

    blake2b_us = p50_us(blake2b_key, number=100)
    sha256_us = p50_us(lambda: chain_key(12345, page), number=100)
    rows += [
        ("content key of a 4 KB page: BLAKE2b chain (the earlier key)", blake2b_us, 1.0),
        ("  chain_key (SHA-256)", sha256_us, sha256_us / blake2b_us),
    ]

    # An engine's prompt as a list of 2,048 ids (vLLM's, a tokenizer's) into
    # a token array: array()'s per-item path, and as_token_array (one pack).
    prompt_ids = [random.Random(2).randrange(152_000) for _ in range(2048)]
    assert as_token_array(prompt_ids) == array("q", prompt_ids)
    per_item_us = p50_us(lambda: array("q", prompt_ids), number=20)
    packed_us = p50_us(lambda: as_token_array(prompt_ids), number=20)
    rows += [
        ("2,048 token ids from a list: array('q', ids)", per_item_us, 1.0),
        ("  as_token_array (one struct pack)", packed_us, packed_us / per_item_us),
    ]

    table = Table(title="sagellm hot paths (p50 per call)")
    table.add_column("measurement")
    table.add_column("p50 µs", justify="right")
    table.add_column("ratio to the row's baseline", justify="right")
    for name, us, ratio in rows:
        table.add_row(name, f"{us:.2f}", f"{ratio:.2f}x")
    Console(width=110).print(table)


if __name__ == "__main__":
    main()
