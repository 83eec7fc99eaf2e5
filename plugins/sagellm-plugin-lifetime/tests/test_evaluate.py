import json
from pathlib import Path

import attrs
import pytest
from sagellm_plugin_lifetime import evaluate
from sagellm_plugin_lifetime.split import Split

from sagellm_core import cli
from sagellm_core.config import WorkloadSettings
from sagellm_core.kit.testing import declare_plugins
from sagellm_core.replay import workloads
from sagellm_core.replay.workloads import GeneratorSettings
from sagellm_core.types import LifetimePrediction, RequestOutcome

GENERATOR = WorkloadSettings(source="generator", options=GeneratorSettings(tenants=2, sessions_per_tenant=40, turns=4))


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
    assert "lifetime predictors on the test part of the conversation split" in capsys.readouterr().out


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


@attrs.frozen
class SplitAwareSettings:
    split: str = "conversation"
    test_fraction: float = 0.1
    dev_fraction: float = 0.1


class Recording:
    """Records what it is asked and told: which requests it predicted, which
    finishes it had seen at each prediction, and each outcome's times."""

    Settings = SplitAwareSettings
    last = None

    def __init__(self, settings, context):
        self.settings = settings
        self.predicted: dict[str, frozenset] = {}
        self.finished: dict[str, RequestOutcome] = {}
        self.batches: list[int] = []
        Recording.last = self

    def predict_batch(self, requests):
        self.batches.append(len(requests))
        return [self.sagellm_predict_lifetime(request=r) for r in requests]

    def sagellm_predict_lifetime(self, request):
        self.predicted[request.request_id] = frozenset(self.finished)
        return LifetimePrediction(100.0, 10.0, 1000.0, 0.5, "recording")

    def sagellm_request_finished(self, outcome):
        self.finished[outcome.request.request_id] = outcome


def recorded() -> Recording:
    """The last Recording built (the entry point imports this file as its
    own module, apart from pytest's)."""
    import importlib

    return importlib.import_module("test_evaluate").Recording.last


@pytest.fixture
def recording(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    declare_plugins(
        tmp_path, {"sagellm.lifetime": {"recording-evaluated": "test_evaluate:Recording"}}, name="sagellm-recording"
    )
    return "recording-evaluated"


def test_test_fraction_means_one_split_for_training_and_scoring(recording):
    from sagellm_plugin_lifetime import text

    rows = evaluate.evaluate([recording], GENERATOR, fraction=0.3)
    assert "error" not in rows[0], rows[0]
    p = recorded()
    assert (p.settings.split, p.settings.test_fraction, p.settings.dev_fraction) == ("conversation", 0.3, 0.1)
    # The split the text model would train on with those settings holds out
    # exactly the requests scored.
    trained_split = text.split_of(text.TextSettings(test_fraction=0.3))
    requests = list(workloads.load(GENERATOR))
    assert set(p.predicted) == {r.request_id for r in requests if trained_split.part(r) == "test"}
    assert set(p.predicted)


def test_cli_test_fraction_reaches_the_predictor(recording, capsys):
    status = cli.main(
        ["lifetime", "evaluate", "--predictor", recording, "--source", "generator", "--test-fraction", "0.4", "--quiet"]
    )
    assert status == 0
    assert recorded().settings.test_fraction == 0.4


def test_memory_is_fed_in_finish_order(recording):
    """A prediction sees exactly the requests that finished before it
    arrived, and a conversation's earlier turns always (closed loop)."""
    evaluate.evaluate([recording], GENERATOR, fraction=0.3)
    p = recorded()
    outcomes = p.finished
    assert set(outcomes) == {r.request_id for r in workloads.load(GENERATOR)}  # every request finished once
    for request_id, seen in p.predicted.items():
        arrival = outcomes[request_id].arrival_s
        assert all(outcomes[o].finish_s <= arrival for o in seen)
        assert {o for o, out in outcomes.items() if out.finish_s < arrival} <= seen
        mine = outcomes[request_id].request
        earlier = [
            o
            for o, out in outcomes.items()
            if out.request.session_id == mine.session_id and out.request.arrival_s < mine.arrival_s
        ]
        assert set(earlier) <= seen
    assert max(p.batches) <= evaluate.BATCH


def test_timeline_is_a_closed_loop_in_time_order():
    requests = list(workloads.load(GENERATOR))
    events = list(evaluate.timeline(requests, decode_s_per_token=0.05))
    assert len(events) == 2 * len(requests)
    times = [(t, kind != "finish") for t, kind, *_ in events]
    assert times == sorted(times)  # in time order, a finish before an arrival at the same time
    finish_of = {r.request_id: f for _, kind, r, _, f in events if kind == "finish"}
    last: dict = {}
    for _, kind, r, arrival, finish in events:
        if kind == "arrive":
            assert arrival >= r.arrival_s and finish == pytest.approx(arrival + 0.05 * r.output_tokens)
    for r in requests:  # each turn arrives after its predecessor finished
        if r.session_id in last:
            assert next(a for _, k, q, a, _ in events if k == "arrive" and q is r) >= finish_of[last[r.session_id]]
        last[r.session_id] = r.request_id


def test_no_repeat_leaves_out_exact_repeats_of_training_prompts(monkeypatch):
    requests = list(workloads.load(GENERATOR))
    split = Split(test_fraction=0.3)
    train = [r for r in requests if split.part(r) == "train"]
    repeated = 0
    for i, r in enumerate(requests):
        if split.part(r) == "test" and i % 3 == 0:
            requests[i] = attrs.evolve(r, prompt_token_ids=train[i % len(train)].prompt_token_ids)
            repeated += 1
    monkeypatch.setattr(evaluate.workloads, "load", lambda workload: iter(requests))
    rows = evaluate.evaluate(["stat"], GENERATOR, fraction=0.3)
    stat, baseline = rows
    assert repeated and stat["requests"] == baseline["requests"]
    assert stat["no_repeat"]["requests"] == baseline["no_repeat"]["requests"] == stat["requests"] - repeated
    assert stat["split"] == "conversation"


def test_temporal_evaluation_scores_the_last_conversations(recording):
    evaluate.evaluate([recording], GENERATOR, fraction=0.25, split="temporal")
    p = recorded()
    assert p.settings.split == "temporal"
    requests = list(workloads.load(GENERATOR))
    first: dict = {}
    for i, r in enumerate(requests):
        first.setdefault(r.session_id, i)
    predicted_sessions = {r.session_id for r in requests if r.request_id in p.predicted}
    others = set(first) - predicted_sessions
    assert predicted_sessions and others
    assert min(first[s] for s in predicted_sessions) > max(first[s] for s in others)
