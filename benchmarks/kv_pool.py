"""The KV pool's depth: admission against preemption, per-tenant quotas,
contiguous allocation. Each part prints Markdown tables, the figures of
``docs/benchmarks/kv-pool.md``.

    python3 benchmarks/kv_pool.py admission [--max-requests N]
    python3 benchmarks/kv_pool.py quotas [--caps 0.25] [--step-caps 0.125 0.03125] [--alone-blocks 3840]
        [--contended-caps C ...] [--seeds 0 ...] [--order fcfs|prefix-aware] [--blocks N] [--sessions N] [--steps]
    python3 benchmarks/kv_pool.py contiguity [--config FILE] [--blocks N] [--max-requests N] [--pools LABEL ...]
    python3 benchmarks/kv_pool.py latency [--requests 500]
    python3 benchmarks/kv_pool.py offload [--device cpu|cuda] [--tokens 2000] [--repeat 20]

* ``admission``: timed replays of ShareGPT conversations (Azure arrivals)
  and of the Mooncake conversation trace at pools tight enough that greedy
  admission preempts, greedy against the ``footprint`` rule (``online``
  lifetime predictor): preemptions, the re-prefill rate (re-prefilled
  tokens over prefill tokens), TTFT and TPOT p50/p99, throughput, and the
  decision's latency (the hook table).
* ``quotas``: the ``noisy-neighbour`` workload: the chat tenants alone, then
  beside the document tenant without and with quotas, and with quotas and
  the ``tenant-shares`` pass (a share of each step's prefill tokens for each
  chat tenant, and the documents capped at ``--step-caps`` where a row
  says, and with ``--contended-caps`` their cap in a step in which a chat
  tenant asks for prefill tokens): each chat tenant's block hit rate and
  TTFT p99 against alone, the chat turns' mean TTFT, Jain's index over
  all the tenants' hit rates, each row on every ``--seeds`` seed with the
  turns pooled; the slowest chat turns
  against the same turns alone; the passes' hook time; and the chat
  tenants alone in the pool less each document cap's blocks (and in
  ``--alone-blocks``): the memory floor of their TTFT.
* ``contiguity``: a timed replay with ``paged`` against ``runs``, ``runs``
  with compaction (islands; gathering; whole pieces), ``runs`` with room
  to grow, ``runs`` with reservations (fixed, or sized by the ``online``
  prediction; and one row whose runtime does not keep them free), and
  ``buddy``: the pieces
  (runs of adjacent ids) of each request's blocks when it finishes, the
  free blocks' fragmentation, the blocks compaction moved, allocation
  latency; what of the fragmentation no compaction before a step
  reaches (the runs made only of the step's own frees); the free blocks
  outside the longest free run; the fragmentation of the free runs
  walled in by blocks that requests hold; the reserved blocks' share of
  the pool, the block hit rate and the preemptions.
* ``latency``: the hook table (p50, mean, p99 of each call, timed by the
  hook dispatch) of allocation, free and ``footprint`` admission on the
  default workload with ``paged``, ``runs``, ``buddy`` and ``runs`` with
  reservations (fixed, and sized by the prediction), in one process, as
  ratios to ``paged``; then every call a ``runs`` pool with reservations
  got in a timed Mooncake replay, recorded and made again on two fresh
  pools, one freeing as the plugin does and one as it did, alternately:
  the free's latency against the free as it was.
* ``offload``: the torch engine's KV tensor (SmolLM2-135M's shape, fp32)
  on a device, a 2,000-token prefix copied to a host tensor and back
  through the device's ``copy_blocks``: its blocks as one run against
  scattered blocks, one call for all against one per block, and a run's
  slice copied whole. Times are medians of ``--repeat``, as ratios to the
  one-call scattered copy in the same process.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import numpy

from sagellm_core.drivers import recorder as recorder_mod
from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.replay import report as report_mod
from sagellm_core.replay import session
from sagellm_core.replay.engine import TimedReplay

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "contrib" / "configs"


def replay(config: Path | str, overrides: dict, label: str) -> dict:
    settings = session.load_settings(config, overrides=overrides)
    return session.run(settings, label=label).report


def check(label: str, holds: bool, what: str) -> None:
    """A row's label is a claim about the run: stop before printing a row that did not do what it says."""
    if not holds:
        raise SystemExit(f"row {label!r}: {what}")


def hook_p50(report: dict, hook: str) -> str:
    stats = report["hooks"].get(hook)
    return f"{stats['p50_us']:.2f}" if stats else "-"


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


# ----------------------------------------------------------------- admission --

ADMISSION_RUNS = [
    ("ShareGPT (first {n} turns, 64 sequences)", "sharegpt-fcfs.toml", (3000, 4000)),
    ("Mooncake conversations (arrivals 6x apart)", "mooncake-timed.toml", (10000, 20000)),
]


def admission_rule(text: str) -> str:
    """``greedy``, or ``DEMAND:QUANTILE[:HOLD_S]``: the footprint rule with that demand (``sum``,
    ``peak``), margin and, where given, ``hold_s``."""
    demand, *numbers = text.split(":")
    if text == "greedy" or (demand in ("sum", "peak") and len(numbers) in (1, 2) and _setting(*numbers)):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected greedy, or sum:Q or peak:Q (0 < Q < 1), then :HOLD_S")


def _setting(quantile: str, hold_s: str = "0") -> bool:
    try:
        return 0 < float(quantile) < 1 and float(hold_s) >= 0
    except ValueError:
        return False


