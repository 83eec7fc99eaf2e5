"""The torch engine on SmolLM2-135M (CPU, fp32), each figure a ratio of two
runs in this one process:

1. TTFT with prefix caching against without: 64 requests sharing a
   1,000-token system prompt, all arriving at once (the engine batches them)
   and one at a time (each sent when the previous one finished).
2. Throughput (output tokens/s) against transformers' ``generate`` on the
   same 32 prompts, batched with left padding, and against transformers'
   continuous batching (``generate_batch``) where it runs; plus where the
   engine's step time goes.
3. A 2,000-token prefix evicted from the device: reloaded from the host
   tier against recomputed.

Each row asserts it did what its label says (hits, evictions, reloads).

    .venv/bin/python plugins/sagellm-plugin-torch/benchmarks/torch_engine.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from sagellm_plugin_torch import models
from sagellm_plugin_torch import testing as helpers
from sagellm_plugin_torch.engine import SamplingParams

from sagellm_core.types import Request

POLICY = (
    "Company support policy, section {i}: customers may return items within thirty days of delivery, "
    "provided the items are unused and in their original packaging. Refunds are issued to the original "
    "payment method within five business days. Exchanges are free of charge. "
)


def ttft_run(folder: Path, prompts: list[list[int]], cache: bool, concurrent: bool) -> dict:
    core = helpers.engine_core(
        helpers.write_config(folder, num_blocks=4400, prefix_cache=cache, max_num_seqs=64, max_num_batched_tokens=2048)
    )
    ttfts = []

    def drain() -> None:
        while core.has_work():
            ttfts.extend(out.outcome.ttft_s for out in core.step() if out.outcome is not None)

    start = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, 4), SamplingParams(max_tokens=4, ignore_eos=True))
        if not concurrent:
            drain()  # the next request is sent once this one finished
    drain()
    wall = time.perf_counter() - start
    c = core.rt.counters
    assert (c.hit_blocks > 0) == cache, "a caching row must hit, a non-caching row must not"
    return {"mean_ttft_s": sum(ttfts) / len(ttfts), "wall_s": wall, "hit_blocks": c.hit_blocks, "requests": len(ttfts)}


def throughput(folder: Path, model, tokenizer, prompts: list[list[int]], new_tokens: int) -> dict:
    rows = {}
    core = helpers.engine_core(
        helpers.write_config(folder, num_blocks=1024, max_num_seqs=64, max_num_batched_tokens=2048)
    )
    forward_s = 0.0
    inner = core.runner.forward

    def timed_forward(*args, **kwargs):
        nonlocal forward_s
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            forward_s += time.perf_counter() - t

    core.runner.forward = timed_forward
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(Request(f"t{i}", p, new_tokens), SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
    wall = time.perf_counter() - start
    rows["sagellm torch engine"] = {
        "wall_s": wall,
        "tokens_per_s": len(prompts) * new_tokens / wall,
        "model_forward_share": forward_s / wall,
        "steps": steps,
    }

    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    wall = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens
    rows["transformers generate (batched, padded)"] = {"wall_s": wall, "tokens_per_s": len(prompts) * new_tokens / wall}

    try:
        from transformers import GenerationConfig

        config = GenerationConfig(
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=pad
        )
        start = time.perf_counter()
        # Not under inference_mode: generate_batch runs its own thread, which
        # may not write tensors created in inference mode.
        result = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        wall = time.perf_counter() - start
        generated = sum(len(r.generated_tokens) for r in result.values())
        if generated == 0:
            raise RuntimeError("generate_batch returned no tokens")
        rows["transformers continuous batching (generate_batch)"] = {"wall_s": wall, "tokens_per_s": generated / wall}
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        rows["transformers continuous batching (generate_batch)"] = {
            "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        }
    return rows


def reload_run(folder: Path, prefix: list[int], filler: list[int], offload: bool) -> dict:
    # 140 blocks: the 2,000-token prefix (125 blocks) fits, and the filler
    # request that follows must evict it.
    core = helpers.engine_core(
        helpers.write_config(
            folder, num_blocks=140, offload=offload, host_blocks=256, max_num_seqs=4, max_num_batched_tokens=4096
        )
    )

    def serve(rid: str, prompt: list[int]) -> float:
        core.add_request(Request(rid, prompt, 1), SamplingParams(max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        while core.has_work():
            core.step()
        return time.perf_counter() - start

    serve("first", prefix + [11, 12, 13])
    serve("filler", filler)
    c = core.rt.counters
    evicted = c.evicted_blocks
    assert evicted >= 100, "the filler was meant to evict the prefix"
    hits_before, device_before = c.host_hit_blocks, c.hit_blocks
    ttft = serve("again", prefix + [21, 22, 23])
    reloaded, device_hits = c.host_hit_blocks - hits_before, c.hit_blocks - device_before
    # LRU evicts the prefix from its tail: its head may still be on the device.
    if offload:
        assert reloaded >= 100, f"the prefix was meant to come back from the host tier ({reloaded} blocks)"
    else:
        assert reloaded == 0
    return {
        "ttft_s": ttft,
        "evicted_blocks": evicted,
        "host_blocks_loaded": reloaded,
        "device_hit_blocks": device_hits,
        "bytes_moved": sum(t.bytes_written + t.bytes_read for t in c.tiers.values()),
        "transfer_s": sum(t.seconds for t in c.tiers.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--parts", default="ttft,throughput,reload", help="comma-separated: ttft, throughput, reload")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    model, tokenizer = models.load("smollm2")
    folder = Path(tempfile.mkdtemp())
    results: dict = {"torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()}

    system = "".join(POLICY.format(i=i) for i in range(20))
    system_ids = tokenizer.encode(system)[:1000]
    questions = [tokenizer.encode(f" Question {i}: can I return item number {i * 7 + 3}?") for i in range(64)]
    prompts = [system_ids + q for q in questions]
    for concurrent in (True, False) if "ttft" in parts else ():
        key = "concurrent" if concurrent else "one_at_a_time"
        on = ttft_run(folder, prompts, True, concurrent)
        off = ttft_run(folder, prompts, False, concurrent)
        results[f"ttft_{key}"] = {
            "cache_on": on,
            "cache_off": off,
            "ratio_off_over_on": off["mean_ttft_s"] / on["mean_ttft_s"],
        }
        print(
            f"TTFT, 64 requests sharing {len(system_ids)} tokens, {key}: on {on['mean_ttft_s']:.3f} s,"
            f" off {off['mean_ttft_s']:.3f} s: {off['mean_ttft_s'] / on['mean_ttft_s']:.1f}x lower with caching"
        )

    if "throughput" in parts:
        chats = helpers.chat_prompts(tokenizer, 32)
        rows = throughput(folder, model, tokenizer, chats, 32)
        base = rows["sagellm torch engine"]["tokens_per_s"]
        for name, row in rows.items():
            if "error" in row:
                print(f"throughput {name}: did not run: {row['error']}")
            else:
                print(
                    f"throughput {name}: {row['tokens_per_s']:.1f} tok/s"
                    f" (sagellm {base / row['tokens_per_s']:.2f}x this)"
                )
        print(f"  engine step time in the model's forward: {rows['sagellm torch engine']['model_forward_share']:.1%}")
        results["throughput"] = rows
    if "reload" not in parts:
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return 0

    prefix = tokenizer.encode("".join(POLICY.format(i=i) for i in range(60)))[:2000]
    filler = [(t * 7 + 5) % 40000 + 100 for t in range(2100)]
    assert len(prefix) == 2000
    host = reload_run(folder, prefix, filler, True)
    recompute = reload_run(folder, prefix, filler, False)
    results["reload_2000"] = {"host_tier": host, "recompute": recompute, "ratio": recompute["ttft_s"] / host["ttft_s"]}
    print(
        f"2,000-token prefix ({host['device_hit_blocks']} blocks still on the device in both runs):"
        f" host reload {host['ttft_s']:.3f} s ({host['host_blocks_loaded']} blocks,"
        f" {host['transfer_s'] * 1e3:.1f} ms copying, both ways, all transfers), recompute {recompute['ttft_s']:.3f} s:"
        f" {recompute['ttft_s'] / host['ttft_s']:.1f}x faster"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
