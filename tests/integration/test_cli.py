import json
import tomllib
from pathlib import Path

import pytest

from sagellm_core.cli import README_TABLE_MARK, installed_plugins, main, plugin_table

SMALL = ["--max-requests", "30", "--quiet"]


def test_replay_default_writes_json_markdown_and_plot(tmp_path, capsys):
    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    png = tmp_path / "r.png"
    assert main(["replay", *SMALL, "--json", str(out), "--markdown", str(md), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    for key in (
        "block_hit_rate",
        "token_hit_rate",
        "tokens_saved",
        "reprefill_tokens",
        "evicted_blocks",
        "preemptions",
        "pool_utilisation_mean",
        "ttft_s",
        "tpot_s",
        "throughput_tokens_per_s",
        "lifetime_mae",
        "hooks",
    ):
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
    assert capsys.readouterr().out == ""  # --quiet: no progress bar, no table
    reports = json.loads(out.read_text())
    assert [r["label"] for r in reports] == ["lru", "lfu"]
    assert reports[0]["requests"] == reports[1]["requests"]
    assert main(["compare", "--config", str(a), "--config", str(b)]) == 0
    table = capsys.readouterr().out
    assert "lru" in table and "lfu" in table


def test_sweep_in_worker_processes_gives_the_figures_of_one_process(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(
        '[engine]\nmode = "cache-only"\n[prefix_cache]\nplugin = "radix"\n'
        '[kv_pool]\nplugin = "paged"\nnum_blocks = 100\n[eviction]\nplugin = "lru"\n'
    )
    figures = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}.json"
        args = ["sweep", "--config", str(config), "--set", "kv_pool.num_blocks=150,400,900", "--workers", str(workers)]
        assert main([*args, "--max-requests", "60", "--quiet", "--json", str(out)]) == 0
        reports = json.loads(out.read_text())
        figures[workers] = [
            (r["sweep"]["value"], r["block_hit_rate"], r["evicted_blocks"], r["ttft_s"]) for r in reports
        ]
    assert [value for value, *_ in figures[2]] == [150, 400, 900]
    assert figures[2] == figures[1]
    assert figures[1][0][1] < figures[1][2][1]  # the runs differ: each got its own value


def test_workers_must_be_at_least_one(tmp_path, capsys):
    a = tmp_path / "a.toml"
    a.write_text('[kv_pool]\nplugin = "paged"\nnum_blocks = 300\n')
    assert main(["compare", "--config", str(a), "--config", str(a), "--workers", "0", "--quiet"]) == 2
    assert "--workers 0: a whole number of processes, at least 1" in capsys.readouterr().err


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


@pytest.mark.parametrize("config", sorted(str(p) for p in Path("contrib/configs").glob("mooncake-*.toml")))
def test_every_mooncake_config_checks(config):
    assert main(["config", "check", config]) == 0


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


def test_config_check_prints_every_setting_as_resolved(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('[engine]\nmode = "cache-only"\n[kv_pool]\nplugin = "paged"\nnum_blocks = 300\n')
    assert main(["config", "check", str(path), "--set", "engine.max_num_seqs=7", "--set", "workload.tenants=3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{path}: ok (engine replay; kv_pool=paged)"
    (engine,) = [line for line in lines if line.startswith("  engine 'replay': ")]
    assert "'mode': 'cache-only'" in engine and "'max_num_seqs': 7" in engine and "'hardware': 'h100'" in engine
    assert "  num_blocks: 300" in lines and "  block_size: 16" in lines
    assert any(line.startswith("  workload: {'source': 'generator'") and "'tenants': 3" in line for line in lines)


def test_a_pool_sized_auto_is_refused_by_an_engine_that_does_not_size_it(tmp_path, capsys):
    path = tmp_path / "auto.toml"
    path.write_text('[kv_pool]\nplugin = "paged"\nnum_blocks = "auto"\n')
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"sagellm: error: {path}: [kv_pool] num_blocks = \"auto\": engine 'replay' does not size the pool itself;"
        " give a number of blocks"
    )


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


def test_the_readme_plugin_table_is_sagellm_plugins_markdown():
    """README.md's plugin table is `sagellm plugins --markdown` (in a .venv
    with this repository's distributions): regenerate it when an entry point
    or a distribution's description changes."""
    root = Path(__file__).resolve().parents[2]
    projects = [root / "pyproject.toml", *root.glob("plugins/*/pyproject.toml"), *root.glob("contrib/*/pyproject.toml")]
    ours = {tomllib.loads(p.read_text())["project"]["name"] for p in projects}
    plugins = [p for p in installed_plugins() if p.distribution in ours]
    if missing := ours - {p.distribution for p in plugins}:
        pytest.skip(f"not installed here: {', '.join(sorted(missing))}")
    readme = (root / "README.md").read_text().splitlines()
    start = readme.index(README_TABLE_MARK) + 1
    end = next(i for i in range(start, len(readme)) if not readme[i].startswith("|"))
    assert "\n".join(readme[start:end]) + "\n" == plugin_table(plugins)


def test_plugins_as_json_and_markdown(capsys):
    assert main(["plugins", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    lru = next(p for p in listed if (p["group"], p["name"]) == ("sagellm.eviction", "lru"))
    assert lru["distribution"] == "sagellm-plugin-eviction" and "select_victims" in lru["hooks"]
    assert lru["problem"] is None and lru["summary"].startswith("sagellm eviction policies")
    assert {("sagellm.engines", "replay"), ("sagellm.workloads", "agentic")} <= {
        (p["group"], p["name"]) for p in listed
    }
    assert main(["plugins", "--markdown"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| distribution |") and "| `sagellm-core` | `sagellm.engines`: `replay`" in table


def test_plugins_piped_is_one_plain_line_a_plugin(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")  # a narrow terminal's width: a pipe has none, nothing is cut
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "group\tname\tdistribution\tversion\thooks"
    rows = [line.split("\t") for line in lines[1:]]
    assert all(len(row) == 5 for row in rows)
    assert ["sagellm.scheduler_passes", "prefix-aware", "sagellm-plugin-scheduler-ir"] in [row[:3] for row in rows]


def test_plugins_in_a_narrow_terminal_fold_names_not_cut_them(monkeypatch):
    from rich.console import Console

    from sagellm_core import cli

    narrow = Console(force_terminal=True, width=60, record=True)
    monkeypatch.setattr(cli, "Console", lambda: narrow)
    assert main(["plugins"]) == 0
    text = narrow.export_text()
    assert "…" not in text
    cells = "".join(line.split("│")[3].strip() for line in text.splitlines() if line.count("│") == 6)
    assert "sagellm-plugin-scheduler-ir" in cells  # the distribution column, its folded lines joined


def test_set_overrides_a_config_key(tmp_path):
    out = tmp_path / "r.json"
    assert (
        main(["replay", *SMALL, "--set", "eviction.plugin=lfu", "--set", "kv_pool.num_blocks=512", "--json", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    assert report["plugins"]["eviction"] == "lfu" and report["num_blocks"] == 512
    assert main(["replay", *SMALL, "--set", "kv_pool.num_blocks=1,2"]) == 2


def test_sweep_over_pool_size(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text(
        '[engine]\nmode = "cache-only"\n[prefix_cache]\nplugin = "radix"\n'
        '[kv_pool]\nplugin = "paged"\nnum_blocks = 100\n[eviction]\nplugin = "lru"\n'
    )
    out, md, png = tmp_path / "s.json", tmp_path / "s.md", tmp_path / "s.png"
    args = [
        "sweep",
        "--config",
        str(config),
        "--set",
        "kv_pool.num_blocks=200,400,3000",
        "--set",
        "eviction.plugin=lfu",
        "--max-requests",
        "60",
        "--quiet",
        "--json",
        str(out),
        "--markdown",
        str(md),
        "--plot",
        str(png),
    ]
    assert main(args) == 0
    reports = json.loads(out.read_text())
    assert [r["sweep"]["value"] for r in reports] == [200, 400, 3000]
    assert all(r["plugins"]["eviction"] == "lfu" for r in reports)
    rates = [r["block_hit_rate"] for r in reports]
    assert rates[0] <= rates[1] <= rates[2] and rates[0] < rates[2]
    assert md.read_text().splitlines()[0] == "| block_hit_rate \\ kv_pool.num_blocks | 200 | 400 | 3000 |"
    assert main(args + ["--figure", "token_hit_rate", "--figure", "evicted_blocks"]) == 0
    tables = md.read_text()
    assert "| token_hit_rate \\ kv_pool.num_blocks |" in tables and "| evicted_blocks \\ kv_pool.num_blocks |" in tables
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["sweep", "--config", str(config), "--set", "kv_pool.num_blocks=200", "--quiet"]) == 2
    assert "exactly one --set KEY=V1,V2,... with several values" in capsys.readouterr().err
    # The axis may be a workload key: each value is its own workload.
    assert (
        main(
            [
                "sweep",
                "--config",
                str(config),
                "--set",
                "workload.tenants=1,3",
                "--max-requests",
                "20",
                "--quiet",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert [r["sweep"]["value"] for r in json.loads(out.read_text())] == [1, 3]


def test_sweep_over_a_list_valued_key(tmp_path):
    md = tmp_path / "s.md"
    args = [
        "sweep",
        "--config",
        "sagellm_core/default.toml",
        "--set",
        'scheduler.passes=["fcfs"],["fcfs","prefix-aware"]',
        "--max-requests",
        "40",
        "--quiet",
        "--markdown",
        str(md),
    ]
    assert main(args) == 0
    header, _, row = md.read_text().splitlines()[:3]
    assert header == "| block_hit_rate \\ scheduler.passes | ['fcfs'] | ['fcfs', 'prefix-aware'] |"
    assert all(cell.strip() != "-" for cell in row.split("|")[2:-1])


def test_tenant_fairness_in_the_report(tmp_path):
    out = tmp_path / "r.json"
    assert main(["replay", *SMALL, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rates = report["tenant_block_hit_rates"]
    assert set(rates) <= {"tenant-0", "tenant-1", "tenant-2", "tenant-3"} and len(rates) >= 2
    expected = sum(rates.values()) ** 2 / (len(rates) * sum(x * x for x in rates.values()))
    assert report["jain_fairness"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_requests_must_be_positive(value, capsys):
    assert main(["replay", "--max-requests", value, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"--max-requests {value}: at least 1") and "\n" not in err


def test_unknown_executor_is_a_one_line_error(tmp_path, capsys):
    a = tmp_path / "a.toml"
    a.write_text('[kv_pool]\nplugin = "paged"\nnum_blocks = 300\n')
    assert main(["compare", "--config", str(a), "--config", str(a), "--executor", "slurm", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "--executor slurm: no such executor" in err


def test_the_noisy_neighbour_configs_compare_and_the_quota_isolates_the_chat_tenants(tmp_path):
    out = tmp_path / "c.json"
    configs = ["contrib/configs/noisy-neighbour.toml", "contrib/configs/noisy-neighbour-quota.toml"]
    assert main(["compare", *(a for c in configs for a in ("--config", c)), "--json", str(out), "--quiet"]) == 0
    greedy, quota = json.loads(out.read_text())
    assert greedy["requests"] == quota["requests"] > 0 and greedy["rejected"] == quota["rejected"] == 0
    assert quota["plugins"]["admission"] == "quota" and quota["admission"]["tenant_deferrals"]["docs"] > 0
    assert quota["plugin_figures"]["tenant-shares"]["yielded_steps"]["docs"] > 0
    for tenant in ("chat-0", "chat-1", "chat-2"):
        assert quota["tenant_block_hit_rates"][tenant] > greedy["tenant_block_hit_rates"][tenant]
        assert quota["tenant_ttft_s"][tenant]["p99"] < greedy["tenant_ttft_s"][tenant]["p99"] / 2
    assert all(v["guarantee_violations"] == 0 for v in quota["plugin_figures"]["quota"].values())
