import json

import pytest

from sagellm_core.cli import main

SMALL = ["--max-requests", "30", "--quiet"]


def test_replay_default_writes_json_markdown_and_plot(tmp_path, capsys):
    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    png = tmp_path / "r.png"
    assert main(["replay", *SMALL, "--json", str(out), "--markdown", str(md), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    for key in ("block_hit_rate", "token_hit_rate", "tokens_saved", "reprefill_tokens", "evicted_blocks",
                "preemptions", "pool_utilisation_mean", "ttft_s", "tpot_s", "throughput_tokens_per_s",
                "lifetime_mae", "hooks"):
        assert key in report
    assert report["requests"] == 30
    assert report["hooks"]["sagellm_acquire_prefix"]["calls"] >= 30
    assert "| block hit rate |" in md.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_prints_a_table(capsys):
    assert main(["replay", "--max-requests", "10"]) == 0
    out = capsys.readouterr().out
    assert "block hit rate" in out and "acquire_prefix" in out


def test_compare_side_by_side(tmp_path, capsys):
    a = tmp_path / "lru.toml"
    b = tmp_path / "lfu.toml"
    base = '[engine]\nmode = "cache-only"\n[prefix_cache]\nplugin = "radix"\n[kv_pool]\nplugin = "paged"\nnum_blocks = 300\n'
    a.write_text(base + '[eviction]\nplugin = "lru"\n')
    b.write_text(base + '[eviction]\nplugin = "lfu"\n')
    out = tmp_path / "c.json"
    assert main(["compare", "--config", str(a), "--config", str(b), "--json", str(out), "--quiet"]) == 0
    reports = json.loads(out.read_text())
    assert [r["label"] for r in reports] == ["lru", "lfu"]
    assert reports[0]["requests"] == reports[1]["requests"]
    table = capsys.readouterr().out
    assert "lru" in table and "lfu" in table


def test_compare_refuses_different_workloads(tmp_path, capsys):
    a = tmp_path / "a.toml"
    b = tmp_path / "b.toml"
    base = '[kv_pool]\nplugin = "paged"\nnum_blocks = 300\n[workload]\nseed = {}\n'
    a.write_text(base.format(1))
    b.write_text(base.format(2))
    assert main(["compare", "--config", str(a), "--config", str(b), "--quiet"]) == 2
    assert f"{b}: [workload] differs from {a}'s; compare replays one workload" in capsys.readouterr().err


def test_plugins_lists_every_first_party_plugin(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for name in ("replay", "radix", "paged", "lru", "lfu", "fcfs", "prefix-aware", "stat", "local"):
        assert name in out
    assert "sagellm-plugin-eviction" in out and "select_victims" in out


def test_config_check(tmp_path, capsys):
    assert main(["config", "check", "contrib/configs/mooncake-lru.toml"]) == 0
    assert "ok (engine replay; prefix_cache=radix, kv_pool=paged, eviction=lru)" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text('[kv_pool]\nplugin = "paged"\nnum_blocks = 8\n[eviction]\nplugin = "belady2"\n')
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"sagellm: error: {bad}: [eviction]: unknown eviction plugin 'belady2'; installed: ")
    assert err.endswith("(first-party eviction plugins: pip install sagellm-plugin-eviction)")
    assert "\n" not in err


def test_bad_trace_line_is_one_line_on_the_command_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n{"timestamp": 1,\n')
    assert main(["replay", "--trace", str(trace), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"sagellm: error: {trace}:2: not a JSON object") and "\n" not in err


def test_hooks_reference_documents_every_hook(capsys):
    assert main(["hooks"]) == 0
    out = capsys.readouterr().out
    assert "## `sagellm_select_victims(num_blocks: 'int', candidates: 'EvictionCandidates')" in out
    assert out.count("*decision (firstresult)*") >= 12


def test_committed_hook_reference_is_current(capsys):
    """docs/hooks.md is `sagellm hooks` output; regenerate it when a hookspec changes."""
    from pathlib import Path

    main(["hooks"])
    generated = capsys.readouterr().out
    committed = (Path(__file__).resolve().parents[2] / "docs" / "hooks.md").read_text()
    assert committed == generated
