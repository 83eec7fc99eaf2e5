import random

import pytest

torch = pytest.importorskip("torch")

from sagellm_plugin_lifetime import text  # noqa: E402
from sagellm_plugin_lifetime.text import TextLifetime, TextSettings  # noqa: E402

from sagellm_core import PluginContext  # noqa: E402
from sagellm_core.errors import ConfigError  # noqa: E402
from sagellm_core.types import Request, RequestOutcome  # noqa: E402

CTX = PluginContext("text", block_size=4, num_blocks=1)
SMALL = dict(buckets=1 << 12, dim=8, hidden=16, epochs=8, learning_rate=2e-2)


def asked(seed, count):
    """Single-turn requests whose reply length is set by what is asked."""
    rng = random.Random(seed)
    kinds = [("write a long detailed essay about {}", 800), ("answer yes or no: is {} true?", 4)]
    for i in range(count):
        prompt, out = rng.choice(kinds)
        topic = rng.choice(["rivers", "tax law", "cats", "jazz", "rust", "the moon"])
        words = prompt.format(topic)
        yield Request(
            f"{seed}-{i}",
            [rng.randrange(10**6) for _ in range(len(words.split()))],
            max(1, int(out * rng.uniform(0.9, 1.1))),
            session_id=f"{seed}-{i}",
            prompt_text=words,
        )


def test_text_model_learns_what_the_words_ask_for(tmp_path):
    settings = TextSettings(**SMALL)
    model = text.train(settings, asked(0, 1500), log=lambda m: None)
    weights = tmp_path / "w.pt"
    text.save(model, settings, weights)
    p = TextLifetime(TextSettings(weights=str(weights), **SMALL), CTX)
    essay = p.sagellm_predict_lifetime(
        request=Request("e", [1, 2], 1, prompt_text="write a long detailed essay about trains")
    )
    yes_no = p.sagellm_predict_lifetime(
        request=Request("y", [1, 2], 1, prompt_text="answer yes or no: is trains true?")
    )
    assert essay.problem() is None and yes_no.problem() is None
    assert essay.output_tokens > 20 * yes_no.output_tokens
    assert len(essay.quantiles) == 9


def test_training_is_reproducible():
    settings = TextSettings(**{**SMALL, "epochs": 2})
    a = text.train(settings, asked(0, 300), log=lambda m: None).state_dict()
    b = text.train(settings, asked(0, 300), log=lambda m: None).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_online_steps_change_the_head_only(tmp_path):
    settings = TextSettings(**{**SMALL, "epochs": 1, "online_batch": 4, "online_learning_rate": 1e-2})
    weights = tmp_path / "w.pt"
    text.save(text.train(settings, asked(0, 300), log=lambda m: None), settings, weights)
    p = TextLifetime(
        TextSettings(
            **{**SMALL, "epochs": 1, "online_batch": 4, "online_learning_rate": 1e-2, "weights": str(weights)}
        ),
        CTX,
    )
    bag = p.model.bag.weight.clone()
    head = [w.clone() for w in p.model.head.parameters()]
    for r in list(asked(5, 4)):
        p.sagellm_predict_lifetime(request=r)
        p.sagellm_request_finished(outcome=RequestOutcome(r, 3000, 0, 0.0, 0.0, 1.0, 0, None))
    assert torch.equal(bag, p.model.bag.weight)
    assert any(not torch.equal(a, b) for a, b in zip(head, p.model.head.parameters()))


def test_missing_or_broken_weights_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"^lifetime plugin 'text': weights .*nope\.pt: no such file$"):
        TextLifetime(TextSettings(weights=str(tmp_path / "nope.pt")), CTX)
    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match=r"^lifetime plugin 'text': weights .*broken\.pt: "):
        TextLifetime(TextSettings(weights=str(broken)), CTX)


def test_default_weights_name_follows_training_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("SAGELLM_CACHE", str(tmp_path))
    a = text.default_weights(TextSettings())
    assert a.parent == tmp_path
    assert a == text.default_weights(TextSettings(online_batch=8))  # serving knobs do not retrain
    assert a != text.default_weights(TextSettings(epochs=2))


def _session_in(part, split):
    return next(f"s{i}" for i in range(10_000) if split.part_of(f"s{i}") == part)


