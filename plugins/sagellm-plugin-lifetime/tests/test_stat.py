import pytest
from sagellm_plugin_lifetime.stat import StatLifetime, StatSettings

from sagellm_core import PluginContext
from sagellm_core.types import Request, RequestOutcome

CTX = PluginContext("stat", block_size=16, num_blocks=100)


def finish(p, tenant, n):
    r = Request("r", [1], n, tenant=tenant)
    p.sagellm_request_finished(outcome=RequestOutcome(r, n, 0, 0.0, 0.0, 1.0, 0, None))


def predict(p, tenant="a"):
    return p.sagellm_predict_lifetime(request=Request("x", [1], 1, tenant=tenant))


def test_prior_until_data_then_median_with_interval():
    p = StatLifetime(StatSettings(window=100, prior_tokens=300), CTX)
    first = predict(p)
    assert first.output_tokens == 300 and first.confidence == 0.0
    for n in range(1, 101):
        finish(p, "a", n)
    got = predict(p)
    assert got.output_tokens == 51 and got.low_tokens == 11 and got.high_tokens == 91
    assert got.confidence == 1.0


def test_per_tenant_with_global_fallback_and_window():
    p = StatLifetime(StatSettings(window=3), CTX)
    for n in (10, 10, 10):
        finish(p, "short", n)
    assert predict(p, "short").output_tokens == 10
    assert predict(p, "new-tenant").output_tokens == 10  # all tenants' history
    for n in (900, 900, 900):
        finish(p, "long", n)
    assert predict(p, "long").output_tokens == 900
    for n in (20, 20):
        finish(p, "short", n)
    assert predict(p, "short").output_tokens == 20  # only the last 3 count


def test_settings_validate():
    with pytest.raises(ValueError):
        StatSettings(window=0)
