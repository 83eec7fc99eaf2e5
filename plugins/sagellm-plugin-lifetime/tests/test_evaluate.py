import json
from pathlib import Path

import pytest
from sagellm_plugin_lifetime import evaluate

from sagellm_core import cli
from sagellm_core.config import WorkloadSettings
from sagellm_core.kit.testing import declare_plugins

GENERATOR = WorkloadSettings(source="generator", tenants=2, sessions_per_tenant=40, turns=4)


class Crashing:
    def __init__(self, settings, context):
        pass

    def sagellm_predict_lifetime(self, request):
        raise RuntimeError("model on fire")

    def sagellm_request_finished(self, outcome):
        pass


def test_every_predictor_beside_the_median_baseline():
    rows = evaluate.evaluate(["stat", "online"], GENERATOR, fraction=0.3)
    by_name = {row["predictor"]: row for row in rows}
    assert set(by_name) >= {"stat", "online"}
    baseline = rows[-1]
    assert baseline["predictor"].startswith("median of training requests")
    for name in ("stat", "online"):
        row = by_name[name]
        assert row["requests"] == baseline["requests"] > 0
        assert row["mae"] >= 0 and 0 <= row["acc10"] <= 1 and row["latency_ms"] > 0
        assert 0 <= row["coverage80"] <= 1
        assert set(row["remaining_mae"]) <= {"64", "256"}


def test_a_crashing_predictor_is_reported_and_the_others_go_on(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    declare_plugins(
        tmp_path, {"sagellm.lifetime": {"crashing-evaluated": "test_evaluate:Crashing"}}, name="sagellm-evaluate-test"
    )
    rows = evaluate.evaluate(["crashing-evaluated", "stat"], GENERATOR, fraction=0.3)
    assert rows[0]["error"] == "RuntimeError: model on fire"
    assert rows[1]["mae"] >= 0


def test_cli_evaluate_writes_json(tmp_path, capsys):
    out = tmp_path / "rows.json"
    status = cli.main(
        [
            "lifetime",
            "evaluate",
            "--predictor",
            "stat",
            "--source",
            "generator",
            "--max-requests",
            "120",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert status == 0
    rows = json.loads(out.read_text())
    assert rows[0]["predictor"] == "stat" and "mae" in rows[0]
    assert "lifetime predictors on the held-out split" in capsys.readouterr().out


def test_cli_names_an_unknown_predictor(capsys):
    status = cli.main(["lifetime", "evaluate", "--predictor", "nope", "--source", "generator", "--quiet"])
    assert status == 2
    assert "unknown lifetime plugin 'nope'" in capsys.readouterr().err


def test_cli_train_with_part_of_the_workload_needs_out(capsys):
    assert cli.main(["lifetime", "train", "--max-requests", "10"]) == 2
    assert "--out" in capsys.readouterr().err


def test_sharegpt_evaluation_beats_the_median():
    pytest.importorskip("sagellm_plugin_sharegpt")
    rows = evaluate.evaluate(["online"], WorkloadSettings(source="sharegpt", max_requests=4000), fraction=0.2)
    online, baseline = rows
    assert online["requests"] > 500
    assert online["mae"] < baseline["mae"]
