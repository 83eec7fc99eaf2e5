"""Replay speed against a baseline commit, in one run.

    .venv/bin/python benchmarks/replay_speed.py --ref b2237f1
    .venv/bin/python benchmarks/replay_speed.py --ref b2237f1 --workload azure --runs 5

The baseline is a clean clone of ``--ref`` (``git clone`` of this repository,
then ``git checkout``); each replay runs as ``python -m sagellm_core.cli
replay ... --quiet --json`` in a child process whose ``PYTHONPATH`` puts one
tree's ``sagellm_core`` and plugin source folders first, so that tree's code is
imported, not the installed one (checked: each side's child prints where its
modules come from). The plugins are still found through the installed entry
points; only the modules they name come from the tree. Both sides read the
same config files and traces (this working tree's). ``--ref HEAD`` times
the working tree's uncommitted change against its commit.

The two sides alternate (base, new, new, base, ...), ``--runs`` times each, so
a machine whose load drifts weighs on both alike. For each child: wall time
(around the process), requests per second, CPU time and peak RSS (both from
``os.wait4``'s rusage of that child alone). Printed per workload: the median
of each, and new/base ratios. Every report field but the timings (wall time,
hook timings, transfer bandwidth) must be equal between the two sides: the
hit figures above all, any difference fails the run; but for the fields a
change means to move, each named with ``--may-differ`` (its differences are
printed, and the hit figures cannot be named).

Vidur's figure (249 requests/s on the Azure conversation trace, measured on
another machine, not here) is printed beside the Azure rate as a ratio, for
the goal of four times it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "data" / "traces"

#: Vidur's figure on the Azure conversation trace (measured elsewhere, not here).
VIDUR_AZURE_REQ_PER_S = 249.0

#: ``sagellm replay`` arguments per workload; paths resolved against ROOT / TRACES.
WORKLOADS: dict[str, list[str]] = {
    "azure": ["--trace", "{traces}/azure_conv_2023.csv"],
    "mooncake-lru": ["--config", "{root}/contrib/configs/mooncake-lru.toml"],
    "default": [],
    "mooncake-timed-2000": ["--config", "{root}/contrib/configs/mooncake-timed.toml", "--max-requests", "2000"],
    "sharegpt-sjf": ["--config", "{root}/contrib/configs/sharegpt-sjf.toml"],
}

#: Report fields that are timings of this machine, not results of the replay.
TIMING_FIELDS = {"wall_s", "hooks"}
#: Report fields that name the files of the run (the label is the config's name).
RUN_FIELDS = {"config", "label"}


def source_path(root: Path) -> str:
    """A PYTHONPATH that imports ``root``'s core and plugins first."""
    plugins = sorted(p for p in (root / "plugins").iterdir() if (p / "pyproject.toml").exists())
    return os.pathsep.join([str(root), *map(str, plugins)])


def packages(root: Path) -> list[str]:
    """The import names of ``root``'s core and plugin packages."""
    names = ["sagellm_core"]
    for plugin in sorted((root / "plugins").iterdir()):
        names += [p.name for p in plugin.glob("sagellm_plugin_*") if (p / "__init__.py").exists()]
    return names


def check_imports(root: Path, env: dict[str, str], cwd: str) -> None:
    """Fail unless every package of ``root`` that imports in a child with
    ``env`` comes from ``root`` (a plugin whose dependencies are not installed,
    e.g. an engine adapter, is skipped: a replay does not import it either)."""
    code = (
        "import importlib, json, sys\n"
        "out = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        out[name] = importlib.import_module(name).__file__\n"
        "    except Exception:\n"
        "        pass\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *packages(root)], env=env, cwd=cwd, capture_output=True, text=True, check=True
    )
    found = json.loads(done.stdout)
    stray = {name: path for name, path in found.items() if not Path(path).resolve().is_relative_to(root.resolve())}
    if "sagellm_core" not in found or stray:
        raise SystemExit(f"{root}: its code is not what a child imports: {stray or 'no sagellm_core'}")
    print(f"  {root}: {len(found)} packages imported from it (sagellm_core: {found['sagellm_core']})")


