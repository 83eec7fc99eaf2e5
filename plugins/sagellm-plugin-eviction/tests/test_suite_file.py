"""The shipped policy suite: its fresh, final and untuned parts are new
data, not the other parts again."""

import pytest
from sagellm_plugin_eviction import suite

from sagellm_core.errors import SagellmError


def draw(entry):
    """What makes one of a source's workloads another sample: its seed and
    the range of session draws it keeps."""
    w = entry["config"]["workload"]
    return w.get("seed", 0), w.get("session_from", 0.0), w.get("session_to", 1.0)


def test_the_fresh_part_draws_every_workload_anew():
    parsed, _ = suite.read_suite(None)
    by_split = {}
    for entry in parsed["workload"]:
        by_split.setdefault(entry["split"], []).append(entry)
    assert set(by_split) == {"tune", "held-out", "fresh", "final", "untuned"}
    seen = [e for split in ("tune", "held-out") for e in by_split[split]]
    for entry in by_split["fresh"] + by_split["final"]:
        source = entry["config"]["workload"]["source"]
        same_source = [e for e in seen if e["config"]["workload"]["source"] == source]
        assert same_source, f"{entry['name']}: a source the other parts do not have"
        assert all(draw(entry) != draw(e) for e in same_source), entry["name"]


@pytest.mark.parametrize("part", ["final", "untuned"])
def test_a_later_part_draws_anew_from_every_other_part(part):
    parsed, _ = suite.read_suite(None)
    final = [e for e in parsed["workload"] if e["split"] == part]
    earlier = [e for e in parsed["workload"] if e["split"] != part]
    assert {e["config"]["workload"]["source"] for e in final} >= {"generator", "agentic", "sharegpt", "rag"}
    for entry in final:
        source = entry["config"]["workload"]["source"]
        assert all(draw(entry) != draw(e) for e in earlier if e["config"]["workload"]["source"] == source)


def test_a_split_outside_the_three_parts_is_refused(tmp_path):
    path = tmp_path / "suite.toml"
    path.write_text("fractions = [0.5]\n[[workload]]\nname = 'x'\nsplit = 'test'\nconfig = {}\n")
    with pytest.raises(SagellmError, match="accepted: tune, held-out, fresh"):
        suite.read_suite(path)


@pytest.mark.parametrize(
    "policy, section",
    [
        ("lru", {"plugin": "lru"}),
        (
            "adaptive:margin=0.03,experts=['lru', 'lfu']",
            {"plugin": "adaptive", "margin": 0.03, "experts": ["lru", "lfu"]},
        ),
        ("belady:knows=whether", {"plugin": "belady", "knows": "whether"}),
    ],
)
def test_policy_settings_are_toml_values_or_bare_words(policy, section):
    assert suite.eviction_section(policy) == section


def test_a_policy_setting_without_a_value_is_refused():
    with pytest.raises(SagellmError, match="KEY=VALUE"):
        suite.eviction_section("adaptive:margin")
