"""The host's time per decode step of the torch engine, on the CPU.

A decode step of the torch engine is the host's Python (the scheduling
passes, the step scheduler, the runtime's block accounting, the step's
inputs, the outputs applied) around the runner's forward. On a GPU the
device waits while the host works; the host's part is the same Python on
any machine, so it is measured here on the CPU: the engine on a tiny
random-weight Llama (2 layers, hidden 32, so the forward is short), each
decode step timed whole and the runner's forward (``ModelRunner.execute``)
timed inside it; the host's time is the step's less the forward's.

Per batch (1, 64, 256 sequences, 64-token prompts, no prefix cache, as
``gpu_engine.py``'s decode rows): the median host time per step over the
timed steps, in ms and in µs per sequence, and the mean. Each row asserts that every
timed step decoded its whole batch, one token per sequence.

``--against REV`` runs the same rows on the tree at git revision ``REV``
(its ``sagellm_core`` and torch plugin, in a child process), alternating
with this tree's batch by batch, and prints the ratio of the two.
``--profile BATCH`` prints cProfile's breakdown of the host's part at
that batch (the forward left out).

``--overlap`` measures each batch twice in this process, serially and with
``async_scheduling`` (step N+1 packed while step N runs), and prints the
host's time left on the critical path: from the moment a step's tokens are
on the host (the wait for them returned) to the next forward's launch.
Serially that is all of the host's part; overlapped, what the launched
step's tokens are needed for (the outputs applied, a sequence that stopped
taken out of the packed step) and the launch itself, the rest of the host's
part (the passes, the step scheduler, the block accounting, the inputs)
running while the device computes. On the CPU the forward is synchronous,
so the wall time of a step cannot show the overlap; the figure is the
host's time the device would wait for.

    .venv/bin/python plugins/sagellm-plugin-torch/benchmarks/host_step.py [--against REV] [--profile 256] [--overlap]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROMPT = 64
WARM = 8


def build_model(folder: Path) -> Path:
    from sagellm_plugin_torch import testing as helpers

    model = folder / "tiny-llama"
    if not model.exists():
        helpers.save_tiny_llama(model)
    return model


def decoding_engine(folder: Path, model: Path, batch: int, steps: int, overlap: bool = False):
    """An engine on ``model`` with ``batch`` sequences past their prefill
    and warm-up steps, each with room for ``steps`` more decodes."""
    import torch
    from sagellm_plugin_torch import testing as helpers
    from sagellm_plugin_torch.engine import SamplingParams

    from sagellm_core.types import Request

    # Room past the timed steps (a chunked prefill's first sequences decode
    # while the last prefill): none finishes inside them.
    max_tokens = WARM + steps + 16
    blocks = batch * -(-(PROMPT + max_tokens) // 16) + 16
    path = helpers.write_config(
        folder,
        model=str(model),
        num_blocks=blocks,
        prefix_cache=False,
        max_num_seqs=batch,
        max_num_batched_tokens=max(batch, 2048),
    )
    core = helpers.engine_core(path, threads=1, **({"async_scheduling": True} if overlap else {}))
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(2, core.runner.vocab_size - 2, (batch, PROMPT), generator=g).tolist()
    for i, p in enumerate(prompts):
        core.add_request(Request(f"d{i}", p, max_tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while any(s.num_output_tokens == 0 for s in [*core.waiting, *core.running]):
        core.step()  # the prefills, and each sequence's first token
    for _ in range(WARM):
        core.step()
    return core


def timed_forward(core) -> list[float]:
    """Time every call of the runner's forward into the returned list."""
    runner = core.runner
    launch = runner.execute
    times: list[float] = []

    def execute():
        start = time.perf_counter()
        result = launch()
        times.append(time.perf_counter() - start)
        return result

    runner.execute = execute
    return times


