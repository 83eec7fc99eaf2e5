import random

import numpy as np
import pytest
from sagellm_plugin_lifetime.features import FEATURE_NAMES, History
from sagellm_plugin_lifetime.online import OnlineLifetime, OnlineSettings
from sagellm_plugin_lifetime.quantiles import prediction
from sagellm_plugin_lifetime.stat import StatLifetime, StatSettings

from sagellm_core import PluginContext
from sagellm_core.types import Request, RequestOutcome

CTX = PluginContext("online", block_size=4, num_blocks=1)


def finished(request, n=None):
    n = request.output_tokens if n is None else n
    return RequestOutcome(request, n, 0, 0.0, 0.0, 1.0, 0, None)


def conversations(seed, count, turns=6):
    """Sessions whose replies are all short (about 40) or all long (about
    700): the length of the previous reply predicts the next."""
    rng = random.Random(seed)
    for s in range(count):
        style = rng.choice((40, 700))
        prompt = [rng.randrange(1000) for _ in range(8)]
        for t in range(turns):
            out = max(1, int(style * rng.uniform(0.8, 1.2)))
            yield Request(f"s{seed}-{s}-t{t}", prompt, out, session_id=f"s{seed}-{s}")
            prompt = prompt + [7] * out + [rng.randrange(1000) for _ in range(5)]


def mae(predictor, requests):
    errors = []
    for r in requests:
        p = predictor.sagellm_predict_lifetime(request=r)
        if r.request_id.endswith(("t0",)) is False:
            errors.append(abs(p.output_tokens - r.output_tokens))
        predictor.sagellm_request_finished(outcome=finished(r))
    return sum(errors) / len(errors)


def test_online_learns_from_the_conversation_what_the_baseline_cannot():
    online = OnlineLifetime(OnlineSettings(), CTX)
    stat = StatLifetime(StatSettings(), CTX)
    for r in conversations(0, 400):  # learn
        online.sagellm_request_finished(outcome=finished(r))
        stat.sagellm_request_finished(outcome=finished(r))
    online_mae, stat_mae = mae(online, list(conversations(1, 100))), mae(stat, list(conversations(1, 100)))
    assert online_mae < 0.4 * stat_mae, (online_mae, stat_mae)


def test_online_prediction_is_sound_before_any_data():
    p = OnlineLifetime(OnlineSettings(prior_tokens=300), CTX).sagellm_predict_lifetime(request=Request("a", [1], 5))
    assert p.problem() is None
    assert p.output_tokens == pytest.approx(300) and p.confidence == 0.0  # nothing learned: no trust


def test_history_features_of_a_session_and_a_repeated_message():
    h = History(block_size=4)
    first = Request("a0", [1, 2, 3, 4, 5], 10, session_id="a")
    f0 = dict(zip(FEATURE_NAMES, h.features(first)))
    assert f0["has_previous"] == 0.0 and f0["has_message_history"] == 0.0
    h.observe(first, 10)
    second = Request("a1", [1, 2, 3, 4, 5] + [0] * 10 + [8, 9], 3, session_id="a")
    f1 = dict(zip(FEATURE_NAMES, h.features(second)))
    assert f1["has_previous"] == 1.0 and f1["turn"] == pytest.approx(1 / 20)
    assert f1["log_new_tokens"] == pytest.approx(np.log1p(2) / 8)  # only [8, 9] is new
    # Another conversation asking the first one's question again.
    again = Request("b0", [1, 2, 3, 4, 5], 12, session_id="b")
    fb = dict(zip(FEATURE_NAMES, h.features(again)))
    assert fb["has_message_history"] == 1.0 and fb["log_message_mean_output"] == pytest.approx(np.log1p(10) / 7)


def test_history_is_bounded():
    h = History(block_size=4, max_sessions=3, max_prefixes=3)
    for i in range(10):
        h.observe(Request(f"r{i}", [i, i, i, i, i], 5, session_id=f"s{i}"), 5)
    assert len(h.sessions) == 3 and len(h.prefixes) == 3 and len(h.messages) == 3
    assert list(h.sessions) == ["s7", "s8", "s9"]  # the most recent kept


def test_quantile_prediction_sorts_crossed_quantiles_and_bounds_confidence():
    p = prediction([6.0, 5.0, 5.5, 4.0, 5.2, 5.3, 5.9, 6.1, 7.0], "x", trust=3.0)
    assert list(p.quantiles) == sorted(p.quantiles)
    assert p.low_tokens <= p.output_tokens <= p.high_tokens
    assert 0.0 <= p.confidence <= 1.0 and p.problem() is None
    narrow = prediction([5.0] * 4 + [5.01] * 5, "x")
    wide = prediction([1.0, 2, 3, 4, 5, 6, 7, 8, 9], "x")
    assert narrow.confidence > wide.confidence


def test_features_of_requests_that_never_finish_are_bounded():
    from sagellm_plugin_lifetime.features import PendingFeatures

    pending = PendingFeatures(limit=3)
    for i in range(5):
        pending[f"r{i}"] = i
    assert list(pending) == ["r2", "r3", "r4"] and pending.pop("r3") == 3
