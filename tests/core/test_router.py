"""The routing decision's host (``drivers/router.py``): the ``[router]``
plugin behind a checked call. Whatever a plugin answers, the caller gets a
decision it can act on or a one-line PluginError naming the plugin."""

from __future__ import annotations

import importlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sagellm_core.drivers.router import Router, check_route
from sagellm_core.errors import ConfigError, PluginError
from sagellm_core.kit.testing import declare_plugins, settings_from_toml
from sagellm_core.types import InstanceLoad, Request, RouteDecision

INSTANCES = (
    InstanceLoad("c0", "colocated", 0, 0, 0),
    InstanceLoad("p0", "prefill", 0, 0, 0),
    InstanceLoad("d0", "decode", 0, 0, 0),
)
REQUEST = Request("r1", [1, 2, 3], 4)


PLUGIN = """
from sagellm_core import hookimpl


class Scripted:
    \"\"\"Answers whatever the test put in ``ANSWER``.\"\"\"

    ANSWER = None

    def __init__(self, settings, context):
        pass

    @hookimpl
    def sagellm_route_request(self, request, instances, now_s):
        if isinstance(Scripted.ANSWER, BaseException):
            raise Scripted.ANSWER
        return Scripted.ANSWER


class NotARouter:
    def __init__(self, settings, context):
        pass
"""


@pytest.fixture
def router(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "scripted_router.py").write_text(PLUGIN)
    declare_plugins(
        tmp_path, {"sagellm.router": {"scripted": "scripted_router:Scripted", "lazy": "scripted_router:NotARouter"}}
    )
    build = lambda name="scripted": Router(  # noqa: E731
        settings_from_toml(f'[kv_pool]\nnum_blocks = 8\n[router]\nplugin = "{name}"\n')
    )
    build.scripted = importlib.import_module("scripted_router").Scripted
    return build


@pytest.mark.parametrize("answer", [RouteDecision("c0"), RouteDecision("p0", "d0")])
def test_a_sound_decision_goes_through(router, answer):
    router.scripted.ANSWER = answer
    assert router().route(REQUEST, INSTANCES, 0.0) == answer


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (None, "no answer"),
        ("c0", "str, not a RouteDecision"),
        (RouteDecision("x9"), "'x9': no such instance"),
        (RouteDecision("d0"), "a decode instance"),
        (RouteDecision("p0"), "decode instance None for prefill instance 'p0'"),
        (RouteDecision("p0", "c0"), "'c0' for prefill instance 'p0': not a decode instance"),
        (RouteDecision("c0", "d0"), "colocated instance 'c0', which decodes itself"),
        (ValueError("no\nroute"), "raised in sagellm_route_request: ValueError: no route"),
    ],
)
def test_a_bad_decision_is_one_line_naming_the_plugin(router, answer, says):
    router.scripted.ANSWER = answer
    with pytest.raises(PluginError) as caught:
        router().route(REQUEST, INSTANCES, 0.0)
    message = str(caught.value)
    assert "router plugin 'scripted'" in message and says in message and "\n" not in message


def test_a_config_without_a_router_or_with_a_plugin_that_cannot_route_is_refused(router):
    with pytest.raises(ConfigError, match="missing section \\[router\\]"):
        Router(settings_from_toml("[kv_pool]\nnum_blocks = 8\n"))
    with pytest.raises(ConfigError, match="does not implement sagellm_route_request"):
        router("lazy")
    with pytest.raises(ConfigError, match="unknown router plugin 'nope'"):
        router("nope")


ids = st.sampled_from(["c0", "p0", "d0", "x9", ""])


@settings(max_examples=200, deadline=None)
@given(instance=ids, decode=st.one_of(st.none(), ids))
def test_check_route_accepts_exactly_what_an_engine_can_act_on(instance, decode):
    problem = check_route(RouteDecision(instance, decode), INSTANCES)
    sound = (instance == "c0" and decode is None) or (instance == "p0" and decode == "d0")
    assert (problem is None) == sound
