"""`sagellm evaluate-policies`: the suite's rows, its split, and bad input."""

import json

import pytest
from sagellm_plugin_eviction import suite

from sagellm_core.cli import main
from sagellm_core.errors import SagellmError

SMALL_SUITE = """
fractions = [0.25, 1.0]

[[workload]]
name = "chat"
split = "tune"
config.workload = { source = "generator", tenants = 2, sessions_per_tenant = 6, turns = 3 }
config.prefix_cache = { plugin = "radix", block_size = 64 }

[[workload]]
name = "agents"
split = "held-out"
config.workload = { source = "agentic", tenants = 2, sessions_per_tenant = 3 }
config.prefix_cache = { plugin = "radix", block_size = 64 }

[[workload]]
name = "missing-trace"
split = "tune"
config.workload = { source = "mooncake", path = "{traces}/no-such.jsonl" }
config.prefix_cache = { plugin = "radix", block_size = 512 }
"""


@pytest.fixture
def small_suite(tmp_path):
    path = tmp_path / "suite.toml"
    path.write_text(SMALL_SUITE)
    return path


def test_rows_relate_each_policy_to_lru_and_belady(small_suite, tmp_path, capsys):
    out = tmp_path / "rows.json"
    args = ["evaluate-policies", "--suite", str(small_suite), "--traces", str(tmp_path), "--quiet"]
    assert main([*args, "--policy", "adaptive", "--policy", "lfu", "--json", str(out)]) == 0
    assert "skipping missing-trace: no file" in capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    assert {row["workload"] for row in rows} == {"chat"}  # the tune half only
    assert len(rows) == 2 * 4  # two capacities, lru belady adaptive lfu
    by = {(row["num_blocks"], row["policy"]): row for row in rows}
    for (blocks, _), row in by.items():
        lru, best = by[(blocks, "lru")]["block_hit_rate"], by[(blocks, "belady")]["block_hit_rate"]
        assert best >= row["block_hit_rate"]  # nothing beats the optimum
        assert row["ratio_to_lru"] == pytest.approx(row["block_hit_rate"] / lru)
        if row["gap_closed"] is not None:
            assert row["gap_closed"] == pytest.approx((row["block_hit_rate"] - lru) / (best - lru))
    capacities = sorted({blocks for blocks, _ in by})
    assert capacities[0] < capacities[1]
    (best,) = [s for s in suite.summary(rows) if s["policy"] == suite.BEST_AFTER_THE_FACT]
    assert best["settings"] == 2
    for s in suite.summary(rows):  # the best per setting is at least as good as each policy
        if s["policy"] in ("adaptive", "lfu") and s["mean_gap_closed"] is not None:
            assert best["mean_gap_closed"] >= s["mean_gap_closed"]


def test_held_out_half_and_summary(small_suite, tmp_path):
    parsed, where = suite.read_suite(small_suite)
    rows = suite.evaluate(parsed, where, ["lru"], split="held-out", traces=tmp_path)
    assert {row["workload"] for row in rows} == {"agents"}
    (lru,) = [s for s in suite.summary(rows) if s["policy"] == "lru"]
    assert lru["worst_ratio_to_lru"] == 1.0 and lru["below_lru_by_0.5%"] == 0
    assert "| agents | held-out |" in suite.markdown(rows)


def test_worker_processes_give_the_rows_of_one_process(small_suite, tmp_path):
    parsed, where = suite.read_suite(small_suite)
    one = suite.evaluate(parsed, where, ["lfu"], split="all", traces=tmp_path)
    two = suite.evaluate(parsed, where, ["lfu"], split="all", traces=tmp_path, workers=2)
    assert two == one
    assert {row["workload"] for row in one} == {"chat", "agents"}


