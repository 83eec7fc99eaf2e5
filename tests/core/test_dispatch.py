"""sagellm's hook dispatch answers as pluggy does: the same implementations
in the same order, the same answers, wrappers and late registrations
included."""

from collections.abc import Generator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sagellm_core import hookspecs
from sagellm_core.dispatch import Dispatch, PluginManager
from sagellm_core.hookspecs import hookimpl
from sagellm_core.timing import HookTimer


def manager() -> PluginManager:
    pm = PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def answering(tag: int, answer: int | None, order: str, calls: list[int]) -> object:
    """A plugin whose two hooks (a firstresult one, and one whose answers
    are listed) log its tag and answer ``answer``."""
    opts = {"tryfirst": order == "first", "trylast": order == "last"}

    class Plugin:
        @hookimpl(**opts)
        def sagellm_pool_usage(self):
            calls.append(tag)
            return answer

        @hookimpl(**opts)
        def sagellm_schedule_pass(self, ir):
            calls.append(tag)
            return None if answer is None else (answer, ir)

    return Plugin()


plugin_specs = st.lists(
    st.tuples(st.none() | st.integers(0, 9), st.sampled_from(["first", "plain", "last"])), min_size=0, max_size=6
)


@given(plugin_specs, st.integers(0, 6))
def test_answers_and_call_order_are_pluggys(specs, registered_before_first_call):
    # Some plugins are registered after the dispatch has planned the hooks:
    # it must see them as pluggy does.
    pm, pluggy_calls, our_calls = manager(), [], []
    ours = Dispatch(pm, HookTimer())
    plugins = [(tag, answer, order) for tag, (answer, order) in enumerate(specs)]
    log: list[int] = []
    for i, (tag, answer, order) in enumerate(plugins):
        if i == registered_before_first_call:
            ours.call("sagellm_pool_usage", {})
        pm.register(answering(tag, answer, order, log))
    for hook, kwargs in (("sagellm_pool_usage", {}), ("sagellm_schedule_pass", {"ir": "ir"})):
        log.clear()
        expected = getattr(pm.hook, hook)(**kwargs)
        pluggy_calls = list(log)
        log.clear()
        assert ours.call(hook, kwargs) == expected
        our_calls = list(log)
        assert our_calls == pluggy_calls


def test_an_unregistered_plugin_is_not_called():
    pm, log = manager(), []
    plugin = answering(1, 5, "plain", log)
    pm.register(plugin)
    ours = Dispatch(pm)
    assert ours.call("sagellm_pool_usage", {}) == 5
    pm.unregister(plugin)
    assert ours.call("sagellm_pool_usage", {}) is None
    assert ours.call("sagellm_schedule_pass", {"ir": None}) == []


def test_a_wrapper_runs_through_pluggy():
    pm, log = manager(), []

    class Doubling:
        @hookimpl(wrapper=True)
        def sagellm_pool_usage(self) -> Generator[None, int, int]:
            return 2 * (yield)

    pm.register(answering(1, 21, "plain", log))
    ours = Dispatch(pm)
    assert ours.call("sagellm_pool_usage", {}) == 21
    pm.register(Doubling())
    assert ours.call("sagellm_pool_usage", {}) == 42


def test_the_timer_counts_calls_answers_and_errors():
    pm, log = manager(), []
    timer = HookTimer()
    ours = Dispatch(pm, timer)
    ours.call("sagellm_pool_usage", {})  # nobody answers

    class Failing:
        @hookimpl
        def sagellm_pool_usage(self):
            raise ValueError("broken")

    pm.register(answering(1, 3, "plain", log))
    ours.call("sagellm_pool_usage", {})
    pm.register(Failing())
    with pytest.raises(ValueError, match="broken"):
        ours.call("sagellm_pool_usage", {})
    stats = timer.stats["sagellm_pool_usage"]
    assert (stats.calls, stats.answered, stats.errors) == (3, 1, 1)
    assert len(stats.durations_s) == 3
