"""Prefix lookup, admission and eviction, sagellm against vLLM, in one process.

    VLLM_TARGET_DEVICE=cpu python plugins/sagellm-plugin-vllm/benchmarks/hot_paths_vs_vllm.py

The same 100,000 cached 16-token blocks everywhere: 250 prompts of 6,400
tokens sharing a 1,024-token head, each admitted and finished, so every full
block is cached and evictable. Then, p50 per call, each row's ratio against
the first row of its group (measured in this process):

* prefix lookup of a 2,000-token prompt that hits 124 blocks: sagellm's radix
  tree (``sagellm_lookup_prefix``), and vLLM 0.33's
  ``KVCacheManager.get_computed_blocks`` (``find_longest_cache_hit`` over the
  request's block hashes, which vLLM computes once when the request is made);
  warm (the same probe every call) and cold (a different prompt each call,
  the CPU caches flushed before it by copying 64 MB, outside the timer);
* vLLM hashing the probe's 125 blocks (sha256, once per request), the
  ``Request`` built outside the timer;
* ``Scheduler.add_request`` of a cached 2,048-token prompt (127 blocks hit):
  stock vLLM, and the sagellm scheduler (LRU), given a ``Request`` as vLLM's
  engine core builds it (token ids in a list, copied into sagellm's array),
  or with the sagellm request (its prompt's token array, tenant and hints)
  handed over, as sagellm's vLLM engine driver does; and with a plugin that
  observes arrivals (doing nothing with them), so the match's blocks are
  collected for it (with LRU alone nobody reads them and only the match's
  length is taken; both checked);
* 64 blocks from 100k cached: sagellm's LRU ``sagellm_select_victims`` alone,
  and ``BlockPool.get_new_blocks(64)`` when every free block is cached, so
  each call evicts: stock vLLM, and vLLM with the sagellm LRU, ARC and
  continuation policies choosing the victims. The blocks taken are held (a
  freed evicted block would go back to the head of the free queue, uncached,
  and the next call would take it without evicting), and uncached free blocks
  (sagellm evicts a victim's descendants beyond the 64 and keeps them free)
  are taken out before each call, outside the timer. Each call is checked to
  have evicted 64 cached blocks at least: the benchmark fails otherwise.
  The four pools are filled alike and their calls take turns.

With ``--breakdown``, the sagellm rows of ``add_request`` (sagellm request
handed over) and of the evicting ``get_new_blocks(64)`` (LRU) are run again
with each of their parts timed (p50 per call, the timer around each part
adding about 0.1 µs): where the time over stock vLLM goes.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tomllib
from collections.abc import Callable
from itertools import count

from rich.console import Console
from rich.table import Table
from sagellm_plugin_eviction.lru import LRUEviction
from sagellm_plugin_prefix_cache.radix import RadixPrefixCache, RadixSettings
from sagellm_plugin_vllm import compat as v
from sagellm_plugin_vllm.engine import build_scheduler
from sagellm_plugin_vllm.live import ENGINE_OWNS

from sagellm_core import PluginContext, hookimpl
from sagellm_core import config as config_mod
from sagellm_core.kit.testing import BlockIds, serve_prompt
from sagellm_core.plugin_host import PluginHost
from sagellm_core.runtime import Runtime
from sagellm_core.types import Request, SequenceState

BS = 16
NUM_BLOCKS = 100_000
PROMPT, HEAD = 6400, 1024
PROBE_TOKENS = 2000
ADD_TOKENS = 2048
TAKE = 64
EVICTION_POLICIES = ("lru", "arc", "continuation")
#: Request ids, unique across a scheduler's add_request rows.
REQUEST_NUMBERS = count()
#: Copied before each cold call: twice the last-level cache here (32 MiB).
FLUSH = bytearray(64 << 20)

CONFIG = """
[kv_pool]
num_blocks = {num_blocks}
[prefix_cache]
block_size = {block_size}
[eviction]
plugin = "{policy}"
[report]
hook_timing = false
"""


def p50_us(
    fn: Callable[[], object],
    repeat: int = 2000,
    setup: Callable[[], object] | None = None,
    check: Callable[[], object] | None = None,
) -> float:
    """Median time of ``fn``; ``setup`` runs before and ``check`` after each
    call, both outside the timer. No cyclic GC inside the timed region."""
    samples = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeat):
            if setup:
                setup()
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
            if check:
                check()
    finally:
        gc.enable()
    return statistics.median(samples) * 1e6


def flush_cpu_caches() -> None:
    bytes(FLUSH)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    head = [rng.randrange(32000) for _ in range(HEAD)]
    count = (NUM_BLOCKS - HEAD // BS) // ((PROMPT - HEAD) // BS)
    return [head + [rng.randrange(32000) for _ in range(PROMPT - HEAD)] for _ in range(count)]


def vllm_request(request_id: str, tokens: list[int], hasher) -> v.VllmRequest:
    return v.VllmRequest(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=v.SamplingParams(max_tokens=1),
        pooling_params=None,
        arrival_time=0.0,
        block_hasher=hasher,
    )


class ArrivalObserver:
    """Observes arrivals and does nothing: what collecting a match's blocks
    for any plugin that reads them costs."""

    @hookimpl
    def sagellm_request_arrived(self, match) -> None:
        pass


def sagellm_side(all_prompts):
    cache = RadixPrefixCache(RadixSettings(), PluginContext("radix", BS, NUM_BLOCKS + 1000))
    lru = LRUEviction(None, PluginContext("lru", BS, NUM_BLOCKS + 1000))
    block_ids = BlockIds()
    for i, tokens in enumerate(all_prompts):
        lru.sagellm_blocks_released(blocks=serve_prompt(cache, Request(f"r{i}", tokens, 1), BS, block_ids), now_s=0.0)
    return cache, lru


def sagellm_runtime(policy: str) -> Runtime:
    text = CONFIG.format(num_blocks=NUM_BLOCKS + 1000, block_size=BS, policy=policy)
    return Runtime(config_mod.parse(tomllib.loads(text), "<benchmark>"), engine_owns=ENGINE_OWNS)


def filled_scheduler(all_prompts, hasher, policy: str | None):
    """A scheduler (stock without ``policy``) whose pool caches every prompt."""
    scheduler = build_scheduler(
        "stock" if policy is None else "sagellm",
        block_size=BS,
        num_blocks=NUM_BLOCKS + 1000,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        max_model_len=PROMPT + 16,
        runtime=None if policy is None else sagellm_runtime(policy),
    )
    kv = scheduler.kv_cache_manager
    for i, tokens in enumerate(all_prompts):
        req = vllm_request(f"r{i}", tokens, hasher)
        blocks, num_computed, *_ = kv.get_computed_blocks(req)
        kv.allocate_slots(req, len(tokens) - num_computed, num_computed, blocks)
        req.num_computed_tokens = len(tokens)
        kv.free(req)
    return scheduler


def num_hashed(pool) -> int:
    """Hashes vLLM's table holds: one per cached block here (one KV-cache
    group, and no prompt caches a block twice), so a drop of k is k blocks
    evicted. (Not a walk over the blocks, which would flush the CPU caches
    between the timed calls.)"""
    return len(pool.cached_block_hash_to_block)


class EvictingTake:
    """``get_new_blocks(TAKE)`` on a pool whose free blocks are all cached,
    each call checked to have evicted ``TAKE`` cached blocks."""

    def __init__(self, scheduler):
        self.pool = scheduler.kv_cache_manager.block_pool
        self.held: list = []
        self.hashed = num_hashed(self.pool)
        self.samples: list[float] = []

    def take_uncached(self) -> None:
        # Uncached free blocks sit at the head and are reused before any
        # cached one: hold them, so the timed call has to evict.
        queue = self.pool.free_block_queue
        uncached = 0
        block = queue.fake_free_list_head.next_free_block
        while block is not queue.fake_free_list_tail and block.block_hash is None:
            uncached += 1
            block = block.next_free_block
        if uncached:
            self.held.extend(self.pool.get_new_blocks(uncached))
        self.hashed = num_hashed(self.pool)

    def timed_take(self) -> None:
        self.take_uncached()
        start = time.perf_counter()
        taken = self.pool.get_new_blocks(TAKE)
        self.samples.append(time.perf_counter() - start)
        self.held.extend(taken)
        evicted = self.hashed - num_hashed(self.pool)
        if evicted < TAKE:
            raise AssertionError(f"get_new_blocks({TAKE}) evicted {evicted} cached blocks, not {TAKE}")


def evicting_takes_us(schedulers: dict[str, object], repeat: int = 300) -> dict[str, float]:
    """p50 of an evicting ``get_new_blocks(TAKE)`` per scheduler, the calls
    taking turns (so drift on a noisy machine hits all alike), no cyclic GC
    inside the timed region."""
    takes = {name: EvictingTake(scheduler) for name, scheduler in schedulers.items()}
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeat):
            for take in takes.values():
                take.timed_take()
    finally:
        gc.enable()
    return {name: statistics.median(take.samples) * 1e6 for name, take in takes.items()}


def add_requests_us(variants: dict[str, tuple[object, Request | None]], tokens: list[int], hasher) -> dict[str, float]:
    """p50 of ``add_request`` for a cached prompt per (scheduler, sagellm
    request) variant, the calls taking turns; the ``Request`` (and its block
    hashes) built outside the timer. A sagellm request is handed over as
    sagellm's vLLM engine driver does."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    gc.collect()
    gc.disable()
    try:
        for _ in range(500):
            for name, (scheduler, origin) in variants.items():
                request = vllm_request(f"add{next(REQUEST_NUMBERS)}", tokens, hasher)
                if origin is not None:
                    request.sagellm_request = origin
                start = time.perf_counter()
                scheduler.add_request(request)
                samples[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    return {name: statistics.median(times) * 1e6 for name, times in samples.items()}


class PartTimer:
    """Times named functions while it is active: each replaced by a wrapper
    that appends its call's duration; put back on exit."""

    def __init__(self, parts: dict[str, tuple[object, str]]):
        self.parts = parts
        self.samples: dict[str, list[float]] = {name: [] for name in parts}

    def __enter__(self) -> PartTimer:
        self.saved = {name: getattr(owner, attr) for name, (owner, attr) in self.parts.items()}
        for name, (owner, attr) in self.parts.items():
            setattr(owner, attr, self._timed(name, self.saved[name]))
        return self

    def _timed(self, name: str, fn: Callable) -> Callable:
        samples = self.samples[name]

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                samples.append(time.perf_counter() - start)

        return timed

    def __exit__(self, *exc) -> None:
        for name, (owner, attr) in self.parts.items():
            setattr(owner, attr, self.saved[name])

    def rows(self) -> list[tuple[str, float]]:
        return [(f"  {name}", statistics.median(times) * 1e6) for name, times in self.samples.items() if times]


def breakdown(all_prompts, hasher, stock) -> list[tuple[str, float]]:
    """Where sagellm's time over stock vLLM goes, part by part."""
    from sagellm_plugin_vllm import block_pool, scheduler
    from sagellm_plugin_vllm.compat import Scheduler

    rows: list[tuple[str, float]] = []
    sagellm_lru = filled_scheduler(all_prompts, hasher, "lru")
    add_tokens = all_prompts[11][:ADD_TOKENS]
    origin = Request("a", add_tokens, 1)
    token_array = origin.prompt_token_ids
    parts = {
        "vLLM's own Scheduler.add_request": (Scheduler, "add_request"),
        "the match's length, read off the pool observer's hash index": (block_pool.PoolObserver, "match_length"),
        "building sagellm's Request": (scheduler, "sagellm_request"),
        "Runtime.arrive (all of it)": (Runtime, "arrive"),
        "  of which the lifetime prediction": (Runtime, "predict_lifetime"),
        "  of which the arrival observation": (PluginHost, "observe"),
    }
    with PartTimer(parts) as timer:
        total = add_requests_us(
            {"add_request, sagellm (lru), sagellm request handed over": (sagellm_lru, origin)}, add_tokens, hasher
        )
    rows += list(total.items()) + timer.rows()
    request = Request("s", token_array, 1)
    state_us = p50_us(lambda: SequenceState(request=request))
    rows.append(("  building a SequenceState (alone)", state_us))
    observer = block_pool.PoolObserver
    parts = {
        "the policy's choice through the runtime (select_victims)": (observer, "select_victims"),
        "adding descendants (with_descendants)": (observer, "with_descendants"),
        "forgetting the victims (evict_all)": (observer, "evict_all"),
        "reporting them to the policy (flush_evicted)": (observer, "flush_evicted"),
        "the free queue's popleft_n (all of sagellm's choice)": (block_pool.SagellmFreeBlockQueue, "popleft_n"),
    }
    with PartTimer(parts) as timer:
        total = evicting_takes_us({"get_new_blocks(64) evicting, stock": stock, "  sagellm lru": sagellm_lru})
    return rows + list(total.items()) + timer.rows()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--breakdown", action="store_true", help="also time the parts of the sagellm rows")
    args = parser.parse_args()
    all_prompts = prompts()
    probe_tokens = all_prompts[7][:PROBE_TOKENS]
    cache, lru = sagellm_side(all_prompts)
    v.init_none_hash(v.sha256)
    hasher = v.get_request_block_hasher(BS, v.sha256)
    stock = filled_scheduler(all_prompts, hasher, None)
    kv = stock.kv_cache_manager

    probe = Request("probe", probe_tokens, 1)
    assert cache.sagellm_lookup_prefix(request=probe).num_blocks == 124
    vprobe = vllm_request("probe", probe_tokens, hasher)
    _, hit_tokens, *_ = kv.get_computed_blocks(vprobe)
    assert hit_tokens == 124 * BS, hit_tokens
    rows: list[tuple[str, float, float]] = []

    def group(rows_us: list[tuple[str, float]]) -> None:
        base = rows_us[0][1]
        rows.extend((name, us, us / base) for name, us in rows_us)

    # Prefix lookup, warm and cold.
    ours = p50_us(lambda: cache.sagellm_lookup_prefix(request=probe))
    theirs = p50_us(lambda: kv.get_computed_blocks(vprobe))
    cold_prompts = [p[:PROBE_TOKENS] for p in all_prompts[:200]]
    cold_ours = [Request(f"c{i}", t, 1) for i, t in enumerate(cold_prompts)]
    cold_theirs = [vllm_request(f"c{i}", t, hasher) for i, t in enumerate(cold_prompts)]
    turn = iter(range(10**9))
    nth = [0]

    def next_cold() -> None:
        nth[0] = next(turn) % len(cold_prompts)
        flush_cpu_caches()

    cold_radix = p50_us(lambda: cache.sagellm_lookup_prefix(request=cold_ours[nth[0]]), repeat=200, setup=next_cold)
    cold_vllm = p50_us(lambda: kv.get_computed_blocks(cold_theirs[nth[0]]), repeat=200, setup=next_cold)
    unhashed: list = []
    hashing = p50_us(
        lambda: hasher(unhashed.pop()), repeat=300, setup=lambda: unhashed.append(vllm_request("h", probe_tokens, None))
    )
    group(
        [
            ("prefix lookup, 2,000 tokens, 124 blocks hit: sagellm radix", ours),
            ("  vLLM get_computed_blocks (hashes precomputed)", theirs),
            ("  vLLM: hashing the request's 125 blocks (sha256, Request built outside)", hashing),
        ]
    )
    group(
        [
            ("  cold (other prompt, CPU caches flushed): sagellm radix", cold_radix),
            ("  cold: vLLM get_computed_blocks", cold_vllm),
        ]
    )

    # add_request, before the eviction rows take the cached blocks away.
    add_tokens = all_prompts[11][:ADD_TOKENS]
    sagellm_lru = filled_scheduler(all_prompts, hasher, "lru")
    observed = filled_scheduler(all_prompts, hasher, "lru")
    observed.sagellm.host.pm.register(ArrivalObserver(), name="benchmark:arrivals")
    assert observed.sagellm.observes_arrivals and not sagellm_lru.sagellm.observes_arrivals
    add_request = add_requests_us(
        {
            "add_request, cached 2,048-token prompt: stock vLLM": (stock, None),
            "  sagellm scheduler (lru), token ids from vLLM's list": (sagellm_lru, None),
            "  sagellm scheduler (lru), sagellm request handed over (engine driver)": (
                sagellm_lru,
                Request("a", add_tokens, 1),
            ),
            "  sagellm scheduler (lru, an arrival observer), sagellm request handed over": (
                observed,
                Request("a", add_tokens, 1),
            ),
        },
        add_tokens,
        hasher,
    )
    group(list(add_request.items()))

    # Eviction.
    every = set(range(NUM_BLOCKS + 1000))
    victims = p50_us(lambda: lru.sagellm_select_victims(num_blocks=TAKE, candidates=every), repeat=3000)
    rows.append(("64 blocks from 100k cached: sagellm LRU select_victims alone", victims, 1.0))
    # Every pool filled alike, the calls taking turns.
    evicting = {"vLLM get_new_blocks(64), every call evicting: stock": stock}
    for policy in EVICTION_POLICIES:
        evicting[f"  sagellm {policy}"] = (
            sagellm_lru if policy == "lru" else filled_scheduler(all_prompts, hasher, policy)
        )
    group(list(evicting_takes_us(evicting).items()))

    if args.breakdown:
        rows.extend((f"breakdown: {name}", us, float("nan")) for name, us in breakdown(all_prompts, hasher, stock))

    table = Table(title=f"sagellm and vLLM {v.VLLM_VERSION} hot paths, one process (p50 per call)")
    for column, justify in (("measurement", "left"), ("p50 µs", "right"), ("ratio to group's first", "right")):
        table.add_column(column, justify=justify)
    for name, us, ratio in rows:
        table.add_row(name, f"{us:.2f}", "-" if ratio != ratio else f"{ratio:.2f}x")  # NaN: no ratio
    Console(width=130).print(table)


if __name__ == "__main__":
    main()
