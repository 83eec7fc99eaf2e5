"""Where the torch engine's time goes: cProfile over the throughput run of
``torch_engine.py`` (32 chats, 32 output tokens each, SmolLM2 fp32, CPU),
summarised by part.

    .venv/bin/python plugins/sagellm-plugin-torch/benchmarks/profile_engine.py
"""

from __future__ import annotations

import cProfile
import pstats
import tempfile
import time
from pathlib import Path

from sagellm_plugin_torch import models
from sagellm_plugin_torch import testing as helpers
from sagellm_plugin_torch.engine import SamplingParams

from sagellm_core.types import Request

PARTS = {
    "model forward (all of it)": "runner.py:{forward}",
    "  paged attention (write + attend)": "runner.py:{paged_attention_forward}",
    "  of which attention math": "devices.py:{paged_attention_reference}",
    "  linear layers (torch)": "{<built-in method torch._C._nn.linear>}",
    "scheduling: passes + step packing": "step_scheduler.py:{pack}",
    "runtime schedule() check": "plugin_host.py:{schedule}",
    "sampling": "engine.py:{_sample}",
    "step bookkeeping after the forward": "step_engine.py:{apply_outputs}",
}


def main() -> int:
    model, tokenizer = models.load("smollm2")
    chats = helpers.chat_prompts(tokenizer, 32)
    core = helpers.engine_core(
        helpers.write_config(Path(tempfile.mkdtemp()), num_blocks=1024, max_num_seqs=64, max_num_batched_tokens=2048)
    )
    for i, p in enumerate(chats):
        core.add_request(Request(f"p{i}", p, 32), SamplingParams(max_tokens=32, ignore_eos=True))
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    while core.has_work():
        core.step()
    profiler.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    by_name = {
        f"{Path(f).name}:{{{n}}}" if f != "~" else f"{{{n}}}": (tt, ct)
        for (f, _, n), (_, _, tt, ct, _) in stats.stats.items()
    }
    print(f"{core.step_index} steps, {32 * 32} tokens, {wall:.2f} s wall ({32 * 32 / wall:.1f} tok/s)")
    for label, key in PARTS.items():
        tottime, cumtime = by_name.get(key, (0.0, 0.0))
        value = tottime if "built-in" in key else cumtime
        print(f"{label:40s} {value:7.2f} s  {value / wall:6.1%}")
    print("the functions with the most time of their own:")
    for key, (tottime, _) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:8]:
        print(f"  {key:60s} {tottime:7.2f} s  {tottime / wall:6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
