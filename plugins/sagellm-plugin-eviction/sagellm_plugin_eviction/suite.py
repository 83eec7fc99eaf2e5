"""``sagellm evaluate-policies``: eviction policies judged on a suite of
workloads together, not on one trace.

For every workload of the suite (``suite.toml``, or ``--suite FILE``) and
each of its three capacities, it replays the workload cache-only under LRU,
Belady (the offline optimum) and every policy asked for, and prints the
block hit rate, the ratio to LRU, and the share of the gap between LRU and
Belady that the policy closes; then, per policy, the worst ratio to LRU and
the mean share of the gap closed over the suite. The suite's workloads are
split in a half to tune on, a half held out, a fresh part, a final part
and an untuned part (``--split``). With ``--hints``, each policy also runs
on the workloads' client hints (``Request.kv_hints``): truthful, or with a
share of them wrong or missing, on every workload whose source sends hints
(its ``[workload]`` keys include ``hints``); on the others it runs once,
without.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from collections import Counter
from collections.abc import Sequence
from importlib import metadata, resources
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from sagellm_core import hookimpl
from sagellm_core.cli import add_workers_option
from sagellm_core.config import WORKLOAD_GROUP, WORKLOAD_SOURCES, parse, source_options
from sagellm_core.errors import SagellmError
from sagellm_core.replay import session, workloads

from .adaptive import expert_spec

REFERENCES = ("lru", "belady")
#: The suite's parts: tuned on, held out (judged once, then looked at),
#: fresh (new seeds and another ShareGPT slice, judged once, then looked at),
#: final (seed 303 and a third ShareGPT slice, added before the request-aware
#: policy was built, judged once at the end of that work), untuned (seed 505
#: and a fourth ShareGPT slice, added after every other part had been looked
#: at, for judging settings chosen on the others); "all" is every workload.
SPLITS = ("tune", "held-out", "fresh", "final", "untuned", "all")
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")
#: A suite file's top-level keys, and each ``[[workload]]``'s.
SUITE_KEYS = ("fractions", "workload")
WORKLOAD_KEYS = ("name", "split", "config")
#: Below this gap between LRU and Belady (absolute hit rate) there is nothing
#: to close, and the share is not reported.
MIN_GAP = 1e-3


def default_traces() -> Path:
    return Path(os.environ.get("SAGELLM_TRACES", "../shared/data/traces"))


def read_suite(path: Path | None) -> tuple[dict[str, Any], str]:
    if path is None:
        text, where = resources.files(__package__).joinpath("suite.toml").read_text(), "suite.toml"
    else:
        try:
            text, where = path.read_text(encoding="utf-8-sig"), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise SagellmError(f"--suite {path}: cannot be read: {exc}") from None
    try:
        suite = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SagellmError(f"{where}: invalid TOML: {exc}") from None
    for key in suite:
        if key not in SUITE_KEYS:
            raise SagellmError(f"{where}: unknown key {key!r}; accepted: {', '.join(SUITE_KEYS)}")
    fractions = suite.get("fractions")
    if not (
        isinstance(fractions, list) and fractions and all(isinstance(f, (int, float)) and f > 0 for f in fractions)
    ):
        raise SagellmError(
            f"{where}: fractions: a list of positive numbers (capacities as shares of the reused footprint)"
        )
    for i, entry in enumerate(suite.get("workload", ())):
        if not (
            isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("config"), dict)
        ):
            raise SagellmError(f"{where}: workload {i + 1}: needs name and config")
        for key in entry:
            if key not in WORKLOAD_KEYS:
                raise SagellmError(
                    f"{where}: workload {entry['name']!r}: unknown key {key!r}; accepted: {', '.join(WORKLOAD_KEYS)}"
                )
        if entry.get("split") not in SPLITS[:-1]:
            raise SagellmError(
                f"{where}: workload {entry['name']!r}: split = {entry.get('split')!r};"
                f" accepted: {', '.join(SPLITS[:-1])}"
            )
    return suite, where


def footprint(settings) -> tuple[int, int]:
    """The workload's reused footprint (distinct full blocks used more than
    once, by content) and its largest prompt in full blocks."""
    size, uses, largest = settings.block_size, Counter(), 0
    for request in workloads.load(settings.workload):
        tokens = request.prompt_token_ids
        key = hash(request.cache_salt)
        n = len(tokens) // size
        largest = max(largest, n)
        for i in range(n):
            key = hash((key, tokens[i * size : (i + 1) * size].tobytes()))
            uses[key] += 1
    return sum(1 for count in uses.values() if count > 1), largest


def eviction_section(policy: str) -> dict:
    """``NAME`` or ``NAME:KEY=VALUE,...`` (a plugin and its settings, each
    value TOML or a bare word): the run's ``[eviction]`` section."""
    try:
        name, settings = expert_spec(policy)
    except ValueError:
        raise SagellmError(f"--policy {policy}: settings are KEY=VALUE, separated by commas") from None
    return {"plugin": name, **settings}


