"""The performance gate itself (benchmarks/perf_gate.py, docs/perf-gate.md).

The comparison on synthetic figures; then real measurements with a deliberate
regression injected (a victim choice doing its work 20 times, a replay at
another pool size), which the gate must fail, naming the figure. No test
asserts an absolute time: only ratios against the gate's in-process
reference, and a 20x slowdown against a 2x limit.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import shutil
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]
SLOWDOWN = 20


def _load_gate():
    spec = importlib.util.spec_from_file_location("perf_gate", PROJECT / "benchmarks" / "perf_gate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gate = _load_gate()

BASELINE = {
    "hit_rates": {
        "mooncake-lru": {
            "hit_blocks": 62001,
            "query_blocks": 288500,
            "block_hit_rate": 0.214908,
            "host_hit_blocks": 0,
            "command": "sagellm replay --config contrib/configs/mooncake-lru.toml",
        },
        "default": {
            "hit_blocks": 43390,
            "query_blocks": 63146,
            "block_hit_rate": 0.687138,
            "host_hit_blocks": 5867,
            "command": "sagellm replay",
        },
    },
    "ratios": {
        "lru_select_64": {"ratio": 1.2, "hot_us": 4.0, "reference_us": 3.3},
        "radix_lookup_2048": {"ratio": 0.12, "hot_us": 4.0, "reference_us": 33.0},
    },
}


# ------------------------------------------------ comparison, synthetic ----


def test_equal_figures_pass():
    assert gate.compare(BASELINE, copy.deepcopy(BASELINE)) == []


def test_a_changed_hit_count_fails_and_names_the_figure():
    measured = copy.deepcopy(BASELINE)
    measured["hit_rates"]["mooncake-lru"]["hit_blocks"] = 62000
    (line,) = gate.compare(BASELINE, measured)
    assert line.startswith("hit_rates.mooncake-lru.hit_blocks: baseline 62001, measured 62000")
    assert "the figure changed" in line
    assert "run `python benchmarks/perf_gate.py update`" in line and "in the same commit" in line


def test_every_changed_field_is_one_line():
    measured = copy.deepcopy(BASELINE)
    measured["hit_rates"]["default"].update(hit_blocks=43391, block_hit_rate=0.687154)
    lines = gate.compare(BASELINE, measured)
    names = [line.split(":")[0] for line in lines]
    assert names == ["hit_rates.default.hit_blocks", "hit_rates.default.block_hit_rate"]


def test_a_replay_missing_from_either_side_or_failing_fails():
    measured = copy.deepcopy(BASELINE)
    measured["hit_rates"]["new-replay"] = dict(measured["hit_rates"].pop("default"))
    lines = gate.compare(BASELINE, measured)
    assert any(line.startswith("hit_rates.new-replay: measured but not in the baseline") for line in lines)
    assert any(line.startswith("hit_rates.default: in the baseline but not measured") for line in lines)
    broken = copy.deepcopy(BASELINE)
    broken["hit_rates"]["default"] = {"error": "`sagellm replay` failed: boom"}
    assert gate.compare(BASELINE, broken) == ["hit_rates.default: `sagellm replay` failed: boom"]


def test_a_ratio_within_the_margin_passes_and_beyond_it_fails():
    limit = BASELINE["ratios"]["lru_select_64"]["ratio"] * (1 + gate.MARGIN)
    within = copy.deepcopy(BASELINE)
    within["ratios"]["lru_select_64"]["ratio"] = limit * 0.99
    assert gate.compare(BASELINE, within) == []
    faster = copy.deepcopy(BASELINE)
    faster["ratios"]["lru_select_64"]["ratio"] = 0.1
    assert gate.compare(BASELINE, faster) == []
    beyond = copy.deepcopy(BASELINE)
    beyond["ratios"]["lru_select_64"]["ratio"] = limit * 1.01
    (line,) = gate.compare(BASELINE, beyond)
    assert line.startswith(f"ratios.lru_select_64: baseline 1.2, measured {limit * 1.01:.4g}, above the limit")
    assert "python benchmarks/perf_gate.py update" in line


def test_the_margin_is_stated_and_the_baseline_covers_every_figure():
    assert 0.3 <= gate.MARGIN <= 2.0
    stored = gate.load_baseline()
    assert stored["margin"] == gate.MARGIN
    assert set(stored["hit_rates"]) == set(gate.REPLAYS)
    assert set(stored["ratios"]) == set(gate.HOT_PATHS)
    for figures in stored["hit_rates"].values():
        assert isinstance(figures["hit_blocks"], int) and isinstance(figures["query_blocks"], int)
        assert figures["block_hit_rate"] == round(figures["hit_blocks"] / figures["query_blocks"], 6)


# ------------------------------------------- deliberate regressions, real ----


def slowed(cls: type, hook: str, times: int = SLOWDOWN) -> type:
    """``cls`` whose ``hook`` does its work ``times`` times (same signature)."""
    original = getattr(cls, hook)

    @functools.wraps(original)
    def slow(self, *args, **kwargs):
        for _ in range(times - 1):
            original(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return type(f"Slow{cls.__name__}", (cls,), {hook: slow})


def test_a_victim_choice_doing_its_work_20_times_fails_the_gate():
    lru = gate.plugin_class("sagellm.eviction", "lru")
    normal = gate.measure_ratios(["lru_select_64"])
    slow = gate.measure_ratios(["lru_select_64"], classes={"lru": slowed(lru, "sagellm_select_victims")})
    # Against a baseline measured now, and against the stored one.
    for baseline in (normal, gate.load_baseline()["ratios"]):
        (line,) = gate.compare_ratios(baseline, slow)
        assert line.startswith("ratios.lru_select_64: baseline ")
        assert "above the limit" in line


def test_a_radix_lookup_doing_its_work_20_times_fails_the_gate():
    radix = gate.plugin_class("sagellm.prefix_cache", "radix")
    slow = gate.measure_ratios(["radix_lookup_2048"], classes={"radix": slowed(radix, "sagellm_lookup_prefix")})
    (line,) = gate.compare_ratios(gate.load_baseline()["ratios"], slow)
    assert line.startswith("ratios.radix_lookup_2048: baseline ")


def test_a_hit_figure_changed_by_a_real_replay_fails_the_gate():
    stored = {"default": gate.load_baseline()["hit_rates"]["default"]}
    same = gate.measure_hit_rates({"default": gate.REPLAYS["default"]})
    assert gate.compare_hit_rates(stored, same) == []
    # The same workload with a smaller pool: fewer hits than the baseline's.
    changed = gate.measure_hit_rates({"default": [*gate.REPLAYS["default"], "--set", "kv_pool.num_blocks=2048"]})
    lines = gate.compare_hit_rates(stored, changed)
    assert lines and all(line.startswith("hit_rates.default.") for line in lines)
    assert any(line.startswith("hit_rates.default.hit_blocks: baseline 43390, measured ") for line in lines)
    assert all("benchmarks/perf_gate.py update" in line for line in lines)


def test_check_exits_1_with_one_line_per_failing_figure(monkeypatch, capsys):
    lru = gate.plugin_class("sagellm.eviction", "lru")
    slow_lru = slowed(lru, "sagellm_select_victims")
    monkeypatch.setitem(gate.HOT_PATHS, "lru_select_64", lambda classes: gate._victims({"lru": slow_lru}, "lru"))
    monkeypatch.setitem(gate.REPLAYS, "default", ["--set", "kv_pool.num_blocks=2048"])
    # --in-process: the substituted hot path lives in this process only
    assert gate.main(["check", "--in-process", "--figure", "lru_select_64", "--figure", "default"]) == 1
    failed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("perf gate: FAIL ")]
    names = {line.removeprefix("perf gate: FAIL ").split(":")[0] for line in failed}
    assert "ratios.lru_select_64" in names and "hit_rates.default.hit_blocks" in names
    assert all(name.startswith(("ratios.lru_select_64", "hit_rates.default.")) for name in names)


def test_update_then_check_passes(tmp_path, capsys):
    baseline = tmp_path / "perf_baseline.json"
    shutil.copy(gate.BASELINE, baseline)
    stored = json.loads(baseline.read_text())
    stored["hit_rates"]["default"]["hit_blocks"] = 1  # as if the code had changed it
    baseline.write_text(json.dumps(stored))
    assert gate.main(["update", "--figure", "default", "--baseline", str(baseline)]) == 0
    updated = json.loads(baseline.read_text())
    assert updated["hit_rates"]["default"] == gate.load_baseline()["hit_rates"]["default"]
    assert updated["ratios"] == stored["ratios"]  # figures not measured stay as they were
    assert gate.main(["check", "--figure", "default", "--baseline", str(baseline)]) == 0
    assert "perf gate: pass" in capsys.readouterr().out
