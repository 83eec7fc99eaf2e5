"""Per-step ``schedule()`` time: sagellm's scheduler against stock vLLM on the
same state, 256 running requests decoding and 1,024 waiting.

    VLLM_TARGET_DEVICE=cpu python plugins/sagellm-plugin-vllm/benchmarks/schedule_overhead.py  # 500 steps

Both schedulers are built alike (16-token blocks, 40,000 blocks, 256
sequences), filled with the same requests and brought to the same state; the
steps then alternate between them, so drift on a noisy machine hits both.
Only ``schedule()`` is timed, not the made-up model output, and with the
cyclic GC paused (collected every 50 rounds, outside the timer).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tomllib

from sagellm_plugin_vllm import compat as v
from sagellm_plugin_vllm.engine import build_scheduler, made_up_output
from sagellm_plugin_vllm.live import ENGINE_OWNS

from sagellm_core import config as config_mod
from sagellm_core.runtime import Runtime

BLOCK_SIZE = 16
NUM_BLOCKS = 40_000
RUNNING, WAITING = 256, 1024

CONFIG = """
[kv_pool]
num_blocks = {num_blocks}
[prefix_cache]
block_size = {block_size}
[eviction]
plugin = "lru"
[scheduler]
passes = [{passes}]
[report]
hook_timing = false
"""


def runtime(passes: str) -> Runtime:
    settings = config_mod.parse(
        tomllib.loads(CONFIG.format(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, passes=passes)), "<benchmark>"
    )
    return Runtime(settings, engine_owns=ENGINE_OWNS)


def requests(hasher, prefix: str, n: int, prompt_tokens: int) -> list:
    out = []
    for i in range(n):
        # Distinct prompts sharing a 64-token system prefix.
        prompt = [1] * 64 + [1000 + i] * (prompt_tokens - 64)
        out.append(
            v.VllmRequest(
                request_id=f"{prefix}{i}",
                prompt_token_ids=prompt,
                sampling_params=v.SamplingParams(max_tokens=100_000, ignore_eos=True),
                pooling_params=None,
                arrival_time=float(i),
                block_hasher=hasher,
            )
        )
    return out


def prepared(kind: str, passes: str):
    scheduler = build_scheduler(
        kind,
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        max_num_batched_tokens=8192,
        max_num_seqs=RUNNING,
        max_model_len=200_000,
        runtime=runtime(passes) if kind == "sagellm" else None,
    )
    v.init_none_hash(v.sha256)
    hasher = v.get_request_block_hasher(BLOCK_SIZE, v.sha256)
    for request in requests(hasher, "run", RUNNING, 256):
        scheduler.add_request(request)
    while len(scheduler.running) < RUNNING or any(r.is_prefill_chunk for r in scheduler.running):
        out = scheduler.schedule()
        scheduler.update_from_output(out, made_up_output(scheduler, out))
    for request in requests(hasher, "wait", WAITING, 512):
        scheduler.add_request(request)
    return scheduler


def step(scheduler) -> float:
    start = time.perf_counter()
    out = scheduler.schedule()
    elapsed = time.perf_counter() - start
    scheduler.update_from_output(out, made_up_output(scheduler, out))
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    variants = {
        "stock vLLM": prepared("stock", ""),
        # The adapter's fixed cost: states mapped and refreshed, no pass.
        "sagellm, no pass": prepared("sagellm", ""),
        "sagellm, fcfs pass": prepared("sagellm", '"fcfs"'),
        "sagellm, prefix-aware pass": prepared("sagellm", '"prefix-aware"'),
    }
    for scheduler in variants.values():
        assert len(scheduler.running) == RUNNING and len(scheduler.waiting) == WAITING
    times: dict[str, list[float]] = {name: [] for name in variants}
    # As timeit does: no cyclic GC inside the timed region (a collection
    # walks every object of all three schedulers and lands on whichever step
    # happens to allocate last); collected between rounds instead.
    gc.collect()
    gc.disable()
    try:
        for round_ in range(args.steps):
            for name, scheduler in variants.items():
                times[name].append(step(scheduler))
            if round_ % 50 == 49:
                gc.collect()
    finally:
        gc.enable()
    base = statistics.median(times["stock vLLM"])
    print(
        f"schedule() per step, {RUNNING} running (decode) + {WAITING} waiting,"
        f" {args.steps} steps each, vLLM {v.VLLM_VERSION}"
    )
    print(f"{'scheduler':<28} {'p50 (ms)':>9} {'p90 (ms)':>9} {'ratio p50':>10}")
    for name, samples in times.items():
        p50 = statistics.median(samples)
        p90 = statistics.quantiles(samples, n=10)[-1]
        print(f"{name:<28} {p50 * 1e3:>9.3f} {p90 * 1e3:>9.3f} {p50 / base:>9.2f}x")


if __name__ == "__main__":
    main()