def timed_phases(core) -> tuple[list[float], list[float]]:
    """The start of every forward and the end of every wait for a step's
    tokens (``collect``), into the returned lists."""
    runner, collect = core.runner, core.collect
    launch = runner.execute
    starts: list[float] = []
    landed: list[float] = []

    def execute():
        starts.append(time.perf_counter())
        return launch()

    def timed_collect(handle):
        tokens = collect(handle)
        landed.append(time.perf_counter())
        return tokens

    runner.execute, core.collect = execute, timed_collect
    return starts, landed


def measure(folder: Path, model: Path, batch: int, steps: int, overlap: bool = False) -> dict:
    core = decoding_engine(folder, model, batch, steps, overlap)
    assert core.overlap is overlap
    starts, landed = timed_phases(core)
    forwards = timed_forward(core)
    lengths = [len(core.generated_ids(s)) for s in core.running]
    before = core.batched_tokens
    host = []
    for _ in range(steps):
        start = time.perf_counter()
        produced = core.step()
        wall = time.perf_counter() - start
        assert len(produced) == batch and not any(o.finished for o in produced), (
            f"batch {batch}: a timed step sampled {len(produced)} sequences, or ended one"
        )
        host.append(wall - forwards[-1])
    assert len(forwards) == steps, f"batch {batch}: {len(forwards)} forwards in {steps} steps"
    assert core.batched_tokens - before == batch * steps, f"batch {batch}: the timed steps did not only decode"
    grown = [len(core.generated_ids(s)) - n for s, n in zip(core.running, lengths)]
    assert len(core.running) == batch and grown == [steps] * batch, (
        f"batch {batch}: not every sequence decoded one token a step"
    )
    # The host's time on the critical path: from a step's tokens landing
    # to the next forward's launch (serially the landing is in the step
    # before; overlapped, in the same call, just before the launch).
    critical, j = [], 0
    for start in starts:
        while j < len(landed) and landed[j] < start:
            j += 1
        if j:
            critical.append(start - landed[j - 1])
    assert len(landed) == steps and len(critical) >= steps - 1, (
        f"batch {batch}: {len(landed)} landings in {steps} steps"
    )
    median = statistics.median(host)
    return {
        "batch": batch,
        "overlap": overlap,
        "critical_ms": statistics.median(critical) * 1e3,
        "steps": steps,
        "host_ms": median * 1e3,
        "host_us_per_seq": median * 1e6 / batch,
        # The mean counts the steps in which every sequence takes a new
        # block (each 16th: the prompts are of one length), as the GPU's
        # figure does; the median is the steps between.
        "host_mean_ms": statistics.fmean(host) * 1e3,
        "forward_ms": statistics.median(forwards) * 1e3,
    }


def profile(folder: Path, model: Path, batch: int, steps: int, top: int = 20) -> None:
    """cProfile over ``steps`` decode steps, the profiler off inside the
    runner's forward: what it reports is the host's part alone."""
    core = decoding_engine(folder, model, batch, steps)
    profiler = cProfile.Profile()
    launch = core.runner.execute

    def execute():
        profiler.disable()
        try:
            return launch()
        finally:
            profiler.enable()

    core.runner.execute = execute
    profiler.enable()
    for _ in range(steps):
        core.step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = {
        (Path(f).name, line, name): (calls, tt, ct) for (f, line, name), (_, calls, tt, ct, _) in stats.stats.items()
    }
    host = sum(tt for _, tt, _ in rows.values())
    print(f"cProfile, batch {batch}, {steps} steps: host {host / steps * 1e3:.3f} ms a step (under the profiler)")
    print("  parts (cumulative, per step):")
    for f, name in [
        ("runtime.py", "schedule"),
        ("step_scheduler.py", "pack"),
        ("engine.py", "execute"),
        ("engine.py", "apply_outputs"),
    ]:
        ct = sum(c for (ff, _, nn), (_, _, c) in rows.items() if ff == f and nn == name)
        print(f"    {f + ':' + name:32s} {ct / steps * 1e3:8.3f} ms")
    print("  the functions with the most time of their own (per step):")
    own = sorted(((tt, calls, key) for key, (calls, tt, _) in rows.items()), reverse=True)
    for tt, calls, (f, line, name) in own[:top]:
        print(
            f"    {f + ':' + str(line) + '(' + name + ')':70.70s} {tt / steps * 1e6:8.1f} µs {calls / steps:7.1f} calls"
        )


