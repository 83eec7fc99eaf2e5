"""Plugin discovery: only selected plugins are imported; unknown, blocked,
misconfigured or broken plugins are one-line errors naming them."""

import sys

import pytest

from sagellm_core import registry
from sagellm_core.errors import ConfigError
from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.runtime import Runtime

BASE = """
[kv_pool]
plugin = "tiny"
num_blocks = 8
[lifetime]
plugin = "{name}"
{params}
"""


def runtime(name, params=""):
    return Runtime(settings_from_toml(BASE.format(name=name, params=params), "cfg.toml"))


def test_selected_plugins_are_registered_and_answer(sample_plugins):
    rt = runtime("fixed", "tokens = 7")
    assert [p.selection.name for p in rt.host.plugins["lifetime"]] == ["fixed"]
    assert rt.host.plugins["lifetime"][0].info.distribution == "sagellm-sample-plugins"
    assert rt.host.hook.sagellm_predict_lifetime(request=None).output_tokens == 7


def test_only_selected_plugins_are_imported(sample_plugins):
    runtime("fixed")
    assert "broken_plugin" not in sys.modules


def test_plugin_that_fails_to_import_is_named(sample_plugins):
    with pytest.raises(
        ConfigError,
        match=r"^cfg.toml: \[lifetime\]: plugin 'broken' \(broken_plugin:Nothing\) failed to import: RuntimeError",
    ):
        runtime("broken")


def test_unknown_plugin_lists_installed_and_names_the_distribution(sample_plugins):
    with pytest.raises(ConfigError) as err:
        runtime("fixd")
    # Other lifetime plugins may be installed beside the sample ones.
    assert str(err.value).startswith("cfg.toml: [lifetime]: unknown lifetime plugin 'fixd'; installed: broken, fixed, ")
    assert str(err.value).endswith(" (first-party lifetime plugins: pip install sagellm-plugin-lifetime)")


@pytest.mark.parametrize("blocked", ["fixed", "sagellm.lifetime:fixed", "silent, fixed"])
def test_environment_variable_blocks_plugins(sample_plugins, monkeypatch, blocked):
    monkeypatch.setenv(registry.BLOCK_ENV, blocked)
    with pytest.raises(ConfigError, match=r"plugin 'fixed' \(sagellm.lifetime\) is blocked by SAGELLM_BLOCK_PLUGINS"):
        runtime("fixed")


def test_block_list_of_another_plugin_does_not_block(sample_plugins, monkeypatch):
    monkeypatch.setenv(registry.BLOCK_ENV, "sagellm.lifetime:silent")
    runtime("fixed")


@pytest.mark.parametrize("blocked", ["FIXED", "lifetime:fixed", "sagellm.eviction:fixed", "fixed, nothing-like-it"])
def test_class1_a_block_list_item_that_matches_nothing_is_an_error(sample_plugins, monkeypatch, blocked):
    monkeypatch.setenv(registry.BLOCK_ENV, blocked)
    stray = [item.strip() for item in blocked.split(",") if item.strip() != "fixed"]
    with pytest.raises(ConfigError, match=rf"^SAGELLM_BLOCK_PLUGINS: {stray[0]!r} match no installed plugin "):
        runtime("fixed")


def test_unknown_parameter_is_an_error_not_dropped(sample_plugins):
    with pytest.raises(
        ConfigError, match=r"^cfg.toml: \[lifetime\] plugin 'fixed': unknown parameter 'tokns'; accepted: tokens$"
    ):
        runtime("fixed", "tokns = 3")


def test_parameter_is_validated_by_the_plugin_settings(sample_plugins):
    with pytest.raises(ConfigError, match=r"^cfg.toml: \[lifetime\] plugin 'fixed': bad value tokens = -3: "):
        runtime("fixed", "tokens = -3")
    with pytest.raises(ConfigError, match=r"bad value tokens = 'many'"):
        runtime("fixed", 'tokens = "many"')


def test_plugin_without_parameters_rejects_any(sample_plugins):
    with pytest.raises(ConfigError, match=r"unknown parameter 'x'; accepted: no parameters"):
        runtime("silent", "x = 1")


def test_plugin_implementing_none_of_its_hooks(sample_plugins):
    with pytest.raises(
        ConfigError,
        match=r"lifetime plugin 'silent' \(sagellm-sample-plugins 0.0.1\) does not implement sagellm_predict_lifetime",
    ):
        runtime("silent")


def test_misspelt_hook_is_rejected(sample_plugins):
    with pytest.raises(ConfigError, match=r"is not a valid plugin: .*sagellm_predict_lifetme"):
        runtime("misspelt")


def test_every_plugin_is_told_its_instance_colocated_by_default(sample_plugins):
    assert (runtime("fixed").host.plugins["lifetime"][0].instance.context.role) == "colocated"
    text = BASE.format(name="fixed", params="") + '[instance]\nid = "decode-1"\nrole = "decode"\n'
    context = Runtime(settings_from_toml(text, "cfg.toml")).host.plugins["lifetime"][0].instance.context
    assert (context.instance_id, context.role) == ("decode-1", "decode")


def test_runtime_state_is_clean_after_start(sample_plugins):
    rt = runtime("fixed")
    rt.check_invariants()
    assert rt.pool_usage().num_free_blocks == 8


def test_unknown_engine_names_its_adapter_distribution():
    from sagellm_core.drivers.engines import build_engine

    settings = settings_from_toml(
        '[engine]\nname = "sglang"\n[kv_pool]\nplugin = "paged"\nnum_blocks = 8\n', "cfg.toml"
    )
    with pytest.raises(ConfigError) as err:
        build_engine(settings)
    assert str(err.value).startswith("cfg.toml: [engine]: unknown engine plugin 'sglang'; installed: ")
    assert str(err.value).endswith("(first-party engine plugins: pip install sagellm-plugin-sglang)")


def test_unknown_executor_names_the_option_and_the_installed():
    from sagellm_core.replay import session

    with pytest.raises(ConfigError) as caught:
        session.run_many([], executor="slurm")
    message = str(caught.value)
    assert message.splitlines() == [message]
    assert "--executor slurm: no such executor; installed: local" in message
    assert "pip install sagellm-plugin-ray" in message


def test_a_blocked_executor_is_refused(monkeypatch, capsys):
    from sagellm_core.replay import session

    monkeypatch.setenv(registry.BLOCK_ENV, "sagellm.executors:local")
    with pytest.raises(ConfigError, match="--executor local: plugin 'local'.*blocked"):
        session.run_many([], executor="local")