def is_oracle(policy: str) -> bool:
    """An offline bound (Belady, and its weaker variants), not an online policy."""
    return eviction_section(policy)["plugin"] == "belady"


#: ``--hints`` modes: what the workloads' clients send.
HINT_MODES = ("none", "truthful", "wrong=SHARE", "missing=SHARE")


def hint_keys(mode: str) -> dict:
    """``none``, ``truthful``, ``wrong=SHARE`` or ``missing=SHARE`` (both
    may be given, separated by a comma): the ``[workload]`` keys of a source
    that sends hints."""
    if mode == "none":
        return {}
    if mode == "truthful":
        return {"hints": True}
    keys: dict = {"hints": True}
    for item in mode.split(","):
        name, eq, value = item.strip().partition("=")
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if name not in ("wrong", "missing") or not eq or not 0 <= share <= 1 or f"hints_{name}" in keys:
            raise SagellmError(f"--hints {mode}: one of {', '.join(HINT_MODES)} (a share from 0 to 1)")
        keys[f"hints_{name}"] = share
    return keys


def sends_hints(entry: dict) -> bool:
    """Whether the workload's source takes the ``hints`` key."""
    workload = entry["config"].get("workload")
    source = workload.get("source", "generator") if isinstance(workload, dict) else "generator"
    options = source_options(source) if isinstance(source, str) else None
    return options is not None and "hints" in attrs.fields_dict(options)


def _settings(entry: dict, where: str, traces: Path, num_blocks: int, policy: str, hints: str = "none"):
    raw = json.loads(json.dumps(entry["config"]).replace("{traces}", str(traces).replace("\\", "/")))
    if hints != "none":
        raw.setdefault("workload", {}).update(hint_keys(hints))
    raw.setdefault("engine", {"name": "replay", "mode": "cache-only"})
    raw.setdefault("kv_pool", {"plugin": "paged"})["num_blocks"] = num_blocks
    raw["eviction"] = eviction_section(policy)
    return parse(raw, f"{where} [{entry['name']}]")


def _unavailable(entry: dict, where: str, traces: Path) -> str | None:
    """Why a valid workload cannot run here (its source not installed, its
    trace missing), or None. An invalid one (a bad key or value, its
    plugins' parameters too) is a ConfigError naming the file, the workload
    and the key."""
    workload = entry["config"].get("workload")
    source = workload.get("source") if isinstance(workload, dict) else None
    if isinstance(source, str) and source not in WORKLOAD_SOURCES:
        if source not in {ep.name for ep in metadata.entry_points(group=WORKLOAD_GROUP)}:
            return f"workload source {source!r} is not installed"
    settings = _settings(entry, where, traces, 1, "lru")
    if settings.workload.path is not None and not Path(settings.workload.path).is_file():
        return f"no file {settings.workload.path}"
    # The plugins' own parameters are checked when they are built.
    session.build_runtime(settings, session.build_engine(settings)[0], hook_timing=False)
    return None