def run_rows(batches: list[int], steps: int) -> list[dict]:
    folder = Path(tempfile.mkdtemp())
    model = build_model(folder)
    return [measure(folder, model, b, steps) for b in batches]


def tree_at(rev: str) -> Path:
    """``sagellm_core`` and the torch plugin's package at ``rev``, extracted to a folder."""
    paths = ["sagellm_core", "plugins/sagellm-plugin-torch/sagellm_plugin_torch"]
    archive = subprocess.run(["git", "archive", rev, *paths], cwd=ROOT, capture_output=True, check=True).stdout
    folder = Path(tempfile.mkdtemp(prefix="sagellm-base-"))
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def child_rows(tree: Path, batch: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(tree / "plugins/sagellm-plugin-torch")])}
    out = subprocess.run(
        [sys.executable, __file__, "--rows-json", "--batches", str(batch), "--steps", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])[0]


def check_tree(tree: Path | None) -> None:
    import sagellm_plugin_torch

    import sagellm_core

    where = Path(sagellm_core.__file__).resolve().parent.parent
    want = (tree or ROOT).resolve()
    assert where == want, f"sagellm_core imported from {where}, not {want}"
    assert Path(sagellm_plugin_torch.__file__).resolve().is_relative_to(want), "the torch plugin from another tree"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--against", metavar="REV", help="also measure the tree at this git revision")
    parser.add_argument("--profile", type=int, metavar="BATCH", help="cProfile the host's part at this batch")
    parser.add_argument("--overlap", action="store_true", help="also measure with async_scheduling, in this process")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rows-json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.rows_json:
        pythonpath = os.environ.get("PYTHONPATH", "")
        check_tree(Path(pythonpath.split(os.pathsep)[0]) if pythonpath else None)
        print(json.dumps(run_rows(batches, args.steps)))
        return 0
    check_tree(None)
    import torch

    torch.set_num_threads(1)
    base = tree_at(args.against) if args.against else None
    folder = Path(tempfile.mkdtemp())
    model = build_model(folder)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.steps} timed steps a row")
    results = []
    for batch in batches:
        row = measure(folder, model, batch, args.steps)
        if base is not None:
            row["base"] = child_rows(base, batch, args.steps)
            row["base_rev"] = args.against
        results.append(row)
        line = (
            f"batch {batch:>3}: host {row['host_ms']:.3f} ms a step ({row['host_us_per_seq']:.2f} µs a sequence),"
            f" mean {row['host_mean_ms']:.3f} ms; forward {row['forward_ms']:.3f} ms"
        )
        if args.overlap:
            o = row["overlapped"] = measure(folder, model, batch, args.steps, overlap=True)
            line += (
                f"\n    on the critical path (tokens landed to the next launch): serial {row['critical_ms']:.3f} ms,"
                f" async_scheduling {o['critical_ms']:.3f} ms: {row['critical_ms'] / o['critical_ms']:.2f}x less;"
                f" async_scheduling's whole host part {o['host_ms']:.3f} ms a step"
            )
        if base is not None:
            b = row["base"]
            line += (
                f"\n    at {args.against}: host {b['host_ms']:.3f} ms ({b['host_us_per_seq']:.2f} µs a sequence),"
                f" mean {b['host_mean_ms']:.3f} ms: {b['host_ms'] / row['host_ms']:.2f}x this tree's median,"
                f" {b['host_mean_ms'] / row['host_mean_ms']:.2f}x its mean"
            )
        print(line, flush=True)
    if args.profile:
        profile(folder, model, args.profile, min(args.steps, 50))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