def test_training_features_never_see_a_test_reply():
    from sagellm_plugin_lifetime.features import FEATURE_NAMES

    settings = TextSettings(**SMALL)
    split = text.split_of(settings)
    question = [5, 6, 7, 8, 9]
    test_turn = Request("t", question, 900, session_id=_session_in("test", split))
    train_turn = Request("u", question, 10, session_id=_session_in("train", split))
    rows, targets, dev = text.training_rows(settings, [test_turn, train_turn, train_turn])
    assert len(rows) == 2 and dev == [False, False]  # the training conversation's turns only
    seen = [dict(zip(FEATURE_NAMES, features)) for _, features in rows]
    assert seen[0]["has_message_history"] == 0.0  # the test reply to the same question is not known
    assert seen[1]["has_message_history"] == 1.0  # the training one is


def test_training_fits_train_stops_on_dev_and_never_reads_test():
    settings = TextSettings(**{**SMALL, "test_fraction": 0.3, "dev_fraction": 0.2})
    split = text.split_of(settings)
    requests = list(asked(3, 600))
    rows, _, dev = text.training_rows(settings, requests)
    kept = [r for r in requests if split.part(r) != "test"]
    assert len(rows) == len(kept) < len(requests)
    assert dev == [split.part(r) == "dev" for r in kept]
    assert any(dev) and not all(dev)


def _served(tmp_path, **extra):
    settings = TextSettings(**{**SMALL, "epochs": 2})
    weights = tmp_path / "w.pt"
    if not weights.exists():
        text.save(text.train(settings, asked(0, 400), log=lambda m: None), settings, weights)
    return TextLifetime(TextSettings(**{**SMALL, "epochs": 2, "weights": str(weights), **extra}), CTX)


def test_batched_prediction_equals_per_request_prediction(tmp_path):
    history = list(asked(7, 40))
    arriving = list(asked(8, 12))
    one, many = _served(tmp_path), _served(tmp_path)
    for p in (one, many):
        for r in history:
            p.sagellm_request_finished(outcome=RequestOutcome(r, r.output_tokens, 0, 0.0, 0.0, 1.0, 0, None))
    alone = [one.sagellm_predict_lifetime(request=r) for r in arriving]
    together = many.predict_batch(arriving)
    assert len(together) == len(alone)
    for a, b in zip(alone, together):
        assert a.quantiles == pytest.approx(b.quantiles, rel=1e-5)
        assert a.confidence == pytest.approx(b.confidence, rel=1e-5, abs=1e-9)


def test_warm_up_leaves_no_trace(tmp_path):
    cold, warm = _served(tmp_path, warmup_calls=0), _served(tmp_path, warmup_calls=3)
    assert not warm._pending and not warm.history.sessions and not warm.optimiser.state
    assert warm._accumulated == 0 and all(not g.any() for g in warm._grads)
    r = next(asked(9, 1))
    assert cold.sagellm_predict_lifetime(request=r).quantiles == warm.sagellm_predict_lifetime(request=r).quantiles


def test_online_update_per_finish_equals_one_batched_step(tmp_path):
    """Each finish adds its gradient; the step every online_batch finishes
    is the step autograd takes on the batch."""
    p = _served(tmp_path, online_batch=4, online_learning_rate=1e-2)
    reference = text.build_model(p.settings)
    reference.load_state_dict(p.model.state_dict())
    optimiser = torch.optim.Adam(reference.head.parameters(), lr=1e-2)
    requests = list(asked(5, 4))
    rows, targets = [], []
    for r in requests:
        rows.append(p._row(r))  # what it is predicted from
        p.sagellm_predict_lifetime(request=r)
        targets.append(text.log_tokens(3000))
        p.sagellm_request_finished(outcome=RequestOutcome(r, 3000, 0, 0.0, 0.0, 1.0, 0, None))
    loss = text.pinball(torch, reference.members_forward(*text._batch(torch, rows)), torch.tensor(targets))
    optimiser.zero_grad()
    loss.backward()
    optimiser.step()
    for ours, theirs in zip(p.model.head.parameters(), reference.head.parameters()):
        assert torch.allclose(ours, theirs, atol=1e-6)
    assert torch.equal(p.model.bag.weight, reference.bag.weight)
    assert p._accumulated == 0


def test_members_are_trained_apart_and_served_averaged():
    settings = TextSettings(**{**SMALL, "epochs": 1, "members": 3})
    model = text.train(settings, asked(0, 300), log=lambda m: None)
    batch = text._batch(
        torch, [(text.text_ids("write a long essay about jazz", settings.buckets), [0.5] * len(text.FEATURE_NAMES))]
    )
    with torch.no_grad():
        members = model.members_forward(*batch)
        served = model(*batch)
    assert members.shape == (3, 1, 9) and served.shape == (1, 9)
    assert not torch.equal(members[0], members[1])  # each its own start
    assert torch.allclose(served, members.sort(2).values.mean(0))