def evaluate(
    suite,
    where,
    policies,
    split="tune",
    traces=None,
    progress=False,
    console=None,
    hints: Sequence[str] = ("none",),
    workers: int = 1,
    executor: str = "local",
) -> list[dict]:
    """One row per workload, capacity and policy (and hint mode, labelled
    ``POLICY [MODE]`` unless ``hints`` is only ``none``): hit rate, ratio to
    LRU, share of the LRU-to-Belady gap closed. The runs are planned first,
    then replayed ``workers`` at a time by ``executor`` (``session.run_many``)."""
    console = console or Console(stderr=True)
    traces = traces or default_traces()
    for mode in hints:
        hint_keys(mode)  # checked before the runs
    names = list(dict.fromkeys([*REFERENCES, *policies]))
    labelled = tuple(hints) != ("none",)
    chosen = [entry for entry in suite.get("workload", ()) if split in ("all", entry["split"])]
    # Every workload checked before the first runs: the runs take minutes.
    unavailable = [(entry, _unavailable(entry, where, traces)) for entry in chosen]
    for entry, why in unavailable:
        if why is not None:
            console.print(f"evaluate-policies: skipping {entry['name']}: {why}", soft_wrap=True)
    settings_of: dict[tuple, tuple] = {}  # (workload, capacity, policy, hints run) -> (settings, label)
    plan = []  # (entry, fraction, capacity, {column: run key})
    for entry in (entry for entry, why in unavailable if why is None):
        reused, largest = footprint(_settings(entry, where, traces, 1, "lru"))
        hinted = sends_hints(entry)
        for fraction in suite["fractions"]:
            capacity = max(round(reused * fraction), 2 * largest + 1)
            columns = {}
            for policy in names:
                for mode in ("none",) if policy in REFERENCES else hints:
                    run_mode = mode if hinted else "none"  # a workload without hints runs once for every mode
                    column = f"{policy} [{mode}]" if labelled and policy not in REFERENCES else policy
                    key = columns[column] = (entry["name"], capacity, policy, run_mode)
                    if key not in settings_of:
                        settings = _settings(entry, where, traces, capacity, policy, run_mode)
                        settings_of[key] = (settings, f"{entry['name']} {capacity} {column}")
            plan.append((entry, fraction, capacity, columns))
    results = session.run_many(list(settings_of.values()), workers=workers, executor=executor, progress=progress)
    rate_of = {key: result.report["block_hit_rate"] for key, result in zip(settings_of, results)}
    rows = []
    for entry, fraction, capacity, columns in plan:
        rates = {column: rate_of[key] for column, key in columns.items()}
        lru, best = rates["lru"], rates["belady"]
        gap = best - lru
        for policy in rates:
            rows.append(
                {
                    "workload": entry["name"],
                    "split": entry["split"],
                    "fraction": fraction,
                    "num_blocks": capacity,
                    "policy": policy,
                    "block_hit_rate": rates[policy],
                    "ratio_to_lru": rates[policy] / lru if lru > 0 else None,
                    "gap_closed": (rates[policy] - lru) / gap if gap >= MIN_GAP else None,
                }
            )
    return rows


#: The summary's last row: per setting, the best of the online policies run,
#: chosen after seeing their results; what following experts could reach at most.
BEST_AFTER_THE_FACT = "best per setting, after the fact"


def _best_per_setting(rows: list[dict]) -> list[dict]:
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["workload"], row["num_blocks"])
        if not is_oracle(row["policy"]) and row["policy"] != "lru":
            if key not in best or row["block_hit_rate"] > best[key]["block_hit_rate"]:
                best[key] = row
    return [{**row, "policy": BEST_AFTER_THE_FACT} for row in best.values()]


def summary(rows: list[dict]) -> list[dict]:
    """Per policy: the worst ratio to LRU, the settings more than 0.5% below
    LRU, and the mean share of the gap closed; with two or more online
    policies, the same for the best of them per setting."""
    out = []
    if len({row["policy"] for row in rows if not is_oracle(row["policy"])} - {"lru"}) > 1:
        rows = rows + _best_per_setting(rows)
    for policy in dict.fromkeys(row["policy"] for row in rows):
        mine = [row for row in rows if row["policy"] == policy]
        ratios = [row["ratio_to_lru"] for row in mine if row["ratio_to_lru"] is not None]
        gaps = [row["gap_closed"] for row in mine if row["gap_closed"] is not None]
        out.append(
            {
                "policy": policy,
                "settings": len(mine),
                "worst_ratio_to_lru": min(ratios) if ratios else None,
                "below_lru_by_0.5%": sum(1 for r in ratios if r < 0.995),
                "mean_gap_closed": sum(gaps) / len(gaps) if gaps else None,
            }
        )
    return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def tables(rows: list[dict]) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    """The per-setting table (one cell per policy: hit rate, ratio to LRU,
    gap closed) and the summary table, as header and rows."""
    policies = list(dict.fromkeys(row["policy"] for row in rows))
    settings = list(dict.fromkeys((row["workload"], row["split"], row["num_blocks"]) for row in rows))
    cell = {(row["workload"], row["num_blocks"], row["policy"]): row for row in rows}
    head = ["workload", "split", "blocks", *policies]
    body = []
    for workload, split, blocks in settings:
        line = [workload, split, f"{blocks:,}"]
        for policy in policies:
            row = cell[(workload, blocks, policy)]
            rate = _fmt(row["block_hit_rate"], ".4f")
            if policy in REFERENCES:
                line.append(rate)
            else:
                line.append(f"{rate} ({_fmt(row['ratio_to_lru'], '.3f')}x, {_fmt(row['gap_closed'], '+.0%')})")
        body.append(line)
    sum_head = ["policy", "settings", "worst ratio to LRU", "settings below LRU -0.5%", "mean gap closed"]
    sum_body = [
        [
            s["policy"],
            str(s["settings"]),
            _fmt(s["worst_ratio_to_lru"], ".4f"),
            str(s["below_lru_by_0.5%"]),
            _fmt(s["mean_gap_closed"], "+.1%"),
        ]
        for s in summary(rows)
        if s["policy"] not in REFERENCES
    ]
    return head, body, sum_head, sum_body


