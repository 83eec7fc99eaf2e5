"""Rerun every hardening example (docs/benchmarks/hardening.md) against the real
``sagellm`` command, each in its own process, and print a Markdown table: what
was run, the exit status, and the one stderr line (or the report's counts for
a run that must succeed).

    .venv/bin/python tests/fuzz/rerun_examples.py > examples.md
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SAGELLM = [sys.executable, "-c", "import sys; from sagellm_core.cli import main; sys.exit(main())"]

SMALL = """[engine]
name = "replay"
mode = "{mode}"
[workload]
{workload}
[prefix_cache]
plugin = "{cache}"
block_size = 16
{cache_params}
[kv_pool]
plugin = "{pool}"
num_blocks = {blocks}
[eviction]
plugin = "{eviction}"
{extra}
"""
GEN = "tenants = 2\nsessions_per_tenant = 2\nturns = 2\nsystem_prompt_tokens = 64\nuser_tokens = 16"
LINE = '{"timestamp": %s, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, 3]}\n'


def config(folder: Path, name: str, mode="cache-only", workload=GEN, cache="radix", cache_params="", pool="paged",
           blocks=64, eviction="lru", extra="") -> str:  # fmt: skip
    path = folder / f"{name}.toml"
    path.write_text(SMALL.format(**locals() | {"folder": None}))
    return str(path)


def trace(folder: Path, name: str, data: str | bytes) -> str:
    path = folder / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


def mooncake(folder: Path, name: str, lines: str) -> str:
    return config(
        folder,
        name,
        workload=f'source = "mooncake"\npath = "{trace(folder, name + ".jsonl", lines)}"\ntrace_block_tokens = 16',
    )


def fault(folder: Path, name: str, section: str, plugin: str, params: str, extra_sections="") -> str:
    text = Path(config(folder, name, mode="timed", extra=extra_sections)).read_text()
    if section == "scheduler":
        text += f'[scheduler]\npasses = ["{plugin}"]\n[scheduler.{plugin}]\n{params}\n'
    else:
        first = {"prefix_cache": "radix", "kv_pool": "paged", "eviction": "lru", "kv_stores": "host"}[section]
        text = text.replace(f'plugin = "{first}"\n', f'plugin = "{plugin}"\n{params}\n', 1)
    path = folder / f"{name}.toml"
    path.write_text(text)
    return str(path)


def store_fault(folder: Path, name: str, params: str) -> str:
    """A timed replay whose one KV store is the faulty host store."""
    text = Path(config(folder, name, mode="timed")).read_text()
    text += f'[kv_stores]\ntiers = ["faulty-host"]\n[kv_stores.faulty-host]\n{params}\n'
    path = folder / f"{name}.toml"
    path.write_text(text)
    return str(path)


def examples(folder: Path):
    """(class, example, argv, env, expect) with expect "error" or "run"."""
    f = folder
    big = ", ".join("1" for _ in range(8_000_000))
    yield (
        1,
        "blocked command still runs (`SAGELLM_BLOCK_PLUGINS=lifetime`, `sagellm lifetime evaluate`)",
        ["lifetime", "evaluate"],
        {"SAGELLM_BLOCK_PLUGINS": "lifetime"},
        "error",
    )
    yield (
        1,
        "a second distribution registers `sagellm.eviction: lru`",
        ["config", "check", config(f, "clash")],
        {"CLASH": "1"},
        "error",
    )
    yield (
        1,
        "block-list spelling `LRU`",
        ["config", "check", config(f, "spell")],
        {"SAGELLM_BLOCK_PLUGINS": "LRU"},
        "error",
    )
    yield (
        1,
        "block-list spelling `eviction:lru`",
        ["config", "check", config(f, "spell2")],
        {"SAGELLM_BLOCK_PLUGINS": "eviction:lru"},
        "error",
    )
    yield 2, "NaN timestamp", ["replay", "--quiet", "--config", mooncake(f, "nan", LINE % "NaN")], {}, "error"
    yield 2, "infinite timestamp", ["replay", "--quiet", "--config", mooncake(f, "inf", LINE % "Infinity")], {}, "error"
    yield (
        2,
        "`time_scale = inf`",
        ["replay", "--quiet", "--config", config(f, "scale"), "--set", "workload.time_scale=inf"],
        {},
        "error",
    )
    yield (
        2,
        "`time_scale = 1e305` overflowing an arrival (1e10 ms)",
        [
            "replay",
            "--quiet",
            "--config",
            mooncake(f, "overflow", LINE % 0 + LINE % "1e10"),
            "--set",
            "workload.time_scale=1e305",
        ],
        {},
        "error",
    )
    yield (
        2,
        "a plugin calls `sys.exit(0)` in a hook",
        [
            "replay",
            "--quiet",
            "--config",
            fault(f, "exit", "eviction", "faulty-lru", 'hook = "sagellm_blocks_released"\nfault = "exit"'),
        ],
        {},
        "error",
    )
    yield (
        3,
        "a pass edits the `SequenceState`s",
        [
            "replay",
            "--quiet",
            "--config",
            fault(f, "mutate", "scheduler", "faulty-fcfs", 'hook = "sagellm_schedule_pass"\nfault = "mutate"'),
        ],
        {},
        "error",
    )
    yield (
        3,
        "a prefix cache reports a locked block as removed",
        ["replay", "--quiet", "--config", fault(f, "lying", "prefix_cache", "lying-radix", "")],
        {},
        "error",
    )
    yield (
        3,
        "a KV store raises",
        ["replay", "--quiet", "--config", store_fault(f, "sraise", 'hook = "put"\nfault = "raise"')],
        {},
        "error",
    )
    yield (
        3,
        "a KV store returns negative counts",
        ["replay", "--quiet", "--config", store_fault(f, "sneg", 'hook = "put"\nfault = "contents"')],
        {},
        "error",
    )
    yield (
        3,
        "`None` inside an answer (victims)",
        [
            "replay",
            "--quiet",
            "--config",
            fault(f, "none", "eviction", "faulty-lru", 'hook = "sagellm_select_victims"\nfault = "contents"'),
        ],
        {},
        "error",
    )
    yield (
        3,
        "a generator for a tuple (allocation)",
        [
            "replay",
            "--quiet",
            "--config",
            fault(f, "gen", "kv_pool", "faulty-paged", 'hook = "sagellm_allocate_blocks"\nfault = "contents"'),
        ],
        {},
        "error",
    )
    yield (
        3,
        "a string budget (pass)",
        [
            "replay",
            "--quiet",
            "--config",
            fault(f, "budget", "scheduler", "faulty-fcfs", 'hook = "sagellm_schedule_pass"\nfault = "contents"'),
        ],
        {},
        "error",
    )
    yield (
        3,
        "a plugin that sleeps (`[limits] hook_time_limit_s = 1`)",
        [
            "replay",
            "--quiet",
            "--config",
            fault(
                f,
                "hang",
                "eviction",
                "faulty-lru",
                'hook = "sagellm_blocks_cached"\nfault = "hang"',
                "[limits]\nhook_time_limit_s = 1\n",
            ),
        ],
        {},
        "error",
    )
    yield (
        4,
        "the plugin template's `random` policy with `pin_after_hits = 2`",
        [
            "replay",
            "--quiet",
            "--json",
            str(f / "pin.json"),
            "--config",
            config(f, "pin", mode="timed", eviction="random", cache_params="pin_after_hits = 2", blocks=48),
        ],
        {},
        "run",
    )
    yield (
        5,
        "`input_length` of 1e9",
        [
            "replay",
            "--quiet",
            "--config",
            mooncake(f, "huge", '{"timestamp": 0, "input_length": 1000000000, "output_length": 5, "hash_ids": [1]}\n'),
        ],
        {},
        "error",
    )
    yield (
        5,
        "a 50 MB `hash_ids` line",
        [
            "replay",
            "--quiet",
            "--config",
            mooncake(f, "long", f'{{"timestamp": 0, "input_length": 40, "output_length": 5, "hash_ids": [{big}]}}\n'),
        ],
        {},
        "error",
    )
    header = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    for n in ("1000000000", "1" + "0" * 30):
        csv = trace(f, f"azure{len(n)}.csv", header + f"2023-11-16 18:15:46.6805900,{n},3\n")
        yield (
            5,
            f"Azure context of {n if len(n) < 12 else '1e30'} tokens",
            ["replay", "--quiet", "--trace", csv, "--config", config(f, f"az{len(n)}")],
            {},
            "error",
        )
    yield (
        5,
        "`trace_block_tokens = 1e9`",
        [
            "replay",
            "--quiet",
            "--config",
            mooncake(f, "tbt", LINE % 0),
            "--set",
            "workload.trace_block_tokens=1000000000",
        ],
        {},
        "error",
    )
    yield (
        5,
        "a huge system prompt in the generator",
        ["replay", "--quiet", "--config", config(f, "sys"), "--set", "workload.system_prompt_tokens=1000000000"],
        {},
        "error",
    )
    yield (
        5,
        "a pool of 1e9 blocks",
        ["replay", "--quiet", "--config", config(f, "pool", blocks=1_000_000_000)],
        {},
        "error",
    )
    yield 6, "a binary config", ["config", "check", trace(f, "binary.toml", b"\xff\xfe\x00\x01binary")], {}, "error"
    yield (
        6,
        "a non-UTF-8 trace",
        [
            "replay",
            "--quiet",
            "--config",
            mooncake(f, "latin", "")[:0] or mooncake(f, "latin", ""),
            "--trace",
            trace(f, "latin.jsonl", b"\xe9t\xe9\n"),
        ],
        {},
        "error",
    )
    yield (
        6,
        "deeply nested TOML",
        ["config", "check", trace(f, "deep.toml", "x = " + "[" * 100_000 + "]" * 100_000 + "\n")],
        {},
        "error",
    )
    yield (
        6,
        "an overflowing float (`1e400`)",
        ["replay", "--quiet", "--config", config(f, "ovf"), "--set", "workload.think_time_s=1e400"],
        {},
        "error",
    )
    yield (
        6,
        "`trace_block_tokens = 0`",
        ["replay", "--quiet", "--config", mooncake(f, "tbt0", LINE % 0), "--set", "workload.trace_block_tokens=0"],
        {},
        "error",
    )
    yield (
        6,
        "`think_time_s = inf`",
        ["replay", "--quiet", "--config", config(f, "think"), "--set", "workload.think_time_s=inf"],
        {},
        "error",
    )
    yield 6, "a directory as a config", ["config", "check", str(f)], {}, "error"
    yield (
        6,
        "2^62 hash ids",
        [
            "replay",
            "--quiet",
            "--config",
            mooncake(
                f, "h62", '{"timestamp": 0, "input_length": 4, "output_length": 5, "hash_ids": [4611686018427387904]}\n'
            ),
        ],
        {},
        "error",
    )
    yield (
        6,
        "an over-long CSV field",
        [
            "replay",
            "--quiet",
            "--config",
            config(f, "csvlong"),
            "--trace",
            trace(f, "long.csv", header + '2023-11-16 18:15:46.6805900,"' + "1" * 200_000 + '",3\n'),
        ],
        {},
        "error",
    )
    yield (
        6,
        "bad `--max-requests` (`abc`)",
        ["replay", "--quiet", "--config", config(f, "mr"), "--max-requests", "abc"],
        {},
        "error",
    )
    yield (
        6,
        "an output path in a missing folder",
        ["replay", "--quiet", "--config", config(f, "out"), "--json", str(f / "missing" / "r.json")],
        {},
        "error",
    )
    yield (
        6,
        "an output path with an unknown extension",
        ["replay", "--quiet", "--config", config(f, "ext"), "--plot", str(f / "plot.txt")],
        {},
        "error",
    )
    yield (
        7,
        "a multi-line plugin message",
        [
            "replay",
            "--quiet",
            "--config",
            fault(f, "multi", "eviction", "faulty-lru", 'hook = "sagellm_select_victims"\nfault = "raise"'),
        ],
        {},
        "error",
    )
    dup = fault(f, "dup", "eviction", "lru", "")
    Path(dup).write_text(Path(dup).read_text().replace(GEN, 'source = "duplicates"'))
    yield 7, "duplicate request ids (a workload that repeats one)", ["replay", "--quiet", "--config", dup], {}, "error"
    yield (
        7,
        "the radix `events` path with `../`",
        ["config", "check", config(f, "events", cache_params='events = "../escape.jsonl"')],
        {},
        "error",
    )
    yield (
        7,
        "`config check` with a radix `events` file creates none",
        ["config", "check", config(f, "events2", cache_params='events = "kv.jsonl"')],
        {"CHECK_ABSENT": str(f / "kv.jsonl")},
        "ok",
    )
    yield (
        7,
        "`turns = 0`",
        ["replay", "--quiet", "--config", config(f, "turns"), "--set", "workload.turns=0"],
        {},
        "error",
    )
    yield (
        7,
        "`--max-requests 0`",
        ["replay", "--quiet", "--config", config(f, "mr0"), "--max-requests", "0"],
        {},
        "error",
    )
    yield (
        7,
        "`true` as a length",
        [
            "replay",
            "--quiet",
            "--config",
            mooncake(f, "true", '{"timestamp": 0, "input_length": true, "output_length": 5, "hash_ids": [1]}\n'),
        ],
        {},
        "error",
    )
    yield (
        7,
        "an integer where a float is expected (`max_pinned_share = 0`)",
        [
            "replay",
            "--quiet",
            "--json",
            str(f / "int.json"),
            "--config",
            config(f, "int", cache_params="max_pinned_share = 0"),
        ],
        {},
        "run",
    )
    bom = config(f, "bom")
    Path(bom).write_bytes(b"\xef\xbb\xbf" + Path(bom).read_bytes())
    yield 7, "a UTF-8 BOM in a config", ["replay", "--quiet", "--json", str(f / "bom.json"), "--config", bom], {}, "run"
    sharegpt = ROOT / "contrib/configs/sharegpt-fcfs.toml"
    yield (
        7,
        "`sharegpt-fcfs.toml` without torch (`text` falls back to `stat`)",
        ["replay", "--quiet", "--max-requests", "40", "--json", str(f / "sg.json"), "--config", str(sharegpt)],
        {"NO_TORCH": "1"},
        "run",
    )


PRELUDE = """
import os, sys
if os.environ.get("NO_TORCH"):
    sys.modules["torch"] = None  # as if torch were not installed