def clone(ref: str, into: Path) -> Path:
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(into)], check=True)
    subprocess.run(["git", "-C", str(into), "checkout", "--quiet", ref], check=True)
    head = subprocess.run(
        ["git", "-C", str(into), "log", "-1", "--format=%h %s"], check=True, capture_output=True, text=True
    )
    print(f"baseline: {ref} = {head.stdout.strip()[:100]}")
    return into


def run_child(args: list[str], env: dict[str, str], cwd: str, out: Path) -> dict[str, Any]:
    """One replay in a child process: its report, wall time, CPU time and peak RSS."""
    cmd = [sys.executable, "-m", "sagellm_core.cli", "replay", *args, "--quiet", "--json", str(out)]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    stderr = child.stderr.read().decode(errors="replace") if child.stderr else ""
    if child.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed ({child.returncode}): {stderr.strip()[-2000:]}")
    report = json.loads(out.read_text())
    return {
        "report": report[0] if isinstance(report, list) else report,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,  # KiB on Linux
    }


def comparable(report: dict[str, Any]) -> dict[str, Any]:
    """The report without its timings."""
    out = {k: v for k, v in report.items() if k not in TIMING_FIELDS | RUN_FIELDS}
    if isinstance(out.get("transfers"), dict):
        out["transfers"] = {k: v for k, v in out["transfers"].items() if k != "bytes_per_s"}
    return out


#: Fields no change may move in a speed comparison.
HIT_FIELDS = {"hit_blocks", "query_blocks", "block_hit_rate", "token_hit_rate", "host_hit_blocks", "host_hit_rate"}


def differences(a: dict[str, Any], b: dict[str, Any], skip: frozenset[str] = frozenset()) -> list[str]:
    """The fields both reports have whose values differ, but those in
    ``skip`` (a field or sub-field only one side's report has is a change of
    the report, not of the results)."""
    a, b = comparable(a), comparable(b)
    out = []
    for k in sorted((set(a) & set(b)) - skip):
        x, y = a[k], b[k]
        if isinstance(x, dict) and isinstance(y, dict):  # (a sub-field only one side has, likewise)
            x, y = ({f: v for f, v in d.items() if f in x.keys() & y.keys()} for d in (x, y))
        if x != y:
            out.append(f"{k}: {x!r} != {y!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", required=True, help="the baseline's git ref, e.g. b2237f1")
    parser.add_argument("--runs", type=int, default=3, help="runs per side per workload (default 3)")
    parser.add_argument(
        "--workload",
        action="append",
        choices=sorted(WORKLOADS),
        help="a workload to time (repeatable; default: azure and mooncake-lru)",
    )
    parser.add_argument("--traces", type=Path, default=TRACES, help=f"the traces' folder (default {TRACES})")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument(
        "--may-differ",
        action="append",
        default=[],
        metavar="FIELD",
        help="a report field the change means to move (repeatable; printed, not failed; not a hit figure)",
    )
    opts = parser.parse_args(argv)
    may_differ = frozenset(opts.may_differ)
    if may_differ & HIT_FIELDS:
        parser.error(f"--may-differ {', '.join(sorted(may_differ & HIT_FIELDS))}: hit figures must stay equal")
    chosen = opts.workload or ["azure", "mooncake-lru"]
    results: dict[str, Any] = {"ref": opts.ref, "workloads": {}}
    failed = False
    with tempfile.TemporaryDirectory(prefix="replay-speed-") as tmp:
        base_root = clone(opts.ref, Path(tmp) / "base")
        cwd = str(Path(tmp))  # not a tree: the current folder must not shadow PYTHONPATH
        sides = {}
        for name, root in (("base", base_root), ("new", ROOT)):
            env = {**os.environ, "PYTHONPATH": source_path(root)}
            check_imports(root, env, cwd)
            sides[name] = env
        for workload in chosen:
            args = [a.format(root=ROOT, traces=opts.traces) for a in WORKLOADS[workload]]
            print(f"\n{workload}: sagellm replay {' '.join(args)}")
            runs: dict[str, list[dict[str, Any]]] = {"base": [], "new": []}
            for i in range(opts.runs):
                order = ("base", "new") if i % 2 == 0 else ("new", "base")
                for side in order:
                    got = run_child(args, sides[side], cwd, Path(tmp) / f"{side}.json")
                    got["requests"] = got["report"]["requests_read"]
                    runs[side].append(got)
                    print(
                        f"  {side:4} run {i + 1}: {got['wall_s']:7.2f} s wall, {got['requests'] / got['wall_s']:7.1f}"
                        f" req/s, {got['cpu_s']:7.2f} s CPU, peak RSS {got['peak_rss_mb']:6.1f} MB"
                    )
            first = runs["base"][0]["report"]
            diffs = [d for r in runs["base"][1:] + runs["new"] for d in differences(first, r["report"], may_differ)]
            summary = summarize(workload, runs)
            summary["differences"] = diffs
            meant = sorted({d for d in differences(first, runs["new"][0]["report"]) if d.split(":")[0] in may_differ})
            for d in meant:
                print(f"  moved as meant (--may-differ): {d}")
            if diffs:
                failed = True
                print("  DIFFERENT RESULTS (all but timings must be equal):")
                for d in diffs[:20]:
                    print(f"    {d}")
            else:
                print(f"  results equal (every report field but the timings{' and --may-differ' * bool(meant)})")
            results["workloads"][workload] = {
                "summary": summary,
                "runs": {s: [{k: v for k, v in r.items() if k != "report"} for r in rs] for s, rs in runs.items()},
            }
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=2) + "\n")
    return 1 if failed else 0


