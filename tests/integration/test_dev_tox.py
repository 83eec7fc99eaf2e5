"""`python3 dev.py tox`: an existing tox env gets this repository's sources
as they are now. On a repository of one small project and a tox.ini, with
a real env made by uv: the env is left alone while nothing changed, the
project reinstalled once its sources change, the env removed (for tox to
make again) once its pyproject.toml changes or where it has no stamp."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "sagellm-plugin-tiny"
version = "0.1.0"
dependencies = []

[tool.setuptools]
packages = ["sagellm_plugin_tiny"]
"""

TOX_INI = """
[tox]
env_list = tiny, other

[testenv]
package = skip
deps =
    pytest>=8

[testenv:tiny]
deps =
    {[testenv]deps}
    {tox_root}/plugins/sagellm-plugin-tiny[extra]
    -r {tox_root}/requirements.txt

[testenv:other]
"""


@pytest.fixture
def dev(tmp_path, monkeypatch):
    """dev.py, its repository a folder of its own with one plugin."""
    uv = REPO / ".venv" / "bin" / "uv"
    if not uv.exists():
        pytest.skip("no uv in .venv (dev.py makes it)")
    spec = importlib.util.spec_from_file_location("dev_under_test", REPO / "dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (tmp_path / "tox.ini").write_text(TOX_INI)
    plugin = tmp_path / "plugins" / "sagellm-plugin-tiny"
    (plugin / "sagellm_plugin_tiny").mkdir(parents=True)
    (plugin / "pyproject.toml").write_text(PYPROJECT)
    (plugin / "sagellm_plugin_tiny" / "__init__.py").write_text("VALUE = 1\n")
    (plugin / "tests").mkdir()
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(module, "BIN", uv.parent)
    return module


def make_env(dev, env: str = "tiny", installed: bool = False) -> Path:
    """The env as tox leaves it: a venv (with the plugin installed, not
    editable, where ``installed``: a build, the slow part), its deps
    recorded, and dev.py's stamp written."""
    folder = dev.ROOT / ".tox" / env
    subprocess.run([str(dev.BIN / "uv"), "venv", "--quiet", "--python", sys.executable, str(folder)], check=True)
    if installed:
        install(dev, folder)
    (folder / ".tox-info.json").write_text(json.dumps({"PythonRun": {"deps": {"requirements": ["x"]}}}))
    # As dev.py stamps an env once tox has run in it (with -r: a fresh one).
    for stamped, sources in dev.refresh_tox_envs(["-e", env, "-r"]).items():
        (stamped / dev.TOX_STAMP).write_text(json.dumps(sources))
    return folder


def install(dev, folder: Path) -> None:
    plugin = dev.ROOT / "plugins" / "sagellm-plugin-tiny"
    command = [str(dev.BIN / "uv"), "pip", "install", "--quiet", "--python", str(folder / "bin" / "python")]
    subprocess.run([*command, str(plugin)], check=True)


def installed_value(folder: Path) -> str:
    code = "import sagellm_plugin_tiny as m; print(m.VALUE, m.__file__)"
    out = subprocess.run([str(folder / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True)
    value, where = out.stdout.split()
    assert str(folder) in where  # the env's own copy, not the source folder
    return value


def test_the_env_s_projects_are_those_of_its_deps(dev):
    import configparser

    ini = configparser.ConfigParser(interpolation=None, strict=False)
    ini.read(dev.ROOT / "tox.ini")
    assert dev.tox_envs([], ini) == ["tiny", "other"]
    assert dev.tox_envs(["-e", "other,tiny", "--", "-k", "x", "-e", "y"], ini) == ["other", "tiny"]
    assert dev.tox_envs(["-etiny"], ini) == ["tiny"]
    assert dev.tox_projects("tiny", ini) == ["plugins/sagellm-plugin-tiny"]
    assert dev.tox_projects("other", ini) == []


def test_unchanged_sources_leave_the_env_alone(dev):
    folder = make_env(dev, installed=True)
    before = (folder / dev.TOX_STAMP).read_text()
    installed = next(folder.rglob("sagellm_plugin_tiny/__init__.py"))
    mtime = installed.stat().st_mtime_ns
    # Files outside the wheel's packages (tests, caches) change nothing.
    (dev.ROOT / "plugins" / "sagellm-plugin-tiny" / "tests" / "test_x.py").write_text("")
    dev.refresh_tox_envs(["-e", "tiny"])
    assert installed.stat().st_mtime_ns == mtime
    assert (folder / dev.TOX_STAMP).read_text() == before


def test_changed_sources_are_reinstalled_into_the_env(dev):
    folder = make_env(dev, installed=True)
    assert installed_value(folder) == "1"
    (dev.ROOT / "plugins" / "sagellm-plugin-tiny" / "sagellm_plugin_tiny" / "__init__.py").write_text("VALUE = 2\n")
    dev.refresh_tox_envs(["-e", "tiny"])
    assert folder.exists() and installed_value(folder) == "2"
    # The stamp now names what the env holds: the next run leaves it alone.
    stamp = json.loads((folder / dev.TOX_STAMP).read_text())
    assert stamp == dev.tox_sources(["plugins/sagellm-plugin-tiny"])


@pytest.mark.parametrize("change", ["pyproject", "no stamp", "other projects"])
def test_the_env_is_removed_for_tox_to_make_again(dev, change):
    folder = make_env(dev)
    if change == "pyproject":
        pyproject = dev.ROOT / "plugins" / "sagellm-plugin-tiny" / "pyproject.toml"
        pyproject.write_text(PYPROJECT.replace("dependencies = []", 'dependencies = ["attrs"]'))
    elif change == "no stamp":
        (folder / dev.TOX_STAMP).unlink()
    else:
        stamp = json.loads((folder / dev.TOX_STAMP).read_text())
        (folder / dev.TOX_STAMP).write_text(json.dumps({**stamp, "plugins/gone": stamp["plugins/sagellm-plugin-tiny"]}))
    dev.refresh_tox_envs(["-e", "tiny"])
    assert not folder.exists()


def test_tox_s_own_recreate_or_a_missing_env_is_left_to_tox(dev):
    folder = make_env(dev)
    (dev.ROOT / "plugins" / "sagellm-plugin-tiny" / "pyproject.toml").write_text(PYPROJECT + "\n# changed\n")
    stamps = dev.refresh_tox_envs(["-e", "tiny", "-r"])
    assert folder.exists()  # tox recreates it
    assert stamps == {folder: dev.tox_sources(["plugins/sagellm-plugin-tiny"])}
    assert dev.refresh_tox_envs(["-e", "other"]) == {dev.ROOT / ".tox" / "other": {}}


def test_commands_that_run_no_env_change_none(dev):
    folder = make_env(dev)
    (folder / dev.TOX_STAMP).unlink()  # an env dev.py would make again before running it
    for args in (["-l"], ["list"], ["config", "-e", "tiny"], ["-e", "tiny", "--help"]):
        assert dev.refresh_tox_envs(args) == {}
        assert folder.exists()
    assert dev.runs_envs(["run", "-e", "tiny"]) and dev.runs_envs(["-e", "tiny", "-r"]) and dev.runs_envs([])