def markdown(rows: list[dict]) -> str:
    head, body, sum_head, sum_body = tables(rows)

    def md(h, b):
        return "\n".join(
            ["| " + " | ".join(h) + " |", "|" + "---|" * len(h), *("| " + " | ".join(r) + " |" for r in b)]
        )

    return md(head, body) + "\n\n" + md(sum_head, sum_body) + "\n"


def print_tables(rows: list[dict], console: Console | None = None) -> None:
    console = console or Console()
    head, body, sum_head, sum_body = tables(rows)
    for title, h, b in (
        ("block hit rate (ratio to LRU, share of the LRU-to-Belady gap closed)", head, body),
        ("over the suite", sum_head, sum_body),
    ):
        table = Table(title=title)
        for column in h:
            table.add_column(column)
        for line in b:
            table.add_row(*line)
        console.print(table)


def plot(rows: list[dict], path: str | Path) -> None:
    """The share of the LRU-to-Belady gap each policy closes, per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = [p for p in dict.fromkeys(row["policy"] for row in rows) if p not in REFERENCES]
    settings = list(dict.fromkeys((row["workload"], row["num_blocks"]) for row in rows))
    cell = {(row["workload"], row["num_blocks"], row["policy"]): row for row in rows}
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(settings)), 4.5))
    width = 0.8 / max(1, len(policies))
    for k, policy in enumerate(policies):
        values = [cell[(w, n, policy)]["gap_closed"] for w, n in settings]
        xs = [i + (k - (len(policies) - 1) / 2) * width for i in range(len(settings))]
        # clipped: where LRU is within a hair of Belady, a small loss is many gaps
        ax.bar(xs, [max(-1.0, v) if v is not None else 0.0 for v in values], width, label=policy)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_ylim(-1.05, 1.0)
    long_names = max(len(w) for w, _ in settings) > 10  # side by side they would overlap
    ax.set_xticks(
        range(len(settings)),
        [f"{w}\n{n:,}" for w, n in settings],
        fontsize=7,
        rotation=30 if long_names else 0,
        ha="right" if long_names else "center",
    )
    ax.set_ylabel("share of the LRU-to-Belady gap closed\n(clipped at -100%; 0 where no gap)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_evaluate_policies(args) -> int:
    suite, where = read_suite(Path(args.suite) if args.suite else None)
    # checked before the runs, not after them: the suite takes minutes
    for out in (args.json, args.markdown, args.plot):
        if out and not Path(out).resolve().parent.is_dir():
            raise SagellmError(f"{out}: its folder does not exist")
    if args.plot and Path(args.plot).suffix.lower() not in PLOT_SUFFIXES:
        raise SagellmError(f"--plot {args.plot}: a file ending in {', '.join(PLOT_SUFFIXES)}")
    rows = evaluate(
        suite,
        where,
        args.policy or ["adaptive"],
        args.split,
        Path(args.traces) if args.traces else None,
        progress=not args.quiet,
        hints=args.hints or ("none",),
        workers=args.workers,
        executor=args.executor,
    )
    if not rows:
        raise SagellmError(f"evaluate-policies: no workload of split {args.split!r} could run here")
    print_tables(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary(rows)}, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows))
    if args.plot:
        plot(rows, args.plot)
    return 0


@hookimpl
def sagellm_register_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "evaluate-policies",
        help="eviction policies on a suite of workloads, three capacities each: hit rate, ratio to LRU, gap closed",
    )
    p.add_argument(
        "--policy",
        action="append",
        help="a sagellm.eviction plugin, NAME or NAME:KEY=VALUE,... with its settings (repeat; default:"
        " adaptive); lru and belady always run",
    )
    p.add_argument(
        "--split",
        choices=SPLITS,
        default="tune",
        help="the suite's part to run: tune, held-out, fresh, final, untuned, or all (default: tune)",
    )
    p.add_argument(
        "--hints",
        action="append",
        help="run each policy with the workloads' client hints: none, truthful, wrong=SHARE, missing=SHARE"
        " (repeat; default: none); workloads whose source sends no hints run once",
    )
    p.add_argument("--suite", help="a suite file (default: the plugin's suite.toml)")
    p.add_argument(
        "--traces", help="the traces folder for {traces} (default: $SAGELLM_TRACES or ../shared/data/traces)"
    )
    p.add_argument("--json", help="write the rows and the summary to this JSON file")
    p.add_argument("--markdown", help="write the tables to this Markdown file")
    p.add_argument("--plot", help="write a bar chart of the gap closed to this image file")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_workers_option(p)
    p.set_defaults(func=cmd_evaluate_policies)
