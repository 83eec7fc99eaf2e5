"""Hypothesis strategies for hostile input in every format sagellm reads:
Mooncake JSON lines, Azure CSV rows, ShareGPT records, TOML configs and
command-line arguments. Each mixes sound records (so that some cases run
to a report) with hostile values: wrong types, non-finite and huge numbers,
binary bytes, byte-order marks, over-long fields, deep nesting."""

from __future__ import annotations

import json
import math

import hypothesis.strategies as st

MAX_TOKENS = 1 << 22
BLOCK = 16  # trace_block_tokens of the trace configs

hostile_ints = st.sampled_from([0, -1, -(2**63), 2**31, 2**32, 2**62, 2**63, 2**64, 10**30, MAX_TOKENS + 1])
hostile_floats = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, -1e308, 5e-324, 0.5, 1e30])
hostile_scalars = st.one_of(
    hostile_ints,
    hostile_floats,
    st.booleans(),
    st.none(),
    st.text(max_size=6),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
garbage_lines = st.one_of(
    st.sampled_from(["{", "[]", "null", '"x"', "\x00\x01", "{}", '{"timestamp": 1,', "1e999", "\ufeff{}"]),
    st.integers(10, 100_000).map(lambda depth: "[" * depth + "]" * depth),
    st.binary(min_size=1, max_size=40).map(lambda b: b.decode("latin-1")),
)


@st.composite
def mooncake_record(draw, timestamp):
    n = draw(st.integers(1, 120))
    record = {
        "timestamp": timestamp,
        "input_length": n,
        "output_length": draw(st.integers(1, 40)),
        "hash_ids": draw(st.lists(st.integers(0, 40), min_size=-(-n // BLOCK), max_size=-(-n // BLOCK))),
    }
    if draw(st.booleans()):
        record[draw(st.sampled_from(["session", "tenant", "cache_salt", "session_id"]))] = draw(
            st.one_of(st.text(max_size=4), st.integers(0, 9))
        )
    return record


@st.composite
def mooncake_trace(draw):
    """(bytes of a Mooncake JSONL trace, the requests it holds if sound)."""
    lines, sound, t = [], True, 0
    for _ in range(draw(st.integers(1, 12))):
        t += draw(st.integers(0, 2000))
        record = draw(mooncake_record(t))
        kind = draw(st.sampled_from(["sound"] * 6 + ["value", "drop", "garbage", "hashes", "long"]))
        if kind == "value":
            record[draw(st.sampled_from(sorted(record)))] = draw(hostile_scalars)
        elif kind == "drop":
            record.pop(draw(st.sampled_from(sorted(record))))
        elif kind == "hashes":
            record["hash_ids"] = draw(st.lists(st.one_of(hostile_ints, st.integers(0, 9)), max_size=9))
        if kind == "garbage":
            line = draw(garbage_lines)
        elif kind == "long":
            line = json.dumps(record)[:-1] + ', "pad": "' + "x" * 20000 + '"}'
        else:
            line = json.dumps(record)  # NaN and Infinity as Python writes them: not JSON
        sound = sound and kind in ("sound", "long")
        lines.append(line)
    text = "\n".join(lines) + draw(st.sampled_from(["\n", "", "\n\n"]))
    prefix = draw(st.sampled_from([b"", b"", b"\xef\xbb\xbf"]))
    return prefix + text.encode("utf-8", "surrogatepass"), len(lines) if sound else None


def _azure_time(draw, second: int) -> str:
    # The fraction grows with the second: arrivals never go backwards.
    return f"2023-11-16 18:{second // 60 % 60:02d}:{second % 60:02d}.{second % 10:07d}"


@st.composite
def azure_trace(draw):
    """(bytes of an Azure CSV trace, the requests it holds if sound)."""
    header = "TIMESTAMP,ContextTokens,GeneratedTokens"
    sound = True
    if draw(st.integers(0, 9)) == 0:
        header, sound = draw(st.sampled_from(["", "timestamp,context,generated", "TIMESTAMP;ContextTokens"])), False
    rows, second = [], 0
    for _ in range(draw(st.integers(0, 12))):
        second += draw(st.integers(0, 3))
        cells = [_azure_time(draw, second), str(draw(st.integers(1, 200))), str(draw(st.integers(1, 40)))]
        kind = draw(st.sampled_from(["sound"] * 6 + ["cell", "short", "extra", "quote", "huge"]))
        if kind == "cell":
            value = draw(
                st.one_of(st.sampled_from(["", "true", "1.5", "-3", "0", "1e9", "nan", "\x00", "10" * 12]), st.text())
            )
            cells[draw(st.integers(0, 2))] = value.replace("\n", " ").replace("\r", " ")  # one row stays one row
        elif kind == "short":
            cells = cells[: draw(st.integers(0, 2))]
        elif kind == "extra":
            cells.append(draw(st.text(max_size=5)).replace("\n", " ").replace("\r", " ").replace('"', ""))
        elif kind == "quote":
            cells[1] = '"' + cells[1]
        elif kind == "huge":
            cells[2] = '"' + "1" * 200_000 + '"'
        sound = sound and kind in ("sound", "extra")
        rows.append(",".join(cells))
    text = "\n".join([header, *rows]) + "\n"
    prefix = draw(st.sampled_from([b"", b"", b"\xef\xbb\xbf"]))
    return prefix + text.encode("utf-8", "surrogatepass"), len(rows) if sound else None


@st.composite
def sharegpt_records(draw):
    """The bytes of a ShareGPT V3 JSON list with some malformed records."""
    items = []
    for i in range(draw(st.integers(1, 5))):
        messages = []
        for j in range(draw(st.integers(0, 4))):
            message = {"from": "human" if j % 2 == 0 else "gpt", "value": draw(st.text(min_size=1, max_size=30))}
            if draw(st.integers(0, 6)) == 0:
                message[draw(st.sampled_from(["from", "value"]))] = draw(hostile_scalars)
            messages.append(message if draw(st.integers(0, 9)) else draw(hostile_scalars))
        item = {"id": f"c{i}", "conversations": messages}
        if draw(st.integers(0, 7)) == 0:
            item = draw(st.sampled_from([[], "x", 3, None, {"id": 1, "conversations": "hi"}]))
        items.append(item)
    return json.dumps(items).encode()


# ----------------------------------------------------------------- configs --

#: A sound, small config: a replay of a few dozen requests in milliseconds.
BASE = {
    "engine": {"name": "replay", "mode": "cache-only"},
    "workload": {"tenants": 2, "sessions_per_tenant": 2, "turns": 2, "system_prompt_tokens": 64, "user_tokens": 16},
    "prefix_cache": {"plugin": "radix", "block_size": 16},
    "kv_pool": {"plugin": "paged", "num_blocks": 64},
    "eviction": {"plugin": "lru"},
}
#: Keys a mutation may set, by section.
KEYS = {
    "engine": ["name", "mode", "hardware", "model", "max_num_batched_tokens", "max_num_seqs", "flops_efficiency"],
    "workload": [
        "source",
        "path",
        "trace_block_tokens",
        "max_requests",
        "time_scale",
        "session_from",
        "session_to",
        "ttft_slo_s",
        "seed",
        "tenants",
        "sessions_per_tenant",
        "tenant_skew",
        "turns",
        "system_prompt_tokens",
        "user_tokens",
        "output_tokens",
        "session_rate",
        "think_time_s",
        "hints",
        "hints_wrong",
        "hints_missing",
        "document_rate",
        "document_tokens",
        "document_turns",
    ],
    "prefix_cache": ["plugin", "block_size", "pin_after_hits", "max_pinned_share", "isolate", "events"],
    "kv_pool": ["plugin", "num_blocks", "compact", "max_fragmentation", "max_moves", "min_steps_between", "moves"],
    "eviction": ["plugin"],
    "lifetime": ["plugin", "fallback"],
    "scheduler": ["passes"],
    "admission": ["plugin", "guarantees", "caps", "lend", "quantile", "max_wait_s", "default_output_tokens"],
    "transport": ["plugin", "host_blocks", "bytes_per_block"],
    # "host": the host store's own table ([kv_stores.host]): its rules among its parameters.
    "kv_stores": ["tiers", "bytes_per_block", "host"],
    "report": ["hook_timing"],
    "limits": ["hook_time_limit_s"],
    "server": ["max_waiting"],
}
#: A store's table: the runtime's write rules and the store's eviction policy among its parameters.
store_tables = st.dictionaries(
    st.sampled_from(["write", "write_on", "eviction", "capacity_blocks"]),
    st.one_of(
        hostile_scalars, st.sampled_from(["all", "reused", "eviction", "through", "lru", "lfu", "belady", "nope", ""])
    ),
    max_size=4,
)
#: A ``[scheduler.tenant-shares]`` table: shares, caps and contended caps
#: of any contents, or of fractions (sound or contradicting each other).
_fractions = st.sampled_from([0.0, 0.01, 0.25, 0.5, 1.0])
_tenant_fractions = st.dictionaries(st.sampled_from(["tenant-0", "tenant-1", "docs"]), _fractions, max_size=2)
share_tables = st.one_of(
    st.dictionaries(
        st.sampled_from(["shares", "caps", "contended_caps", "unknown_key"]),
        st.one_of(
            hostile_scalars,
            st.dictionaries(
                st.sampled_from(["tenant-0", "", "docs"]), st.one_of(hostile_scalars, _fractions), max_size=3
            ),
        ),
        max_size=3,
    ),
    st.fixed_dictionaries(
        {}, optional={"shares": _tenant_fractions, "caps": _tenant_fractions, "contended_caps": _tenant_fractions}
    ),
)
config_values = st.one_of(
    hostile_scalars,
    st.sampled_from(
        [
            *("radix", "lru", "LRU", "paged", "runs", "buddy", "gather", "quota", "footprint", "noisy-neighbour"),
            *("../../etc/passwd", "events.jsonl", "/tmp/x", "generator"),
        ]
    ),
    st.lists(st.sampled_from(["fcfs", "sjf", "tenant-shares", "nope", "", "host", "disk"]), max_size=3),
    st.dictionaries(st.sampled_from(["tenant-0", "", "docs"]), hostile_scalars, max_size=3),
    store_tables,
)


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string is JSON's, for these
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    if value is None:
        return '""'
    raise TypeError(value)


def toml_text(config: dict) -> str:
    lines = []
    for section, table in config.items():
        if not isinstance(table, dict):
            lines.append(f"{section} = {toml_value(table)}")
            continue
        lines.append(f"[{section}]")
        lines += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


@st.composite
def config_file(draw):
    """The bytes of a config: the sound base with a few hostile changes, or
    bytes no config parser should choke on."""
    kind = draw(st.sampled_from(["mutated"] * 8 + ["binary", "nested", "bom"]))
    if kind == "binary":
        return draw(st.binary(max_size=200))
    if kind == "nested":
        depth = draw(st.integers(100, 20000))
        return f"x = {'[' * depth}{']' * depth}\n".encode()
    config = {section: dict(table) for section, table in BASE.items()}
    for _ in range(draw(st.integers(1, 3))):
        section = draw(st.sampled_from(sorted(KEYS) + ["nonsense"]))
        if section == "nonsense" or draw(st.integers(0, 15)) == 0:
            config[section] = draw(hostile_scalars) if draw(st.booleans()) else {}
            continue
        table = config.setdefault(section, {})
        if not isinstance(table, dict):
            continue
        key = draw(st.sampled_from(KEYS[section] + ["unknown_key"]))
        table[key] = draw(config_values)
    text = toml_text(config).encode()
    return (b"\xef\xbb\xbf" + text) if kind == "bom" else text


# -------------------------------------------------------------------- argv --

flag_values = st.one_of(
    st.sampled_from(["0", "-1", "3", "abc", "", "1e3", "99999999999999999999", "3.5", " 2"]),
    st.text(max_size=8).filter(lambda s: "\x00" not in s),
)
path_values = st.sampled_from(
    [
        "{tmp}/report.json",
        "{tmp}/missing/report.json",
        "{tmp}",
        "{tmp}/plot.txt",
        "{tmp}/plot.png",
        "{tmp}/table.md",
        "/proc/version",
        "",
    ]
)


@st.composite
def replay_argv(draw):
    """``sagellm replay`` with a few hostile options (the config is added by the test)."""
    argv = ["replay"]
    for _ in range(draw(st.integers(0, 4))):
        option = draw(
            st.sampled_from(["--max-requests", "--set", "--json", "--markdown", "--plot", "--trace", "--bogus", "-x"])
        )
        if option == "--max-requests":
            argv += [option, draw(flag_values)]
        elif option == "--set":
            argv += [option, draw(st.sampled_from(["workload.turns=0", "kv_pool.num_blocks=1e999", "a=b", "x", ""]))]
        elif option in ("--json", "--markdown", "--plot"):
            argv += [option, draw(path_values)]
        elif option == "--trace":
            argv += [option, draw(st.sampled_from(["{tmp}", "{tmp}/none.jsonl", "/proc/version", "x.csv"]))]
        else:
            argv.append(option)
    return argv
