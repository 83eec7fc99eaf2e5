"""The torch engine on a CUDA GPU, each figure a ratio against a baseline
measured in this same run:

1. decode-step latency at batch 1, 64 and 256 (prompts of 512 tokens, the
   steps timed while contexts grow from 512 to 768) against the
   memory-bandwidth limit: the bytes a step must read (the weights once, every
   sequence's KV once) over the bandwidth of a device-to-device copy timed
   here;
2. throughput, 256 requests of 512 prompt tokens and 128 output tokens,
   against transformers' batched ``generate`` on the same prompts;
3. TTFT with a cached 2,000-token prefix against without, one request at a
   time and 64 at once;
4. bf16 greedy outputs against transformers' own bf16 ``generate``: the
   first position where they differ, per prompt;
5. (``--parts profile``) a decode step's kernels by GPU time, and
   (``--parts products``) each product of a layer alone in a CUDA graph,
   as the engine runs it and in the alternatives tried against it.

The decode and throughput parts run once per ``--scheduling`` mode:
``serial`` (a step's tokens reach the host before the next step is packed)
and ``async`` (``[engine] async_scheduling``: step N+1 packed while step N
runs), so the two are compared in one run.

Models are random-weight checkpoints of real shapes (Llama-3.2-1B's layers
with a 32,000-token vocabulary, Llama-3.1-8B), built on the GPU and saved to
a folder the engine loads like any checkpoint. Every row asserts that it did
what its label says (decode rows decoded, cached rows hit the cache).

    python plugins/sagellm-plugin-torch/benchmarks/gpu_engine.py [--shapes 1b,8b]
        [--parts decode,throughput,ttft,bf16,profile,products] [--batches 1,64,256]
        [--scheduling serial,async] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
    ),
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}


def build_checkpoint(folder: Path, shape: dict, dtype: torch.dtype) -> Path:
    """A random-weight Llama checkpoint of ``shape`` with a word-level
    tokenizer over its whole vocabulary (``w0`` ...), saved to ``folder``."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    torch.manual_seed(0)
    vocab = shape["vocab_size"]
    config = LlamaConfig(
        **shape,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        eos_token_id=vocab - 1,
        bos_token_id=1,
    )
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    raw = Tokenizer(tokenizer_models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=f"w{vocab - 1}", unk_token="w0").save_pretrained(folder)
    return folder


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes per second of a device-to-device copy (read + write), median of 20."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n // 2, dtype=torch.float32, device="cuda").view(torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def engine(folder: Path, model: Path, dtype: str, *, num_blocks: int, max_num_seqs: int, cache: bool = True, **kw):
    from sagellm_plugin_torch import testing as helpers

    path = helpers.write_config(
        folder,
        model=str(model),
        num_blocks=num_blocks,
        prefix_cache=cache,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 8192),
    )
    return helpers.engine_core(path, device="cuda", dtype=dtype, **kw)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab - 2, (count, length), generator=g).tolist()


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights: every parameter but the
    input embedding table (a step reads only its tokens' rows of it)."""
    skip = {id(p) for p in model.get_input_embeddings().parameters()}
    head = model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    if id(head) in skip:  # tied: the head reads the table whole
        total += head.numel() * head.element_size()
    return total


def decode_rows(
    folder: Path, model_dir: Path, bandwidth: float, batches: list[int], scheduling: str = "serial"
) -> list[dict]:
    from sagellm_plugin_torch.engine import SamplingParams

    from sagellm_core.types import Request

    rows = []
    for batch in batches:
        prompt_len, steps = 512, 256
        blocks = batch * -(-(prompt_len + 2 * steps + 2) // 16) + 64
        core = engine(
            folder,
            model_dir,
            "bfloat16",
            num_blocks=blocks,
            max_num_seqs=max(batch, 1),
            cache=False,
            async_scheduling=scheduling == "async",
        )
        assert core.overlap == (scheduling == "async"), f"batch {batch}: not the {scheduling} step loop"
        kv_per_token = core.runner.shape.bytes_per_block(1, core.runner.dtype)
        weights = weight_bytes(core.runner.model)
        prompts = random_prompts(batch, prompt_len, core.runner.vocab_size, seed=batch)
        # Room to decode past the timed steps: no sequence finishes inside them.
        max_tokens = 2 * steps
        for i, p in enumerate(prompts):
            core.add_request(Request(f"d{i}", p, max_tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        while any(s.num_output_tokens == 0 for s in [*core.waiting, *core.running]):
            core.step()  # prefill (and each sequence's first token)
        for _ in range(8):
            core.step()  # warm: graphs replayed, allocator settled
        torch.cuda.synchronize()
        contexts = []
        timed = steps - 16
        # The GPU's own time per step, between events around the runner's
        # launch (the rest of a step is the host's: scheduling, inputs, outputs).
        events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        core.runner.execute = with_gpu_events(core.runner.execute, events)
        start = time.perf_counter()
        before, ahead = core.batched_tokens, core.steps_launched_ahead
        for _ in range(timed):
            contexts.append(sum(s.num_computed_tokens + 1 for s in core.running))
            # (asynchronous: a step returns the tokens of the step launched before it)
            produced = core.step()
            assert len(produced) == batch, f"batch {batch}: a timed step sampled {len(produced)} sequences"
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / timed
        gpu = sum(begin.elapsed_time(end) for begin, end in events) / 1e3 / timed
        decoded = core.batched_tokens - before
        assert decoded == batch * timed, f"batch {batch}: the timed steps were meant to decode only ({decoded} tokens)"
        launched_ahead = core.steps_launched_ahead - ahead
        assert launched_ahead == (timed if scheduling == "async" else 0), (
            f"batch {batch}: {launched_ahead} of {timed} timed steps launched before the step ahead was applied"
        )
        kv_read = statistics.mean(contexts) * kv_per_token
        limit = (weights + kv_read) / bandwidth
        rows.append(
            r := {
                "scheduling": scheduling,
                "batch": batch,
                "mean_context": statistics.mean(contexts) / batch,
                "step_ms": wall * 1e3,
                "gpu_ms": gpu * 1e3,
                "limit_ms": limit * 1e3,
                "ratio_to_limit": wall / limit,
                "weights_gb": weights / 1e9,
                "kv_gb": kv_read / 1e9,
                "graphs": core.runner.graphs is not None,
            }
        )
        print(
            f"decode {scheduling} batch {r['batch']:>3} (context ~{r['mean_context']:.0f}): {r['step_ms']:.2f} ms"
            f" a step ({r['gpu_ms']:.2f} on the GPU), limit {r['limit_ms']:.2f} ms"
            f" ({r['weights_gb']:.2f} GB weights + {r['kv_gb']:.2f} GB KV):"
            f" {r['ratio_to_limit']:.2f}x the limit",
            flush=True,
        )
        del core
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def with_gpu_events(launch, events: list):
    """``launch`` with CUDA events recorded around it into ``events``."""

    def run():
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        result = launch()
        end.record()
        events.append((begin, end))
        return result

    return run


def profile_decode(folder: Path, model_dir: Path, batch: int = 64, steps: int = 20) -> list[dict]:
    """Where a decode step's GPU time goes: the kernels of ``steps`` decode
    steps at ``batch`` (prompts of 512 tokens), by total CUDA time."""
    from sagellm_plugin_torch.engine import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    from sagellm_core.types import Request

    core = engine(folder, model_dir, "bfloat16", num_blocks=batch * 50 + 64, max_num_seqs=batch, cache=False)
    for i, p in enumerate(random_prompts(batch, 512, core.runner.vocab_size, seed=3)):
        core.add_request(Request(f"p{i}", p, steps + 64), SamplingParams(max_tokens=steps + 64, ignore_eos=True))
    while any(s.num_output_tokens == 0 for s in [*core.waiting, *core.running]):
        core.step()  # prefill, each sequence's first token
    for _ in range(4):
        core.step()
    torch.cuda.synchronize()
    before = core.batched_tokens
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
    assert core.batched_tokens - before == batch * steps, "the profiled steps were meant to decode only"
    rows = []
    for event in prof.key_averages():
        if event.device_time_total > 0:
            ms = event.device_time_total / 1e3 / steps
            rows.append({"name": event.key[:90], "calls": event.count, "cuda_ms": ms})
    rows.sort(key=lambda r: -r["cuda_ms"])
    del core
    gc.collect()
    torch.cuda.empty_cache()
    return rows[:25]


def products(shape: dict, batch: int = 64, reps: int = 100) -> list[dict]:
    """Each product of a decode step of ``shape`` at ``batch`` rows, bf16,
    timed in a CUDA graph of ``reps`` calls (no launch gaps): ``F.linear``
    as the engine runs it, ``torch.mm`` against the weight transposed, and
    both with cuBLASLt in place of cuBLAS; the weights' bytes over the time."""
    import torch.nn.functional as F

    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    q_kv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * head_dim
    sizes = {
        "q/k/v": (hidden, q_kv),
        "output projection": (hidden, hidden),
        "gate and up": (hidden, 2 * inter),
        "down": (inter, hidden),
        "head": (hidden, shape["vocab_size"]),
    }

    def timed(fn) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(5):
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            best = min(best, begin.elapsed_time(end) / reps)
        return best * 1e3  # microseconds

    rows = []
    default = torch.backends.cuda.preferred_blas_library()
    try:
        for library in ("cublas", "cublaslt"):
            in_effect = torch.backends.cuda.preferred_blas_library(library)
            assert in_effect.name.lower() == library, f"products: {library} asked for, {in_effect.name} in effect"
            for name, (k, n) in sizes.items():
                weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                transposed = weight.t().contiguous()
                x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
                nbytes = weight.numel() * weight.element_size()
                for form, fn in (
                    ("linear", lambda x=x, w=weight: F.linear(x, w)),
                    ("mm, transposed", lambda x=x, w=transposed: torch.mm(x, w)),
                ):
                    us = timed(fn)
                    rows.append(
                        {"library": library, "product": name, "form": form, "us": us, "tb_s": nbytes / us / 1e6}
                    )
    finally:
        torch.backends.cuda.preferred_blas_library(default)
    return rows


def throughput(
    folder: Path,
    model_dir: Path,
    schedulings: list[str],
    count: int = 256,
    prompt_len: int = 512,
    new_tokens: int = 128,
) -> list[dict]:
    """A row per step loop in ``schedulings``, each against one timing of
    transformers' batched ``generate`` on the same prompts."""
    from sagellm_plugin_torch import models
    from sagellm_plugin_torch.engine import SamplingParams

    from sagellm_core.types import Request

    blocks = count * -(-(prompt_len + new_tokens) // 16) + 256
    tokens = count * new_tokens
    engine_s: dict[str, float] = {}
    for scheduling in schedulings:
        core = engine(
            folder,
            model_dir,
            "bfloat16",
            num_blocks=blocks,
            max_num_seqs=count,
            cache=False,
            async_scheduling=scheduling == "async",
        )
        assert core.overlap == (scheduling == "async"), f"throughput: not the {scheduling} step loop"
        prompts = random_prompts(count, prompt_len, core.runner.vocab_size, seed=7)
        # Warm-up: one short request, outside the timing (kernels compiled).
        core.add_request(Request("warm", prompts[0][:64], 4), SamplingParams(max_tokens=4, ignore_eos=True))
        while core.has_work():
            core.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            core.add_request(Request(f"t{i}", p, new_tokens), SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        generated = 0
        while core.has_work():
            generated += sum(1 for out in core.step() if out.token_id is not None)
        engine_s[scheduling] = time.perf_counter() - start
        assert generated == tokens, f"{scheduling}: the engine generated {generated} tokens, not {tokens}"
        assert (core.steps_launched_ahead > 0) == (scheduling == "async"), (
            f"throughput, {scheduling}: {core.steps_launched_ahead} steps launched before the step ahead was applied"
        )
        assert core.rt.counters.preemptions == 0, "the pool was sized to hold every request"
        del core
        gc.collect()
        torch.cuda.empty_cache()

    model, _ = models.load(str(model_dir), "bfloat16")
    model = model.to("cuda")
    ids = torch.tensor(prompts, device="cuda")
    with torch.inference_mode():
        model.generate(ids[:2, :64], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        hf_s = time.perf_counter() - start
    assert out.shape[1] - prompt_len == new_tokens
    del out, ids
    gc.collect()
    torch.cuda.empty_cache()
    return [
        {
            "scheduling": scheduling,
            "requests": count,
            "engine_tok_s": tokens / seconds,
            "generate_tok_s": tokens / hf_s,
            "ratio": hf_s / seconds,
        }
        for scheduling, seconds in engine_s.items()
    ]


def drain(core, ttfts: list[float]) -> None:
    """Step ``core`` until it is idle, collecting each finished request's TTFT."""
    while core.has_work():
        ttfts.extend(o.outcome.ttft_s for o in core.step() if o.outcome is not None)


def ttft(folder: Path, model_dir: Path) -> dict:
    from sagellm_plugin_torch.engine import SamplingParams

    from sagellm_core.types import Request

    result = {}
    for concurrent in (False, True):
        row = {}
        for cache in (True, False):
            count = 64 if concurrent else 16
            core = engine(folder, model_dir, "bfloat16", num_blocks=count * 132 + 256, max_num_seqs=64, cache=cache)
            vocab = core.runner.vocab_size
            prefix = random_prompts(1, 2000, vocab, seed=11)[0]
            suffixes = random_prompts(count + 1, 16, vocab, seed=12)
            ttfts: list[float] = []
            core.add_request(Request("warm", prefix + suffixes[-1], 1), SamplingParams(max_tokens=1, ignore_eos=True))
            drain(core, ttfts)
            ttfts.clear()
            hits_before = core.rt.counters.hit_blocks
            for i in range(count):
                core.add_request(
                    Request(f"q{i}", prefix + suffixes[i], 1), SamplingParams(max_tokens=1, ignore_eos=True)
                )
                if not concurrent:
                    drain(core, ttfts)
            drain(core, ttfts)
            hits = core.rt.counters.hit_blocks - hits_before
            if cache:
                assert hits >= count * 124, f"cached rows must hit the 2,000-token prefix ({hits} blocks)"
            else:
                assert hits == 0, "uncached rows must not hit"
            row["cached" if cache else "uncached"] = {"mean_ttft_ms": 1e3 * statistics.mean(ttfts), "hit_blocks": hits}
            del core
            gc.collect()
            torch.cuda.empty_cache()
        row["ratio"] = row["uncached"]["mean_ttft_ms"] / row["cached"]["mean_ttft_ms"]
        result["all_at_once" if concurrent else "one_at_a_time"] = row
    return result


def bf16_divergence(folder: Path, model_dir: Path, count: int = 32, new_tokens: int = 32) -> dict:
    from sagellm_plugin_torch import models
    from sagellm_plugin_torch import testing as helpers

    core = engine(folder, model_dir, "bfloat16", num_blocks=4096, max_num_seqs=32)
    vocab = core.runner.vocab_size
    shared = random_prompts(4, 200, vocab, seed=21)
    tails = random_prompts(count, 40, vocab, seed=22)
    prompts = [shared[i % 4] + tails[i][: 8 + i] for i in range(count)]
    results = core.generate(helpers.requests(prompts, new_tokens))
    ours = [results[f"r{i}"] for i in range(count)]
    hits = core.rt.counters.hit_blocks
    del core
    model, _ = models.load(str(model_dir), "bfloat16")
    model = model.to("cuda")
    theirs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
            theirs.append(out[0, len(p) :].tolist())
    gc.collect()
    torch.cuda.empty_cache()
    firsts = []
    for a, b in zip(ours, theirs):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        firsts.append(first if first < new_tokens else None)
    return {
        "prompts": count,
        "new_tokens": new_tokens,
        "identical": sum(f is None for f in firsts),
        "first_divergence": firsts,
        "hit_blocks": hits,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1b,8b")
    parser.add_argument("--parts", default="decode,throughput,ttft,bf16")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--profile-batch", type=int, default=64)
    parser.add_argument(
        "--scheduling", default="serial,async", help="the decode and throughput parts' step loops: serial, async"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_engine.py: no CUDA device (torch.cuda.is_available() is false)", file=sys.stderr)
        return 2
    parts = set(args.parts.split(","))
    schedulings = args.scheduling.split(",")
    if not set(schedulings) <= {"serial", "async"}:
        print(f"gpu_engine.py: --scheduling {args.scheduling}: serial, async or both", file=sys.stderr)
        return 2
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    bandwidth = copy_bandwidth()
    results["copy_bandwidth_tb_s"] = bandwidth / 1e12
    print(f"{results['device']}: device-to-device copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    root = Path(tempfile.mkdtemp())
    for name in args.shapes.split(","):
        t = time.perf_counter()
        model_dir = build_checkpoint(root / name, SHAPES[name], torch.bfloat16)
        shape_results: dict = {"checkpoint_s": time.perf_counter() - t}
        results[name] = shape_results
        print(f"[{name}] checkpoint built and saved in {shape_results['checkpoint_s']:.1f} s", flush=True)
        if "decode" in parts:
            batches = [int(b) for b in args.batches.split(",")]
            rows = [row for mode in schedulings for row in decode_rows(root, model_dir, bandwidth, batches, mode)]
            shape_results["decode"] = rows
        if "profile" in parts:
            rows = profile_decode(root, model_dir, batch=args.profile_batch)
            shape_results["profile"] = rows
            for r in rows:
                print(f"[{name}] profile {r['cuda_ms']:8.3f} ms/step {r['calls']:6d} calls  {r['name']}", flush=True)
        if "products" in parts:
            rows = products(SHAPES[name], batch=args.profile_batch)
            shape_results["products"] = rows
            for r in rows:
                print(
                    f"[{name}] product {r['product']:>17} at batch {args.profile_batch}, {r['library']:8}"
                    f" {r['form']:>14}: {r['us']:7.1f} us ({r['tb_s']:.2f} TB/s)",
                    flush=True,
                )
        if "throughput" in parts:
            rows = throughput(root, model_dir, schedulings)
            shape_results["throughput"] = rows
            for row in rows:
                print(
                    f"[{name}] 256 x 512 -> 128, {row['scheduling']}: engine {row['engine_tok_s']:.0f} tok/s,"
                    f" generate {row['generate_tok_s']:.0f} tok/s: {row['ratio']:.2f}x",
                    flush=True,
                )
        if "ttft" in parts:
            row = ttft(root, model_dir)
            shape_results["ttft"] = row
            for key, r in row.items():
                print(
                    f"[{name}] TTFT {key}, 2,000-token prefix: cached {r['cached']['mean_ttft_ms']:.2f} ms,"
                    f" uncached {r['uncached']['mean_ttft_ms']:.2f} ms: {r['ratio']:.2f}x lower",
                    flush=True,
                )
        if "bf16" in parts:
            row = bf16_divergence(root, model_dir)
            shape_results["bf16"] = row
            print(
                f"[{name}] bf16 greedy against generate's bf16: {row['identical']}/{row['prompts']} identical over"
                f" {row['new_tokens']} tokens; first divergence per prompt {row['first_divergence']}",
                flush=True,
            )
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        import shutil

        shutil.rmtree(model_dir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