from sagellm_core.cli import main
sys.exit(main())
"""

DUPLICATES = """
from sagellm_core.types import Request

def load(settings):
    for i in range(3):
        yield Request("same-id", list(range(100 + i, 140 + i)), 4, arrival_s=0.0)
"""


def main() -> int:
    from sagellm_core.kit.testing import declare_plugins

    rows = ["| class | example | exit | stderr (one line) or the run's counts |", "|---|---|---:|---|"]
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        dist = folder / "dists"
        (dist / "dup_workload.py").parent.mkdir(parents=True)
        (dist / "dup_workload.py").write_text(DUPLICATES)
        entry_points = {
            "sagellm.eviction": {"faulty-lru": "faults:FaultyLRU"},
            "sagellm.kv_pool": {"faulty-paged": "faults:FaultyPaged"},
            "sagellm.scheduler_passes": {"faulty-fcfs": "faults:FaultyFCFS"},
            "sagellm.kv_stores": {"faulty-host": "faults:FaultyHost"},
            "sagellm.prefix_cache": {"lying-radix": "faults:LyingRadix"},
            "sagellm.workloads": {"duplicates": "dup_workload:load"},
        }
        declare_plugins(dist, entry_points, name="sagellm-issue16-faults")
        clash = folder / "clash"
        declare_plugins(clash, {"sagellm.eviction": {"lru": "faults:FaultyLRU"}}, name="impostor-eviction")
        for klass, what, argv, env, expect in examples(folder):
            paths = [str(dist), str(HERE), *([str(clash)] if env.get("CLASH") else [])]
            full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), COLUMNS="200", **env)
            done = subprocess.run(
                [sys.executable, "-c", PRELUDE, *argv], env=full_env, capture_output=True, text=True, timeout=600
            )
            err = done.stderr.strip()
            ok = (expect == "error" and done.returncode == 2 and "\n" not in err and err) or (
                expect in ("run", "ok") and done.returncode == 0
            )
            if expect == "ok":
                ok = ok and not Path(env["CHECK_ABSENT"]).exists()
                shown = done.stdout.strip().splitlines()[0].replace(tmp, "$TMP") + " (no events file created)"
            elif expect == "run" and done.returncode == 0:
                report = json.loads(Path(argv[argv.index("--json") + 1]).read_text())
                shown = (
                    f"read {report['requests_read']}, finished {report['requests']}, rejected {report['rejected']}"
                    f"; lifetime fallbacks {report['lifetime_fallbacks']}"
                )
            else:
                shown = err.replace(tmp, "$TMP").replace("|", "\\|")
                if len(shown) > 300:
                    shown = shown[:300] + "…"
            failures += not ok
            rows.append(f"| {klass} | {what} | {done.returncode} | {'' if ok else '**FAILED** '}`{shown}` |")
    print("\n".join(rows))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
