"""The engine protocol (``drivers.step_engine``): replay's timed mode is an
engine like the torch engine, driven through ``add_request``, ``step``,
``abort`` and ``has_work``; the engine plugins' contract is checked when a
config builds one."""

from __future__ import annotations

import pytest

from sagellm_core.drivers.engines import EnginePlugin, LiveEngine, build_engine
from sagellm_core.drivers.step_engine import Engine
from sagellm_core.errors import ConfigError, RequestError
from sagellm_core.kit.testing import declare_plugins, settings_from_toml
from sagellm_core.replay import session
from sagellm_core.replay.engine import ReplayEngine, TimedReplay
from sagellm_core.types import Request, RequestStatus

CONFIG = """
[engine]
name = "replay"
max_num_batched_tokens = 64
max_num_seqs = 4
[prefix_cache]
plugin = "radix"
block_size = 4
[kv_pool]
plugin = "paged"
num_blocks = 32
[eviction]
plugin = "lru"
[report]
hook_timing = false
"""


@pytest.fixture
def engine() -> TimedReplay:
    settings = settings_from_toml(CONFIG)
    plugin, _ = build_engine(settings)
    assert isinstance(plugin, ReplayEngine)
    return TimedReplay(session.build_runtime(settings, plugin), plugin.settings, plugin.cost)


def request(name: str, prompt: int = 20, output: int = 3) -> Request:
    return Request(name, list(range(prompt)), output, output_token_ids=[900 + i for i in range(output)])


def test_timed_replay_is_an_engine_and_serves_requests_step_by_step(engine):
    assert isinstance(engine, Engine)
    for name in ("a", "b"):
        engine.add_request(request(name))
    ended = []
    steps = 0
    while engine.has_work():
        outputs = engine.step()
        steps += 1
        assert all(out.token_id is None for out in outputs)  # replay samples no token ids
        ended += [(out.request_id, out.finish_reason) for out in outputs]
    # Both prefill in the first step (their first token), then two more decodes each.
    assert steps == 3 and sorted(ended) == [("a", "length"), ("b", "length")]
    assert engine.steps == 3 and engine.batched_tokens == 20 + 20 + 2 + 2
    rt = engine.rt
    assert rt.counters.requests_finished == 2 and rt.in_flight == 0 and engine.requests == {}
    rt.check_invariants()


def test_an_abort_ends_a_waiting_or_a_running_request_and_frees_its_blocks(engine):
    engine.add_request(request("running", output=50))
    engine.step()
    engine.add_request(request("waiting", prompt=200))  # waits: 64 tokens of budget, the first one runs
    running, waiting = engine.requests["running"], engine.requests["waiting"]
    assert running.status is RequestStatus.RUNNING and waiting.status is RequestStatus.WAITING
    out = engine.abort("running")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert out.outcome is not None and out.outcome.num_output_tokens == 1
    assert engine.abort("waiting").outcome.num_output_tokens == 0
    assert engine.abort("never-seen") is None
    assert not engine.has_work() and engine.rt.in_flight == 0
    engine.rt.check_invariants()


def test_a_request_id_in_flight_is_refused_and_nothing_changes(engine):
    engine.add_request(request("a"))
    with pytest.raises(RequestError, match=r"^request a: a request with this id is in flight$"):
        engine.add_request(request("a"))
    assert len(engine.waiting) == 1 and list(engine.requests) == ["a"]


def test_a_request_that_can_never_fit_is_rejected_when_nothing_runs(engine):
    engine.add_request(request("huge", prompt=32 * 4, output=1))  # 33 blocks of a 32-block pool
    engine.add_request(request("small"))
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("huge", "rejected")]
    assert engine.steps == 0  # a step that only rejects executes nothing
    assert engine.rt.counters.rejections == {"never fits the pool": 1}
    assert list(engine.requests) == ["small"]


def test_the_engine_plugins_are_engine_plugins_and_only_torch_serves_live():
    plugin, _ = build_engine(settings_from_toml(CONFIG))
    assert isinstance(plugin, EnginePlugin) and not isinstance(plugin, LiveEngine)


def test_an_engine_plugin_that_breaks_the_contract_is_named_in_one_line(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "not_an_engine.py").write_text(
        "class NotAnEngine:\n    def __init__(self, settings, context):\n        pass\n"
    )
    declare_plugins(tmp_path, {"sagellm.engines": {"nothing": "not_an_engine:NotAnEngine"}})
    settings = settings_from_toml(
        '[engine]\nname = "nothing"\n[kv_pool]\nplugin = "paged"\nnum_blocks = 8\n', "cfg.toml"
    )
    with pytest.raises(ConfigError) as err:
        build_engine(settings)
    assert str(err.value) == (
        "cfg.toml: [engine]: engine 'nothing' is not an engine plugin (it lacks run, owns, owns_unless_configured;"
        " sagellm_core.drivers.engines.EnginePlugin)"
    )