@pytest.mark.parametrize(
    "text, message",
    [
        ("fractions = [0.5]\n[[workload]]\nname = 'x'\nsplit = 'train'\nconfig = {}\n", "split = 'train'"),
        ("fractions = []\n", "fractions: a list of positive numbers"),
        ("fractions = [0.5\n", "invalid TOML"),
        ("fractions = [0.5]\n[[workload]]\nsplit = 'tune'\n", "workload 1: needs name and config"),
        ("fractions = [0.5]\nfraction = [0.25]\n", "unknown key 'fraction'; accepted: fractions, workload"),
        (
            "fractions = [0.5]\n[[workload]]\nname = 'x'\nsplit = 'tune'\nconfig = {}\nseed = 3\n",
            "workload 'x': unknown key 'seed'; accepted: name, split, config",
        ),
    ],
)
def test_a_bad_suite_is_one_line_naming_it(tmp_path, capsys, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["evaluate-policies", "--suite", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and str(path) in err and "\n" not in err


@pytest.mark.parametrize(
    "section, message",
    [
        ("config.prefix_cache = { plugin = 'radix', block_size = 0 }", "[prefix_cache] block_size = 0"),
        ("config.workload = { source = 'generator', turns = 0 }", "[workload] turns = 0"),
        ("config.kv_pool = { plugin = 'paged', blocks = 9 }", "plugin 'paged': unknown parameter 'blocks'"),
    ],
)
def test_an_invalid_workload_is_an_error_before_any_run(small_suite, tmp_path, capsys, monkeypatch, section, message):
    """Not skipped as if its trace were missing: the suite would be judged
    without it, after minutes of the runs before it."""
    bad = tmp_path / "bad.toml"
    bad.write_text(small_suite.read_text() + f"\n[[workload]]\nname = 'wrong'\nsplit = 'tune'\n{section}\n")
    monkeypatch.setattr(suite.session, "run", lambda *a, **k: pytest.fail("a workload ran"))
    assert main(["evaluate-policies", "--suite", str(bad), "--traces", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"sagellm: error: {bad} [wrong]: ") and message in err and "\n" not in err


def test_nothing_to_run_is_an_error(small_suite, tmp_path, capsys):
    missing = tmp_path / "only-missing.toml"
    missing.write_text(SMALL_SUITE.split("[[workload]]")[0] + "[[workload]]" + SMALL_SUITE.split("[[workload]]")[3])
    assert main(["evaluate-policies", "--suite", str(missing), "--traces", str(tmp_path), "--quiet"]) == 2
    assert "no workload of split 'tune' could run here" in capsys.readouterr().err


def test_the_shipped_suite_is_valid_and_split_in_halves():
    parsed, _ = suite.read_suite(None)
    splits = [entry["split"] for entry in parsed["workload"]]
    assert splits.count("tune") >= 3 and splits.count("held-out") >= 3
    assert len(parsed["fractions"]) == 3


@pytest.mark.parametrize(
    "option, path, message",
    [("--json", "missing/rows.json", "its folder does not exist"), ("--plot", "plot.txt", "a file ending in .png")],
)
def test_output_paths_are_checked_before_the_runs(small_suite, tmp_path, capsys, option, path, message):
    args = ["evaluate-policies", "--suite", str(small_suite), "--traces", str(tmp_path), "--quiet"]
    assert main([*args, option, str(tmp_path / path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "skipping" not in err  # refused before any workload was looked at


ONE_WORKLOAD_SUITE = """
fractions = [0.25]

[[workload]]
name = "chat"
split = "tune"
config.workload = { source = "generator", tenants = 2, sessions_per_tenant = 6, turns = 3 }
config.prefix_cache = { plugin = "radix", block_size = 64 }
"""


def test_a_policy_with_settings_and_a_weaker_oracle(tmp_path):
    """``--policy NAME:KEY=VALUE``: Belady knowing only whether a block
    returns lies between LRU and Belady, and, an oracle, is not among the
    online policies the after-the-fact row picks from."""
    path = tmp_path / "suite.toml"
    path.write_text(ONE_WORKLOAD_SUITE)
    parsed, where = suite.read_suite(path)
    rows = suite.evaluate(parsed, where, ["belady:knows=whether", "lfu", "s3fifo"], traces=tmp_path)
    rate = {row["policy"]: row["block_hit_rate"] for row in rows}
    assert rate["lru"] <= rate["belady:knows=whether"] <= rate["belady"]
    (best,) = [s for s in suite.summary(rows) if s["policy"] == suite.BEST_AFTER_THE_FACT]
    online_best = max(rate["lfu"], rate["s3fifo"], rate["lru"])
    assert best["worst_ratio_to_lru"] == pytest.approx(online_best / rate["lru"])


def test_hint_modes_run_on_the_workloads_that_send_hints(small_suite, tmp_path):
    """With ``--hints``: one column per mode; a workload whose source sends
    hints runs each mode (without hints the policy is its fallback, LRU here, exactly), one
    that sends none (a Mooncake trace) runs once and every mode shows that
    run."""
    parsed, where = suite.read_suite(small_suite)
    trace = [  # the Mooncake trace sends no hints
        json.dumps({"timestamp": 100 * i, "input_length": 1024, "output_length": 8, "hash_ids": [i % 3, 10 + i % 5]})
        for i in range(30)
    ]
    (tmp_path / "no-such.jsonl").write_text("\n".join(trace) + "\n")
    assert [suite.sends_hints(entry) for entry in parsed["workload"]] == [True, True, False]
    rows = suite.evaluate(
        parsed, where, ["hints:fallback=lru"], split="all", traces=tmp_path, hints=("none", "truthful")
    )
    by = {(row["workload"], row["num_blocks"], row["policy"]): row["block_hit_rate"] for row in rows}
    assert {workload for workload, _, _ in by} == {"chat", "agents", "missing-trace"}
    for workload, blocks, policy in by:
        if policy == "hints:fallback=lru [none]":
            assert by[(workload, blocks, policy)] == by[(workload, blocks, "lru")]
        if policy == "hints:fallback=lru [truthful]" and workload == "missing-trace":
            assert by[(workload, blocks, policy)] == by[(workload, blocks, "hints:fallback=lru [none]")]
    agents = sorted(
        (blocks, rate) for (w, blocks, p), rate in by.items() if w == "agents" and p == "hints:fallback=lru [truthful]"
    )
    lru = sorted((blocks, rate) for (w, blocks, p), rate in by.items() if w == "agents" and p == "lru")
    assert agents != lru  # the agents' hints changed what was kept


@pytest.mark.parametrize("mode", ["true", "wrong", "wrong=1.5", "missing=x", "wrong=0.1,wrong=0.2", "late=0.3"])
def test_a_bad_hint_mode_is_an_error_naming_it(mode):
    with pytest.raises(SagellmError, match=f"--hints {mode}: one of none, truthful"):
        suite.hint_keys(mode)


def test_hint_modes_are_workload_keys():
    assert suite.hint_keys("none") == {}
    assert suite.hint_keys("truthful") == {"hints": True}
    assert suite.hint_keys("wrong=0.3,missing=0.1") == {"hints": True, "hints_wrong": 0.3, "hints_missing": 0.1}