def summarize(workload: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med = {
        side: {
            "wall_s": statistics.median(r["wall_s"] for r in rs),
            "cpu_s": statistics.median(r["cpu_s"] for r in rs),
            "req_per_s": statistics.median(r["requests"] / r["wall_s"] for r in rs),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
        }
        for side, rs in runs.items()
    }
    # Per-pair ratios too (each new run against the base run beside it), to show the spread.
    pairs = [b["wall_s"] / n["wall_s"] for b, n in zip(runs["base"], runs["new"])]
    speedup = med["base"]["wall_s"] / med["new"]["wall_s"]
    cpu_speedup = med["base"]["cpu_s"] / med["new"]["cpu_s"]
    print(
        f"  median wall: base {med['base']['wall_s']:.2f} s, new {med['new']['wall_s']:.2f} s:"
        f" new/base {1 / speedup:.3f} ({speedup:.2f}x faster; run pairs {', '.join(f'{p:.2f}x' for p in pairs)})"
    )
    print(f"  median CPU:  base {med['base']['cpu_s']:.2f} s, new {med['new']['cpu_s']:.2f} s ({cpu_speedup:.2f}x)")
    print(
        f"  req/s: base {med['base']['req_per_s']:.0f}, new {med['new']['req_per_s']:.0f};"
        f" peak RSS: base {med['base']['peak_rss_mb']:.0f} MB, new {med['new']['peak_rss_mb']:.0f} MB"
    )
    summary: dict[str, Any] = {"median": med, "speedup_wall": speedup, "speedup_cpu": cpu_speedup, "pairs": pairs}
    if workload == "azure":
        vs = med["new"]["req_per_s"] / VIDUR_AZURE_REQ_PER_S
        print(
            f"  against Vidur's figure ({VIDUR_AZURE_REQ_PER_S:.0f} req/s, measured elsewhere, not here):"
            f" new {vs:.2f}x, base {med['base']['req_per_s'] / VIDUR_AZURE_REQ_PER_S:.2f}x (target 4x)"
        )
        summary["vs_vidur"] = vs
    return summary


if __name__ == "__main__":
    sys.exit(main())