def admission(args) -> None:
    print(
        f"`python3 benchmarks/kv_pool.py admission --max-requests {args.max_requests} --rules {' '.join(args.rules)}`\n"
    )
    for title, config, pools in ADMISSION_RUNS:
        print(f"### {title.format(n=args.max_requests)}\n")
        print(
            "| pool (blocks) | admission | preemptions | re-prefill rate | TTFT p50 (s) | TTFT p99 (s) |"
            " TPOT p50 (ms) | TPOT p99 (ms) | output tok/s | deferrals | decision p50 (µs) |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for blocks in pools:
            for rule in args.rules:
                demand, level, hold = (rule.split(":") + ["", ""])[:3]
                overrides = {
                    ("kv_pool", "num_blocks"): blocks,
                    ("workload", "max_requests"): args.max_requests,
                    ("lifetime", "plugin"): "online",
                }
                if rule != "greedy":
                    overrides[("admission", "plugin")] = "footprint"
                    overrides[("admission", "demand")] = demand
                    overrides[("admission", "quantile")] = float(level)
                    overrides[("admission", "hold_s")] = float(hold) if hold else float("inf")
                label = "greedy" if rule == "greedy" else f"footprint ({demand}), quantile {level}"
                label += f", hold {hold} s" if hold else ""
                r = replay(CONFIGS / config, overrides, label)
                admitted_by = r["plugins"].get("admission", "")
                predictors = r["plugins"]["lifetime"]  # the picked predictor, then its fallback
                check(label, predictors.split(", ")[0] == "online", f"lifetime plugins {predictors!r}")
                if rule == "greedy":
                    check(label, not admitted_by, f"admission plugin {admitted_by!r} loaded")
                    check(label, r["preemptions"] > 0, "greedy admission never preempted: the pool is not tight")
                else:
                    check(label, admitted_by == "footprint", f"admission plugin {admitted_by!r}, not footprint")
                    check(label, r["admission"]["deferrals"] > 0, "the footprint rule deferred nothing")
                    ran = r["plugin_figures"]["footprint"]["demand"]
                    check(label, ran == demand, f"the footprint rule ran with demand {ran!r}")
                    held = r["plugin_figures"]["footprint"]["hold_s"]
                    check(label, held == (float(hold) if hold else None), f"the rule ran with hold_s {held}")
                ttft, tpot = r["ttft_s"], r["tpot_s"]
                print(
                    f"| {blocks:,} | {label} | {r['preemptions']:,} | {r['reprefill_rate']:.4f} |"
                    f" {ttft['p50']:.3f} | {ttft['p99']:.3f} | {tpot['p50'] * 1e3:.2f} | {tpot['p99'] * 1e3:.2f} |"
                    f" {r['throughput_tokens_per_s']:,.0f} | {r['admission']['deferrals']:,} |"
                    f" {hook_p50(r, 'sagellm_admit_request')} |",
                    flush=True,
                )
        print()


# -------------------------------------------------------------------- quotas --

NOISY = """
[engine]
name = "replay"
mode = "timed"
[workload]
source = "noisy-neighbour"
seed = {seed}
tenants = 3
sessions_per_tenant = {sessions}
document_rate = {rate}
[prefix_cache]
plugin = "radix"
block_size = 16
[kv_pool]
plugin = "paged"
num_blocks = {blocks}
[eviction]
plugin = "lru"
[lifetime]
plugin = "stat"
[scheduler]
passes = ["{order}"]
"""
QUOTA = """
[admission]
plugin = "quota"
guarantees = {{"chat-0" = 0.25, "chat-1" = 0.25, "chat-2" = 0.25}}
caps = {{docs = {cap}}}
"""
#: The step's prefill tokens: a quarter guaranteed to each chat tenant, and
#: the document tenant capped where the row says.
STEP_SHARES = """
[scheduler.tenant-shares]
shares = {{"chat-0" = 0.25, "chat-1" = 0.25, "chat-2" = 0.25}}
caps = {{{step_caps}}}
"""


class QuotaRun(NamedTuple):
    """A row of the quota table."""

    label: str
    rate: float  # documents a second (0: the chat tenants alone)
    cap: float | None  # the documents' share of the pool (None: no quota)
    step_cap: float | None | bool  # their share of a step (False: no tenant-shares pass; None: the shares alone)
    contended: float | None = None  # their step cap while a chat tenant prefills (None: their step cap)


#: A turn's tenant, TTFT, cached tokens at admission, prompt tokens and arrival (s).
Turn = tuple[str, float, int, int, float]
#: A replayed step: its start and end (s), and its tokens by tenant and
#: phase ("prefill" or "decode").
Step = tuple[float, float, dict[tuple[str, str], int]]


def quota_runs(args) -> list[QuotaRun]:
    runs = [QuotaRun("chat tenants alone", 0.0, None, False)]
    for rate in args.rates:
        runs += [QuotaRun(f"documents at {rate}/s, no quota", rate, None, False)]
        for cap in args.caps:
            runs += [QuotaRun(f"documents at {rate}/s, quota (docs cap {cap})", rate, cap, False)]
            runs += [QuotaRun(f"documents at {rate}/s, quota (docs cap {cap}) + step shares", rate, cap, None)]
            for step in args.step_caps:
                shared = f"documents at {rate}/s, quota (docs cap {cap}) + step shares, docs step cap {step}"
                runs += [QuotaRun(shared, rate, cap, step)]
                runs += [
                    QuotaRun(f"{shared}, {contended} while a chat tenant prefills", rate, cap, step, contended)
                    for contended in args.contended_caps
                ]
    return runs


def replay_quota_runs(
    args, runs: list[QuotaRun]
) -> tuple[dict[str, list[dict]], dict[str, dict[tuple[int, str], Turn]], dict[tuple[str, int], list[Step]]]:
    """Each row replayed once a seed, checked to be what its label says:
    label -> each seed's report, label -> (seed, request id) -> its turn,
    and with ``--steps``, (label, seed) -> the replay's steps in order."""
    rows: dict[str, list[dict]] = {}
    turns: dict[str, dict[tuple[int, str], Turn]] = {}
    steps: dict[tuple[str, int], list[Step]] = {}
    real_record, real_execute = recorder_mod.Recorder.record, TimedReplay.execute
    into: dict[tuple[int, str], Turn] = {}
    seed = 0
    label = ""

    def execute(engine, step):  # the step's span and its tokens by tenant and phase
        start = engine.simulated_s
        real_execute(engine, step)
        tokens: dict[tuple[str, str], int] = {}
        for state, n, prefill in zip(step.states, step.num_new, step.prefill):
            key = (state.request.tenant, "prefill" if prefill else "decode")
            tokens[key] = tokens.get(key, 0) + n
        steps.setdefault((label, seed), []).append((start, engine.simulated_s, tokens))

    def record(recorder, outcome):  # every finished request's TTFT and cached prompt
        request = outcome.request
        into[seed, request.request_id] = (
            request.tenant,
            outcome.ttft_s,
            outcome.num_cached_tokens,
            request.num_prompt_tokens,
            request.arrival_s,
        )
        real_record(recorder, outcome)

    recorder_mod.Recorder.record = record  # type: ignore[method-assign]
    if args.steps:
        TimedReplay.execute = execute  # type: ignore[method-assign]
    try:
        for label, rate, cap, step_cap, contended in runs:
            into = turns[label] = {}
            rows[label] = []
            for seed in args.seeds:
                text = NOISY.format(sessions=args.sessions, rate=rate, blocks=args.blocks, seed=seed, order=args.order)
                text += QUOTA.format(cap=cap) if cap is not None else ""
                if step_cap is not False:
                    text = text.replace(f'passes = ["{args.order}"]', f'passes = ["{args.order}", "tenant-shares"]')
                    text += STEP_SHARES.format(step_caps="" if step_cap is None else f"docs = {step_cap}")
                    text += f"contended_caps = {{docs = {contended}}}\n" if contended is not None else ""
                r = session.run(settings_from_toml(text), label=label).report
                admitted_by = r["plugins"].get("admission", "")
                check(label, ("docs" in r["tenant_block_hit_rates"]) == (rate > 0), "the document tenant's presence")
                passes = r["plugins"]["scheduler"]
                wanted = args.order if step_cap is False else f"{args.order}, tenant-shares"
                check(label, passes == wanted, f"passes {passes!r}")
                wanted = "" if cap is None else "quota"
                check(label, admitted_by == wanted, f"admission plugin {admitted_by!r}, not {wanted!r}")
                rows[label].append(r)
            if cap is not None:  # in some seed: in a large pool one seed's documents may all fit
                deferred = sum(r["admission"]["tenant_deferrals"].get("docs", 0) for r in rows[label])
                check(label, deferred > 0, "the quota deferred no document")
            if contended is not None:
                yielded = [r["plugin_figures"].get("tenant-shares", {}).get("yielded_steps", {}) for r in rows[label]]
                check(label, all(y.get("docs", 0) > 0 for y in yielded), "the documents never yielded a step")
    finally:
        recorder_mod.Recorder.record = real_record  # type: ignore[method-assign]
        TimedReplay.execute = real_execute  # type: ignore[method-assign]
    return rows, turns, steps


def quotas(args) -> None:
    seeds = ", ".join(map(str, args.seeds))
    print(
        f"`python3 benchmarks/kv_pool.py quotas` ({args.sessions} sessions a chat tenant, {args.blocks:,} blocks,"
        f" seeds {seeds}, {args.order})\n"
    )
    runs = quota_runs(args)
    rows, turns, steps = replay_quota_runs(args, runs)
    labels = [run.label for run in runs]
    alone_label = labels[0]
    chats = sorted(rows[alone_label][0]["tenant_block_hit_rates"])

    def hit_rate(label: str, tenant: str) -> float:  # the mean over seeds
        return statistics.fmean(r["tenant_block_hit_rates"][tenant] for r in rows[label])

    def ttft_p99(label: str, tenant: str) -> float:  # each seed's TTFTs pooled
        return report_mod.percentiles([t[1] for t in turns[label].values() if t[0] == tenant])["p99"]

    def chat_ttft_mean(label: str) -> float:  # every chat turn's, over the seeds
        return statistics.fmean(t[1] for t in turns[label].values() if t[0] in chats)

    if len(args.seeds) > 1:
        print(
            "Hit rates: the mean over the seeds; TTFT p99: of each tenant's turns over all the seeds;"
            " Jain's index: the lowest of the seeds'; preemptions and deferrals: summed.\n"
        )
    print(
        "| run | "
        + " | ".join(f"{t} hit rate (vs alone)" for t in chats)
        + " | docs hit rate |"
        + " | ".join(f" {t} TTFT p99 s (vs alone)" for t in chats)
        + " | chat TTFT mean s (vs alone) | docs TTFT p99 (s) | Jain (all tenants) |"
        " Jain (chat) | preemptions | docs deferrals |"
    )
    print("|---|" + "---:|" * (2 * len(chats) + 7))
    for label in labels:
        reports = rows[label]
        cells = [f"{hit_rate(label, t):.4f} ({ratio(hit_rate(label, t), hit_rate(alone_label, t))})" for t in chats]
        cells.append(f"{hit_rate(label, 'docs'):.4f}" if "docs" in reports[0]["tenant_block_hit_rates"] else "-")
        cells += [f"{ttft_p99(label, t):.3f} ({ratio(ttft_p99(label, t), ttft_p99(alone_label, t))})" for t in chats]
        mean, mean_alone = chat_ttft_mean(label), chat_ttft_mean(alone_label)
        cells.append(f"{mean:.4f} ({ratio(mean, mean_alone)})")
        cells.append(f"{ttft_p99(label, 'docs'):.3f}" if "docs" in reports[0]["tenant_ttft_s"] else "-")
        jain = min(r["jain_fairness"] for r in reports)
        chat_jain = min(report_mod.jain_index([r["tenant_block_hit_rates"][t] for t in chats]) for r in reports)
        preemptions = sum(r["preemptions"] for r in reports)
        deferred = sum(r["admission"]["tenant_deferrals"].get("docs", 0) for r in reports)
        cells += [f"{jain:.4f}", f"{chat_jain:.4f}", f"{preemptions:,}", f"{deferred:,}"]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print()
    if len(args.seeds) > 1:  # each seed's TTFT p99 against alone, the rows' spread
        print("Each seed's chat TTFT p99 against alone (the report's own, per run):\n")
        print("| run | seed | " + " | ".join(f"{t} TTFT p99 s (vs alone)" for t in chats) + " |")
        print("|---|---:|" + "---:|" * len(chats))
        for label in labels[1:]:
            for seed, r, base in zip(args.seeds, rows[label], rows[alone_label]):
                ttft, ttft_alone = r["tenant_ttft_s"], base["tenant_ttft_s"]
                cells = [f"{ttft[t]['p99']:.3f} ({ratio(ttft[t]['p99'], ttft_alone[t]['p99'])})" for t in chats]
                print(f"| {label} | {seed} | " + " | ".join(cells) + " |")
        print()
    for label in labels:
        for seed, r in zip(args.seeds, rows[label]):
            if "quota" in r["plugin_figures"]:
                admit, victims = hook_p50(r, "sagellm_admit_request"), hook_p50(r, "sagellm_select_victims")
                figures = r["plugin_figures"]["quota"]
                print(f"{label} (seed {seed}): quota figures {figures}; p50 µs: admit {admit}, victims {victims}")
            if "tenant-shares" in r["plugin_figures"]:
                print(f"{label} (seed {seed}): tenant-shares figures {r['plugin_figures']['tenant-shares']}")
    print()
    memory_floor(args, rows[alone_label][0])
    alone_turns = turns[alone_label]
    print(
        "The slowest two turns of each chat tenant in the rows with the smallest step cap,"
        " against the same turns alone:\n"
    )
    print("| run | turn | TTFT s (alone) | prompt tokens | cached (alone) |")
    print("|---|---|---:|---:|---:|")
    for label, step_cap in [(run.label, run.step_cap) for run in runs]:
        if args.step_caps and step_cap == min(args.step_caps):
            for tenant in chats:
                mine = sorted((t[1], key) for key, t in turns[label].items() if t[0] == tenant)
                for ttft, key in mine[-2:]:
                    _, _, cached, prompt, _ = turns[label][key]
                    _, ttft_alone, cached_alone, _, _ = alone_turns[key]
                    turn = key[1] if len(args.seeds) == 1 else f"{key[1]} (seed {key[0]})"
                    print(
                        f"| {label} | {turn} | {ttft:.3f} ({ttft_alone:.3f}) | {prompt:,} |"
                        f" {cached:,} ({cached_alone:,}) |"
                    )
    print()
    print("The scheduling passes' hook (`sagellm_schedule_pass`, every pass of a step in one call), µs:\n")
    print("| run | seed | calls | p50 | mean | p99 |")
    print("|---|---:|---:|---:|---:|---:|")
    for label in labels:
        for seed, r in zip(args.seeds, rows[label]):
            stats = r["hooks"]["sagellm_schedule_pass"]
            print(
                f"| {label} | {seed} | {stats['calls']:,} | {stats['p50_us']:.2f} | {stats['mean_us']:.2f} |"
                f" {stats['p99_us']:.2f} |"
            )
    print()
    if args.steps:
        steps_around_slowest_turns(args, runs, chats, turns, steps)


def steps_around_slowest_turns(args, runs, chats, turns, steps) -> None:
    """For each chat tenant's slowest turn in the rows with the smallest
    step cap: the replay's steps from the one in progress when it arrived
    to the one that gave its first token, beside the same turn's alone."""
    alone_label = runs[0].label
    print("The steps around each chat tenant's slowest turn (ms from its arrival; tokens by tenant and phase):\n")
    print("| run | turn | step | start, end (ms) | length (ms) | tokens |")
    print("|---|---|---|---:|---:|---|")
    for label in [run.label for run in runs if args.step_caps and run.step_cap == min(args.step_caps)]:
        for tenant in chats:
            ttft, key = max((t[1], key) for key, t in turns[label].items() if t[0] == tenant)
            for row, name in ((label, label), (alone_label, "(alone)")):
                arrival, first_token = turns[row][key][4], turns[row][key][4] + turns[row][key][1]
                spans = [s for s in steps[row, key[0]] if s[1] > arrival and s[0] < first_token - 1e-9]
                for i, (start, end, tokens) in enumerate(spans):
                    words = ", ".join(f"{t} {phase} {n:,}" for (t, phase), n in sorted(tokens.items()))
                    where = "in progress" if start < arrival else f"{i + 1 - (spans[0][0] < arrival)}"
                    print(
                        f"| {name} | {key[1]} (seed {key[0]}) | {where} | {(start - arrival) * 1e3:+.1f},"
                        f" {(end - arrival) * 1e3:+.1f} | {(end - start) * 1e3:.1f} | {words} |"
                    )
    print()


def memory_floor(args, alone: dict) -> None:
    """The chat tenants alone in the pool less each document cap's blocks
    (what the quota leaves them while the documents hold their cap), and
    the ``--alone-blocks`` sizes: the TTFT p99 no quota can better, since
    no document computes beside them."""
    sizes = sorted({args.blocks - int(cap * args.blocks + 1e-9) for cap in args.caps} | set(args.alone_blocks))
    chats = sorted(alone["tenant_block_hit_rates"])
    print(f"The chat tenants alone in fewer blocks, against them alone in {args.blocks:,}:\n")
    print(
        "| blocks | "
        + " | ".join(f"{t} hit rate (vs alone)" for t in chats)
        + " | "
        + " | ".join(f"{t} TTFT p99 s (vs alone)" for t in chats)
        + " | preemptions |"
    )
    print("|---:|" + "---:|" * (2 * len(chats) + 1))
    for blocks in sorted(sizes, reverse=True):
        label = f"chat tenants alone, {blocks:,} blocks"
        text = NOISY.format(sessions=args.sessions, rate=0.0, blocks=blocks, seed=args.seeds[0], order=args.order)
        r = session.run(settings_from_toml(text), label=label)
        r = r.report
        check(label, "docs" not in r["tenant_block_hit_rates"], "a document tenant")
        check(label, r["plugins"].get("admission", "") == "", "an admission plugin")
        hits, ttft = r["tenant_block_hit_rates"], r["tenant_ttft_s"]
        cells = [f"{hits[t]:.4f} ({ratio(hits[t], alone['tenant_block_hit_rates'][t])})" for t in chats]
        cells += [f"{ttft[t]['p99']:.3f} ({ratio(ttft[t]['p99'], alone['tenant_ttft_s'][t]['p99'])})" for t in chats]
        print(f"| {blocks:,} | " + " | ".join(cells) + f" | {r['preemptions']:,} |", flush=True)
    print()


# ---------------------------------------------------------------- contiguity --


def pieces(block_ids) -> int:
    """Runs of adjacent ids, in the order a request holds them."""
    return sum(1 for i, b in enumerate(block_ids) if i == 0 or b != block_ids[i - 1] + 1)


def p99(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def fresh_runs(freed: set[int], in_use, num_blocks: int) -> int:
    """Free runs made only of ``freed`` blocks (used blocks, or the pool's
    ends, on both sides)."""
    still = sorted(b for b in freed if b not in in_use)
    runs = 0
    for i, b in enumerate(still):
        starts = i == 0 or still[i - 1] != b - 1
        if starts and (b == 0 or b - 1 in in_use):
            end = b
            while end + 1 in freed and end + 1 not in in_use:
                end += 1
            runs += end + 1 == num_blocks or end + 1 in in_use
    return runs


def free_bitmap(pool, num_blocks: int) -> numpy.ndarray:
    """The pool plugin's own free-block bitmap (``paged``, ``runs`` and
    ``buddy`` keep one, ``buddy`` and ``paged`` with a guard byte each end),
    viewed without a copy, guard bytes included (0)."""
    bits = numpy.frombuffer(pool._is_free, dtype=numpy.uint8)
    if len(bits) == num_blocks:
        bits = numpy.concatenate(([0], bits, [0])).astype(numpy.uint8)
    return bits


def free_runs(free: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
    """The runs of free blocks in ``free`` (a bitmap with a 0 each end):
    their first blocks and the blocks after them."""
    edges = numpy.flatnonzero(numpy.diff(free.astype(numpy.int8)))  # starts and ends of the free runs, in pairs
    return edges[::2], edges[1::2]


def walled_in(starts, ends, movable, num_blocks: int) -> int:
    """The free runs with no movable block on either side: blocks that
    requests hold, or the pool's ends, both sides."""
    return sum(
        1
        for s, e in zip(starts.tolist(), ends.tolist())
        if not (s > 0 and s - 1 in movable) and not (e < num_blocks and e in movable)
    )


#: A reserving row whose runtime does not keep the reserved blocks free: an
#: allocation takes them when the other free blocks run short, before any eviction.
NOT_KEPT = "taken before eviction"


def contiguity(args) -> None:
    from sagellm_core.drivers.engines import build_engine

    print(
        f"`python3 benchmarks/kv_pool.py contiguity` ({args.config}, {args.blocks:,} blocks, "
        f"{args.max_requests} requests{', lifetime ' + args.lifetime if args.lifetime else ''})\n"
    )
    print(
        "| pool | pieces a request, mean | p99 | pieces of its computed blocks, mean | p99 | blocks a request, mean |"
        " free-block fragmentation (mean) | utilisation (mean) | blocks moved | allocate p50 (µs) | free p50 (µs) |"
        " compaction plan p50 (µs) | wall (s) | steps with at most one free block |"
        " fragmentation of runs freed in the step (mean) |"
        " free blocks outside the longest free run, of the pool (mean) | 1 - longest free run / free blocks (mean) |"
        " fragmentation of the walled-in free runs (mean) | reserved blocks, of the pool (mean) |"
        " block hit rate | preemptions |"
    )
    print("|---|" + "---:|" * 20)
    pools = [
        ("paged", {("kv_pool", "plugin"): "paged"}),
        ("runs", {("kv_pool", "plugin"): "runs"}),
        ("runs, compact", {("kv_pool", "plugin"): "runs", ("kv_pool", "compact"): True}),
        ("buddy", {("kv_pool", "plugin"): "buddy"}),
        *(
            (f"runs, grow room {room}", {("kv_pool", "plugin"): "runs", ("kv_pool", "grow_room"): room})
            for room in (2, 16)
        ),
        ("runs, gather", {("kv_pool", "plugin"): "runs", ("kv_pool", "compact"): True, ("kv_pool", "moves"): "gather"}),
        ("runs, pieces", {("kv_pool", "plugin"): "runs", ("kv_pool", "compact"): True, ("kv_pool", "moves"): "pieces"}),
        (
            "runs, pieces every step",
            {
                ("kv_pool", "plugin"): "runs",
                ("kv_pool", "compact"): True,
                ("kv_pool", "moves"): "pieces",
                ("kv_pool", "min_steps_between"): 1,
            },
        ),
        *(
            (f"runs, reserve {blocks}", {("kv_pool", "plugin"): "runs", ("kv_pool", "reserve"): blocks})
            for blocks in (24, 48)
        ),
        (f"runs, reserve 24, {NOT_KEPT}", {("kv_pool", "plugin"): "runs", ("kv_pool", "reserve"): 24}),
        (
            "runs, reserve 48 predicted",
            {
                ("kv_pool", "plugin"): "runs",
                ("kv_pool", "reserve"): 48,
                ("kv_pool", "reserve_predicted"): True,
                ("lifetime", "plugin"): "online",
            },
        ),
        (
            "runs, gather every step",
            {
                ("kv_pool", "plugin"): "runs",
                ("kv_pool", "compact"): True,
                ("kv_pool", "moves"): "gather",
                ("kv_pool", "min_steps_between"): 1,
            },
        ),
    ]
    for label, pool in pools:
        if args.pools and label not in args.pools:
            continue
        compacting = pool.get(("kv_pool", "compact"), False)
        overrides = {("kv_pool", "num_blocks"): args.blocks, ("workload", "max_requests"): args.max_requests}
        if args.lifetime:
            overrides[("lifetime", "plugin")] = args.lifetime
        overrides.update(pool)  # (a row sized by the prediction keeps its own predictor)
        settings = session.load_settings(ROOT / args.config, overrides=overrides)
        engine, engine_settings = build_engine(settings)
        rt = session.build_runtime(settings, engine)
        reserving = pool.get(("kv_pool", "reserve"), 0) > 0
        check(label, rt.reserves == reserving, f"the runtime keeps reserved blocks free: {rt.reserves}")
        if NOT_KEPT in label:  # the reservations only: others take them before any eviction
            rt.reserves = False
        counts, own, sizes = [], [], []
        finish = rt.finish

        def finishing(state, output_token_ids=None, finish=finish, counts=counts, own=own, sizes=sizes, rt=rt):
            counts.append(pieces(state.block_ids))
            own.append(pieces(state.block_ids[state.num_cached_tokens // rt.block_size :]))  # past its prefix hit
            sizes.append(len(state.block_ids))
            return finish(state, output_token_ids)

        rt.finish = finishing  # type: ignore[method-assign]
        freed: set[int] = set()  # blocks freed since the last sample
        free_blocks = rt.host.free_blocks

        def freeing(block_ids, free_blocks=free_blocks, freed=freed):
            block_ids = tuple(block_ids)
            freed.update(block_ids)
            return free_blocks(block_ids)

        rt.host.free_blocks = freeing  # type: ignore[method-assign]
        real_sample = recorder_mod.Recorder.sample
        # steps sampled, of which with at most one free block, the fresh runs' fragmentation,
        # the free blocks outside the longest free run over the pool, one less the longest run over the free blocks
        # and the walled-in runs' fragmentation (below)
        tally = [0, 0, 0.0, 0.0, 0.0, 0.0, 0.0]
        kv_pool = rt.host.plugins["kv_pool"][0].instance

        def sampling(
            recorder, rt, now_s, usage, freed=freed, tally=tally, real_sample=real_sample, label=label, kv_pool=kv_pool
        ):
            real_sample(recorder, rt, now_s, usage)
            tally[0] += 1
            tally[6] += getattr(kv_pool, "_num_reserved", 0) / rt.num_blocks
            if usage.num_free_blocks <= 1:
                tally[1] += 1
            else:  # runs made only of blocks the step freed: no compaction before the step reaches them
                fresh = fresh_runs(freed, rt.ledger.in_use, rt.num_blocks)
                tally[2] += min(usage.num_free_runs - 1, fresh) / (usage.num_free_blocks - 1)
                bits = free_bitmap(kv_pool, rt.num_blocks)
                starts, ends = free_runs(bits)
                check(label, len(starts) == usage.num_free_runs, "the pool's bitmap disagrees with its usage")
                longest = int((ends - starts).max())
                tally[3] += (usage.num_free_blocks - longest) / rt.num_blocks
                tally[4] += 1 - longest / usage.num_free_blocks
                # the fragmentation left if every other run joined one: what moving cached blocks
                # out of the way (not into the walled-in runs) can reach at best
                walled = walled_in(starts, ends, rt.evictable(), rt.num_blocks)
                tally[5] += min(walled, len(starts) - 1) / (usage.num_free_blocks - 1)
            freed.clear()

        recorder_mod.Recorder.sample = sampling  # type: ignore[method-assign]
        start = time.perf_counter()
        try:
            recorder = engine.run(rt, session.workloads.load(settings.workload))
        finally:
            recorder_mod.Recorder.sample = real_sample  # type: ignore[method-assign]
        wall = time.perf_counter() - start
        r = report_mod.build(rt, recorder, "timed", wall, label)
        check(
            label, r["plugins"]["kv_pool"] == pool[("kv_pool", "plugin")], f"kv_pool plugin {r['plugins']['kv_pool']!r}"
        )
        check(label, (r["compaction"]["rounds"] > 0) == compacting, f"{r['compaction']['rounds']} compaction rounds")
        check(label, len(counts) == r["requests"], f"{len(counts)} finishes seen of {r['requests']} requests")
        check(
            label, tally[0] == recorder.used_block_samples, f"{tally[0]} samples seen of {recorder.used_block_samples}"
        )
        check(label, (tally[6] > 0) == reserving, f"reserved blocks, of the pool (mean) {tally[6] / tally[0]:.5f}")
        print(
            f"| {label} | {statistics.mean(counts):.2f} | {p99(counts)} | {statistics.mean(own):.2f} | {p99(own)} |"
            f" {statistics.mean(sizes):.1f} | {r['pool_fragmentation_mean']:.4f} | {r['pool_utilisation_mean']:.4f} |"
            f" {r['compaction']['moved_blocks']:,} | {hook_p50(r, 'sagellm_allocate_blocks')} |"
            f" {hook_p50(r, 'sagellm_free_blocks')} | {hook_p50(r, 'sagellm_plan_compaction')} | {wall:.2f} |"
            f" {tally[1] / tally[0]:.3f} | {tally[2] / tally[0]:.4f} | {tally[3] / tally[0]:.5f} |"
            f" {tally[4] / tally[0]:.4f} | {tally[5] / tally[0]:.4f} | {tally[6] / tally[0]:.5f} |"
            f" {r['block_hit_rate']:.4f} | {r['preemptions']:,} |",
            flush=True,
        )
    print()


# ------------------------------------------------------------------ latency --

#: The rows of the decision-latency table: the default workload with ``footprint`` admission.
LATENCY_POOLS = [
    ("paged", {("kv_pool", "plugin"): "paged"}),
    ("runs", {("kv_pool", "plugin"): "runs"}),
    ("buddy", {("kv_pool", "plugin"): "buddy"}),
    ("runs, reserve 24", {("kv_pool", "plugin"): "runs", ("kv_pool", "reserve"): 24}),
    (
        "runs, reserve 24 predicted",
        {("kv_pool", "plugin"): "runs", ("kv_pool", "reserve"): 24, ("kv_pool", "reserve_predicted"): True},
    ),
]
LATENCY_HOOKS = [
    ("allocation", "sagellm_allocate_blocks"),
    ("free", "sagellm_free_blocks"),
    ("admission, `footprint`", "sagellm_admit_request"),
]


def latency(args) -> None:
    """The pools' decision latencies (the hook table: each call timed by the
    hook dispatch) on the default workload, every row in this process; then
    the ``runs`` pool's free against the free as it was, over one recorded
    sequence of calls."""
    print(f"`python3 benchmarks/kv_pool.py latency --requests {args.requests}`\n")
    print("| decision | pool | calls | p50 (µs) | mean (µs) | p99 (µs) | p50 over `paged`'s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    rows = []
    for label, pool in LATENCY_POOLS:
        overrides = {("admission", "plugin"): "footprint", **pool}
        settings = session.load_settings(ROOT / "sagellm_core" / "default.toml", overrides=overrides)
        result = session.run(settings, label=label)
        r, rt = result.report, result.runtime
        check(
            label, r["plugins"]["kv_pool"] == pool[("kv_pool", "plugin")], f"kv_pool plugin {r['plugins']['kv_pool']!r}"
        )
        check(
            label, r["plugins"].get("admission") == "footprint", f"admission plugin {r['plugins'].get('admission')!r}"
        )
        reserving = pool.get(("kv_pool", "reserve"), 0) > 0
        check(label, rt.reserves == reserving, f"the runtime keeps reserved blocks free: {rt.reserves}")
        if reserving:  # the pool answered how many it keeps, and kept some (the runtime asks it when it evicts)
            kept = r["hooks"].get("sagellm_reserved_blocks", {}).get("calls", 0)
            check(label, kept > 0, "the pool was never asked how many blocks it keeps")
        predicted = pool.get(("kv_pool", "reserve_predicted"), False)
        arrived = r["hooks"].get("sagellm_request_arrived", {}).get("calls", 0)
        check(label, (arrived == r["requests"]) if predicted else True, f"{arrived} predictions seen")
        rows.append((label, r["hooks"]))
    base = rows[0][1]
    for name, hook in LATENCY_HOOKS:
        for label, hooks in rows:
            st = hooks[hook]
            print(
                f"| {name} (`{hook}`) | `{label}` | {st['calls']:,} | {st['p50_us']:.2f} | {st['mean_us']:.2f} |"
                f" {st['p99_us']:.2f} | {ratio(st['p50_us'], base[hook]['p50_us'])} |"
            )
    print()
    replayed_free(args)


class PerBlockFree:
    """The ``runs`` pool's free as it was: each block id checked, the ids split
    into runs and looked up among the requests' last blocks one at a time,
    in Python. The baseline of the recorded-sequence rows."""

    @staticmethod
    def free(pool, block_ids) -> bool:
        num_blocks, is_free = pool.num_blocks, pool._is_free
        for block_id in block_ids:
            if not (type(block_id) is int and 0 <= block_id < num_blocks):
                raise ValueError(f"block {block_id!r} is out of range 0..{num_blocks - 1}")
            if is_free[block_id]:
                raise ValueError(f"block {block_id} is freed twice")
        ordered = sorted(block_ids)
        if any(a == b for a, b in zip(ordered, ordered[1:])):
            raise ValueError(f"blocks {list(block_ids)} contain duplicates")
        tails, gone = pool._tails, []
        for block_id in ordered:
            request_id = tails._owner.pop(block_id, None)
            if request_id is not None:
                del tails._tail[request_id]
                gone.append(request_id)
        for request_id in gone:
            pool._drop_reservation(request_id)
        i = 0
        while i < len(ordered):
            j = i + 1
            while j < len(ordered) and ordered[j] == ordered[j - 1] + 1:
                j += 1
            pool._give_back(ordered[i], j - i)
            i = j
        pool._usage = None
        return True


def replayed_free(args) -> None:
    """Record every call the runtime makes to a ``runs`` pool with
    ``reserve = 24`` in a timed Mooncake replay, then make the same calls,
    in order, on two fresh pools: one frees as the plugin does now, the
    other as it did (``PerBlockFree``), alternately call by call. Each
    allocation must give both what it gave in the replay, and both pools
    must end with the same free runs."""
    from sagellm_plugin_kv_pool.runs import RunsPool

    calls: list[tuple[str, dict, object]] = []
    built: list = []
    names = [n for n in dir(RunsPool) if n.startswith("sagellm_")]
    originals = {n: getattr(RunsPool, n) for n in names}
    real_init = RunsPool.__init__

    def recording(name, method):
        argnames = method.__code__.co_varnames[1 : method.__code__.co_argcount]

        @functools.wraps(method)  # (keeps the hookimpl marker)
        def record(self, *args, **kwargs):
            kwargs.update(zip(argnames, args))
            result = method(self, **kwargs)
            calls.append((name, kwargs, result))
            return result

        return record

    def init(self, settings, context):
        built.append((settings, context))
        real_init(self, settings, context)

    overrides = {("kv_pool", "plugin"): "runs", ("kv_pool", "reserve"): 24, ("workload", "max_requests"): args.requests}
    settings = session.load_settings(CONFIGS / "mooncake-timed.toml", overrides=overrides)
    try:
        RunsPool.__init__ = init  # type: ignore[method-assign]
        for n in names:
            setattr(RunsPool, n, recording(n, originals[n]))
        session.run(settings, label="recorded")
    finally:
        RunsPool.__init__ = real_init  # type: ignore[method-assign]
        for n in names:
            setattr(RunsPool, n, originals[n])
    check("recorded", len(built) == 1, f"{len(built)} runs pools built")
    # The same replay without reservations, its frees counted: a decoding
    # request's growth in a full pool evicts one cached block a call.
    unreserved: list[int] = []
    free = originals["sagellm_free_blocks"]

    @functools.wraps(free)
    def counted(self, block_ids):
        unreserved.append(len(block_ids))
        return free(self, block_ids)

    try:
        RunsPool.sagellm_free_blocks = counted  # type: ignore[method-assign]
        plain = session.run(
            session.load_settings(CONFIGS / "mooncake-timed.toml", overrides={**overrides, ("kv_pool", "reserve"): 0}),
            label="runs",
        )
    finally:
        RunsPool.sagellm_free_blocks = free  # type: ignore[method-assign]
    check("runs", not plain.runtime.reserves, "the replay without reservations kept blocks free")
    check("runs", len(unreserved) > 0, "no free counted")
    frees = sum(1 for name, _, _ in calls if name == "sagellm_free_blocks")
    check("recorded", frees > 0, "no free recorded")
    now, was = RunsPool(*built[0]), RunsPool(*built[0])
    times: dict[str, dict[str, list[float]]] = {
        label: {"sagellm_free_blocks": [], "sagellm_allocate_blocks": []} for label in ("now", "was")
    }
    sizes = []
    clock = time.perf_counter
    for k, (name, kwargs, result) in enumerate(calls):
        if name == "sagellm_free_blocks":
            sizes.append(len(kwargs["block_ids"]))
        order = (("now", now), ("was", was)) if k % 2 else (("was", was), ("now", now))
        for label, pool in order:
            if name == "sagellm_free_blocks" and label == "was":
                t = clock()
                PerBlockFree.free(pool, **kwargs)
                times[label][name].append(clock() - t)
                continue
            t = clock()
            got = getattr(pool, name)(**kwargs)
            elapsed = clock() - t
            if name in times[label]:
                times[label][name].append(elapsed)
            if name == "sagellm_allocate_blocks":
                check(f"runs, reserve 24 ({label})", got == result, f"call {k} allocated {got}, not {result}")
    check("runs, reserve 24", dict(now._length) == dict(was._length), "the two pools end with different free runs")
    check("runs, reserve 24", now._reserved == was._reserved, "the two pools end with different reservations")
    print(
        f"The same {len(calls):,} calls to `runs` with `reserve = 24` (recorded from a timed replay of the first"
        f" {args.requests} Mooncake requests), made directly on two fresh pools, alternately: {frees:,} frees of"
        f" {statistics.median(sizes):.0f} blocks at the median ({statistics.mean(sizes):.1f} mean), and the"
        f" allocations between them. Without reservations the same replay makes {len(unreserved):,} frees,"
        f" {sum(n == 1 for n in unreserved):,} of them of one block ({statistics.median(unreserved):.0f} at the"
        f" median).\n"
    )
    print("| decision | free | p50 (µs) | mean (µs) | p99 (µs) | p50 over the free as it was |")
    print("|---|---|---:|---:|---:|---:|")
    for name, what in (("sagellm_free_blocks", "free"), ("sagellm_allocate_blocks", "allocation")):
        base = statistics.median(times["was"][name])
        for label, words in (("was", "as it was (per block, in Python)"), ("now", "now (per run)")):
            us = [t * 1e6 for t in times[label][name]]
            p50 = statistics.median(us)
            print(
                f"| {what} (`{name}`) | {words} | {p50:.2f} | {statistics.mean(us):.2f} |"
                f" {sorted(us)[min(len(us) - 1, int(0.99 * len(us)))]:.2f} | {ratio(p50, base * 1e6)} |"
            )
    print()


# ------------------------------------------------------------------- offload --


def offload(args) -> None:
    import torch
    from sagellm_plugin_torch.devices import BLOCK_DIM, copy_runs, load_device, run_view

    device = load_device(args.device)
    layers, kv_heads, head_dim, block_size = 30, 3, 64, 16  # SmolLM2-135M
    num_blocks = 4 * (args.tokens // block_size + 1) + 64
    kv = device.allocate_kv(layers, num_blocks, block_size, kv_heads, head_dim, torch.float32)
    kv.normal_()
    n = args.tokens // block_size
    # Host memory laid out as the host store's rows (block-major, pinned on
    # a GPU), seen through the KV tensor's block dimension, as the engine copies.
    per_block = tuple(kv.shape[:BLOCK_DIM]) + tuple(kv.shape[BLOCK_DIM + 1 :])
    rows = torch.empty((n, *per_block), dtype=kv.dtype, pin_memory=kv.is_cuda)
    host = rows.movedim(0, BLOCK_DIM)
    run = list(range(7, 7 + n))
    scattered = list(range(3, 3 + 4 * n, 4))  # every fourth block: no two adjacent
    slots = list(range(n))

    def timed(fn) -> float:
        times = []
        for _ in range(args.repeat):
            device.synchronize()
            start = time.perf_counter()
            fn()
            device.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def one_call(ids, back=False):
        return lambda: device.copy_blocks(host, slots, kv, ids) if back else device.copy_blocks(kv, ids, host, slots)

    def per_block(ids, back=False):
        def copy():
            for slot, b in zip(slots, ids):
                if back:
                    device.copy_blocks(host, [slot], kv, [b])
                else:
                    device.copy_blocks(kv, [b], host, [slot])

        return copy

    def slice_copy(back=False):  # the run as one slice of each layer's K and V: what a run allows a copy to do
        def copy():
            part, rows_part = run_view(kv, run[0], n), run_view(host, 0, n)
            if back:
                part.copy_(rows_part, non_blocking=True)
            else:
                rows_part.copy_(part, non_blocking=True)

        return copy

    nbytes = host.numel() * host.element_size()
    print(
        f"`python3 benchmarks/kv_pool.py offload --device {args.device} --tokens {args.tokens} --repeat {args.repeat}`"
        f" ({device.__class__.__name__}, {torch.__version__}; {n} blocks of {block_size} tokens,"
        f" {nbytes / 2**20:.1f} MiB; median of {args.repeat})\n"
    )
    print("| copy | offload (ms) | vs scattered, one call | reload (ms) | vs scattered, one call | offload GB/s |")
    print("|---|---:|---:|---:|---:|---:|")

    def blocks(ids) -> torch.Tensor:
        return kv.index_select(BLOCK_DIM, torch.tensor(ids, device=kv.device)).cpu()

    cases = [
        ("scattered blocks, one copy_blocks call", scattered, one_call(scattered), one_call(scattered, True)),
        ("one run, one copy_blocks call", run, one_call(run), one_call(run, True)),
        ("scattered blocks, a call per block", scattered, per_block(scattered), per_block(scattered, True)),
        ("one run, a call per block", run, per_block(run), per_block(run, True)),
        ("one run, one slice copy", run, slice_copy(), slice_copy(True)),
    ]
    # The run's rows are copied as one run each way, the scattered ones gathered.
    check("one run", copy_runs(kv, run, host, slots) == [(run[0], 0, n)], "copy_blocks would not copy it as one run")
    check("one run", copy_runs(host, slots, kv, run) == [(0, run[0], n)], "copy_blocks would not reload it as one run")
    check("scattered", copy_runs(kv, scattered, host, slots) is None, "copy_blocks would not gather the blocks")
    base = None
    for label, ids, out, back in cases:
        t_out = timed(out)
        check(label, torch.equal(host, blocks(ids)), "the host copy is not the blocks' KV")
        host.add_(1.0)  # a reload that copied nothing would leave the blocks unequal to it
        t_back = timed(back)
        check(label, torch.equal(blocks(ids), host), "the blocks' KV is not the host copy after the reload")
        base = base or (t_out, t_back)
        print(
            f"| {label} | {t_out * 1e3:.2f} | {ratio(t_out, base[0])} | {t_back * 1e3:.2f} | {ratio(t_back, base[1])} |"
            f" {nbytes / t_out / 1e9:.2f} |",
            flush=True,
        )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = parser.add_subparsers(dest="part", required=True)
    p = parts.add_parser("admission")
    p.add_argument("--max-requests", type=int, default=4000)
    p.add_argument(
        "--rules",
        nargs="+",
        type=admission_rule,
        default=["greedy", "sum:0.5", "sum:0.9", "peak:0.5", "peak:0.9"],
        help="the rows of each pool: greedy, or DEMAND:QUANTILE[:HOLD_S] (footprint, demand sum or peak)",
    )
    p.set_defaults(func=admission)
    p = parts.add_parser("quotas")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0])
    p.add_argument("--caps", type=float, nargs="+", default=[0.25])
    p.add_argument("--step-caps", type=float, nargs="*", default=[0.125, 0.03125])
    p.add_argument(
        "--contended-caps",
        type=float,
        nargs="*",
        default=[],
        help="rows with each step cap and the documents' cap in a step where a chat tenant prefills, besides",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="the workload's seeds, pooled in each row")
    p.add_argument("--order", default="fcfs", choices=["fcfs", "prefix-aware"], help="the first pass of every row")
    p.add_argument(
        "--steps", action="store_true", help="the replay's steps around each chat tenant's slowest turn, besides"
    )
    p.add_argument(
        "--alone-blocks", type=int, nargs="*", default=[3840], help="pool sizes for the chat tenants alone, besides"
    )
    p.set_defaults(func=quotas)
    p = parts.add_parser("contiguity")
    p.add_argument("--config", default="contrib/configs/mooncake-timed.toml")
    p.add_argument("--blocks", type=int, default=30000)
    p.add_argument("--max-requests", type=int, default=2000)
    p.add_argument("--pools", nargs="*", help="only the rows with these labels")
    p.add_argument("--lifetime", help="the lifetime predictor of the rows that do not name one (default: the config's)")
    p.set_defaults(func=contiguity)
    p = parts.add_parser("latency")
    p.add_argument("--requests", type=int, default=500, help="Mooncake requests whose pool calls are recorded")
    p.set_defaults(func=latency)
    p = parts.add_parser("offload")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=20)
    p.set_defaults(func=offload)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
