"""Class 1 of the hardening suite: plugin selection cannot be subverted. The
block-list covers every group (commands and workloads too), a blocked command
is not even imported, a name two distributions register is refused naming
both, and ``config check`` and the report name the distribution that provides
each plugin."""

from __future__ import annotations

import sys

import pytest

from sagellm_core import registry
from sagellm_core.cli import main
from sagellm_core.errors import ConfigError
from sagellm_core.kit.testing import declare_plugins, settings_from_toml
from sagellm_core.replay import session
from sagellm_core.runtime import Runtime

CONFIG = """
[kv_pool]
plugin = "tiny"
num_blocks = 8
[lifetime]
plugin = "{name}"
"""
COMMAND_MODULE = """
import os
from pathlib import Path

Path(os.environ["BOOM_MARKER"]).write_text("imported")


def sagellm_register_commands(subparsers):
    parser = subparsers.add_parser("boom", help="a third-party command")
    parser.set_defaults(func=lambda args: print("boom ran") or 0)
"""
WORKLOAD_MODULE = """
from sagellm_core.types import Request


def load(settings):
    for i in range(3):
        yield Request(f"w{i}", [1, 2, 3, i + 4], 2, arrival_s=float(i))
"""


@pytest.fixture
def second_distribution(sample_plugins, tmp_path, monkeypatch):
    """Another distribution that registers the sample distribution's
    ``fixed`` predictor's name too, a command and a workload."""
    folder = tmp_path / "second"
    folder.mkdir()
    (folder / "boom_command.py").write_text(COMMAND_MODULE)
    (folder / "tiny_workload.py").write_text(WORKLOAD_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("BOOM_MARKER", str(tmp_path / "imported"))
    declare_plugins(
        folder,
        {
            "sagellm.lifetime": {"fixed": "sample_plugins:Silent"},
            "sagellm.commands": {"boom": "boom_command"},
            "sagellm.workloads": {"tiny-workload": "tiny_workload:load"},
        },
        name="sagellm-second-party",
    )
    yield tmp_path / "imported"
    sys.modules.pop("boom_command", None)


def test_class1_a_name_two_distributions_register_is_refused_naming_both(second_distribution):
    with pytest.raises(ConfigError) as err:
        Runtime(settings_from_toml(CONFIG.format(name="fixed"), "cfg.toml"))
    message = str(err.value)
    assert message.startswith(
        "cfg.toml: [lifetime]: plugin 'fixed' (sagellm.lifetime) is registered by 2 distributions:"
    )
    assert "sagellm-sample-plugins 0.0.1" in message and "sagellm-second-party 0.0.1" in message
    assert "\n" not in message


def test_class1_a_first_party_name_registered_again_is_refused(sample_plugins, tmp_path, monkeypatch):
    if registry.find("sagellm.eviction", "lru", "-") is None:
        pytest.skip("sagellm-plugin-eviction is not installed here")
    monkeypatch.syspath_prepend(str(tmp_path / "impostor"))
    declare_plugins(tmp_path / "impostor", {"sagellm.eviction": {"lru": "sample_plugins:Silent"}}, name="impostor")
    text = CONFIG.format(name="silent") + '[prefix_cache]\nplugin = "radix"\n[eviction]\nplugin = "lru"\n'
    with pytest.raises(ConfigError, match=r"plugin 'lru' \(sagellm.eviction\) is registered by 2 distributions: "):
        Runtime(settings_from_toml(text, "cfg.toml"))


def test_class1_config_check_and_the_report_name_the_providing_distribution(sample_plugins, tmp_path, capsys):
    config = tmp_path / "cfg.toml"
    config.write_text(CONFIG.format(name="fixed") + "[workload]\ntenants = 1\nsessions_per_tenant = 1\nturns = 1\n")
    assert main(["config", "check", str(config)]) == 0
    out = capsys.readouterr().out
    assert "lifetime 'fixed': sagellm-sample-plugins 0.0.1 (sample_plugins:FixedLifetime)" in out
    report = session.run(session.load_settings(config)).report
    assert report["plugin_distributions"]["lifetime"] == "sagellm-sample-plugins 0.0.1"


def test_class1_command_plugins_are_not_imported_for_the_version(second_distribution, capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("sagellm ")
    assert not second_distribution.exists()


def test_class1_a_blocked_command_is_neither_imported_nor_run(second_distribution, monkeypatch, capsys):
    monkeypatch.setenv(registry.BLOCK_ENV, "sagellm.commands:boom")
    assert main(["hooks"]) == 0
    with pytest.raises(SystemExit) as exit_:
        main(["boom"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "invalid choice: 'boom'" in err and "\n" not in err
    assert not second_distribution.exists()


def test_class1_an_unblocked_command_runs(second_distribution, capsys):
    assert main(["boom"]) == 0
    assert "boom ran" in capsys.readouterr().out and second_distribution.exists()


def test_class1_a_blocked_workload_is_refused(second_distribution, monkeypatch, tmp_path, capsys):
    config = tmp_path / "w.toml"
    config.write_text(CONFIG.split("[lifetime]")[0] + '[workload]\nsource = "tiny-workload"\n')
    assert main(["replay", "--config", str(config), "--quiet"]) == 0
    monkeypatch.setenv(registry.BLOCK_ENV, "tiny-workload")
    assert main(["replay", "--config", str(config), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("plugin 'tiny-workload' (sagellm.workloads) is blocked by SAGELLM_BLOCK_PLUGINS")
    assert "\n" not in err


@pytest.mark.parametrize("blocked", ["LRU", "eviction:lru", "sagellm.commands:bom"])
def test_class1_a_misspelt_block_list_stops_every_command(second_distribution, monkeypatch, capsys, blocked):
    monkeypatch.setenv(registry.BLOCK_ENV, blocked)
    assert main(["hooks"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"sagellm: error: SAGELLM_BLOCK_PLUGINS: {blocked!r} match no installed plugin"
        " (spell NAME or GROUP:NAME, e.g. lru or sagellm.eviction:lru; `sagellm plugins` lists them)"
    )
    assert not second_distribution.exists()
