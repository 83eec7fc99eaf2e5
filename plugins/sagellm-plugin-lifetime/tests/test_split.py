import importlib.util
import random
from pathlib import Path

import attrs
import pytest
from sagellm_plugin_lifetime import split as split_mod
from sagellm_plugin_lifetime.split import Split, arrival_order, conversation_id, held_out, make_split, study_requests

from sagellm_core.config import WorkloadSettings
from sagellm_core.replay.workloads import GeneratorSettings
from sagellm_core.types import Request

STUDY = Path(__file__).resolve().parents[3] / "benchmarks" / "lifetime_study.py"


def parted(conversations=300, seed=0):
    """Requests of conversations cut into parts as ShareGPT V3 cuts them
    (``abc_0``, ``abc_7``, ...), the parts of one conversation adjacent."""
    rng = random.Random(seed)
    out = []
    for c in range(conversations):
        root = f"c{c:04d}X"
        for part in sorted(rng.sample(range(40), rng.randint(1, 4))):
            for turn in range(rng.randint(1, 3)):
                out.append(
                    Request(
                        f"{root}_{part}-turn{turn}",
                        [c, part, turn, 7, 8, 9],
                        10 + turn,
                        arrival_s=float(len(out)),
                        session_id=f"{root}_{part}",
                        prompt_text=f"question {c} {part} {turn}",
                    )
                )
    return out


def test_conversation_id_strips_sharegpt_part_suffix():
    assert conversation_id(Request("r", [1], 1, session_id="hRPPgZT_11")) == "hRPPgZT"
    assert conversation_id(Request("r", [1], 1, session_id="hRPPgZT_0")) == "hRPPgZT"
    assert conversation_id(Request("r", [1], 1, session_id="s12")) == "s12"
    assert conversation_id(Request("r-turn3", [1], 1)) == "r-turn3"


@pytest.mark.parametrize("kind", ["conversation", "temporal"])
def test_no_held_out_conversation_part_appears_in_training(kind):
    requests = parted()
    split = make_split(kind, requests=requests, test_fraction=0.2, dev_fraction=0.2)
    parts_of = {}
    for request in requests:
        parts_of.setdefault(conversation_id(request), set()).add(split.part(request))
    assert all(len(parts) == 1 for parts in parts_of.values())  # every part of a conversation on one side
    test_roots = {c for c, parts in parts_of.items() if parts == {"test"}}
    trained_sessions = {r.session_id for r in requests if split.part(r) != "test"}
    held_sessions = {r.session_id for r in requests if split.part(r) == "test"}
    assert test_roots and trained_sessions and held_sessions
    assert not {conversation_id(Request("x", [1], 1, session_id=s)) for s in trained_sessions} & test_roots
    counts = {p: sum(split.part(r) == p for r in requests) for p in ("train", "dev", "test")}
    assert all(counts.values())


def test_no_held_out_sharegpt_part_shares_its_conversation_with_training():
    sharegpt = pytest.importorskip("sagellm_plugin_sharegpt")
    ids = [c.conversation_id for c in sharegpt.conversations()]
    split = Split()
    side = {}
    for session in ids:
        root = conversation_id(Request("x", [1], 1, session_id=session))
        side.setdefault(root, set()).add(split.part_of(root))
    assert len(side) < len(ids)  # there are conversations cut into parts
    assert all(len(parts) == 1 for parts in side.values())


def test_temporal_split_holds_out_the_last_conversations():
    requests = parted()
    split = make_split("temporal", requests=requests, test_fraction=0.1, dev_fraction=0.1)
    first = {}
    for i, request in enumerate(requests):
        first.setdefault(conversation_id(request), i)
    by_part = {p: [first[c] for c in first if split.part_of(c) == p] for p in ("train", "dev", "test")}
    assert max(by_part["train"]) < min(by_part["dev"]) and max(by_part["dev"]) < min(by_part["test"])
    assert len(by_part["test"]) == pytest.approx(0.1 * len(first), abs=1)
    assert split.part_of("never seen") == "test"  # a new conversation is the latest


def test_temporal_split_orders_the_whole_workload_whatever_max_requests():
    workload = WorkloadSettings(
        source="generator", options=GeneratorSettings(tenants=2, sessions_per_tenant=20, turns=3)
    )
    full = make_split("temporal", workload)
    cut = make_split("temporal", attrs.evolve(workload, max_requests=10))
    assert full.order == cut.order


def test_arrival_order_ranks_first_arrivals():
    assert arrival_order(["a", "b", "a", "c"]) == {"a": 0.0, "b": 1 / 3, "c": 2 / 3}


def test_fractions_are_checked():
    with pytest.raises(ValueError):
        Split(test_fraction=0.6, dev_fraction=0.5)
    with pytest.raises(ValueError):
        Split("temporal")  # no order
    with pytest.raises(ValueError):
        Split("by-moon")


def test_held_out_is_the_conversation_splits_test_part():
    requests = parted()
    split = Split(test_fraction=0.25)
    assert [held_out(r, 0.25) for r in requests] == [split.part(r) == "test" for r in requests]


def test_study_requests_never_yield_a_test_request():
    requests = parted()
    split = Split()
    read = list(study_requests(requests, split))
    assert {part for _, part in read} == {"train", "dev"}
    assert all(split.part(r) != "test" for r, _ in read)
    assert len(read) == sum(split.part(r) != "test" for r in requests)


def _study_module():
    if not STUDY.exists():
        pytest.skip("benchmarks/lifetime_study.py is not in this tree")
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("lifetime_study_under_test", STUDY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_study_reads_only_the_dev_split(monkeypatch, capsys):
    """The whole study, on a small made-up workload: the test conversations
    reach neither training nor the rows it reports on."""
    study = _study_module()
    from sagellm_plugin_lifetime import text

    requests = parted(120)
    split = Split()
    assert any(split.part(r) == "test" for r in requests)
    small = dict(buckets=1 << 10, dim=4, hidden=8, epochs=1, members=2)
    real_settings, real_train, real_rows = text.TextSettings, text.train, study.dev_rows
    seen: list[str] = []

    def train(settings, requests, *args, **kwargs):
        requests = list(requests)
        seen.extend(split.part(r) for r in requests)
        return real_train(settings, requests, *args, **kwargs)

    def dev_rows(settings, requests, split):
        requests = list(requests)
        seen.extend(split.part(r) for r in requests)
        return real_rows(settings, requests, split)

    monkeypatch.setattr(study.workloads, "load", lambda workload: iter(requests))
    monkeypatch.setattr(study.text, "TextSettings", lambda **kw: real_settings(**{**small, **kw}))
    monkeypatch.setattr(study.text, "train", train)
    monkeypatch.setattr(study, "dev_rows", dev_rows)
    study.main()
    assert "test" not in seen and "dev" in seen and "train" in seen
    assert "the test part is not read" in capsys.readouterr().out
    with pytest.raises(ValueError, match="read the test request"):
        real_rows(real_settings(**small), requests, split)


def test_split_module_names_its_parts():
    assert split_mod.PARTS == ("train", "dev", "test")
