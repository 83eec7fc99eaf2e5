"""The cluster file of ``sagellm serve --cluster``: a good one gives each
instance an id, its config and its resources, and names the placement; a
bad one is one ConfigError line naming the file and the key, whatever it
holds (fuzzed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sagellm_plugin_cluster import clusterfile

from sagellm_core.errors import ConfigError

INSTANCE = """
[engine]
name = "{engine}"
model = "{model}"
[prefix_cache]
plugin = "radix"
block_size = {block_size}
[kv_pool]
plugin = "paged"
num_blocks = 64
[eviction]
plugin = "lru"
[scheduler]
passes = ["fcfs"]
"""


def instance_config(folder: Path, name: str, engine: str = "torch", model: str = "m", block_size: int = 16) -> str:
    (folder / name).write_text(INSTANCE.format(engine=engine, model=model, block_size=block_size))
    return name


def write(folder: Path, text: str) -> Path:
    path = folder / "cluster.toml"
    path.write_text(text)
    return path


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    instance_config(tmp_path, "a.toml")
    instance_config(tmp_path, "b.toml")
    return tmp_path


def test_instances_named_by_config_and_count(folder: Path) -> None:
    path = write(
        folder,
        '[router]\nplugin = "least-loaded"\n[[instance]]\nconfig = "a.toml"\ncount = 2\n'
        '[[instance]]\nconfig = "b.toml"\n',
    )
    spec = clusterfile.load(path)
    assert [i.instance_id for i in spec.instances] == ["a-0", "a-1", "b-0"]
    assert [i.config_path for i in spec.instances] == [folder / "a.toml"] * 2 + [folder / "b.toml"]
    assert {i.role for i in spec.instances} == {"colocated"}
    assert spec.router.plugin_name == "least-loaded"
    assert spec.start_timeout_s == 300


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (
            '[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\nreplicas = 2\n',
            "instance[0]: unknown key 'replicas'",
        ),
        ('speed = 1\n[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\n', "unknown key 'speed'"),
        ('[[instance]]\nconfig = "a.toml"\n', "[router] plugin: missing"),
        ('[router]\nplugin = "kv-aware"\n', "[[instance]]: missing"),
        ('[router]\nplugin = "kv-aware"\n[[instance]]\ncount = 2\n', "instance[0].config: missing"),
        (
            '[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "nope.toml"\n',
            "instance[0].config = 'nope.toml': no file",
        ),
        ('[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\ncount = 0\n', "instance[0].count = 0"),
        (
            '[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\nrole = "decoder"\n',
            "instance[0].role = 'decoder'",
        ),
        (
            'start_timeout_s = -1\n[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\n',
            "start_timeout_s = -1",
        ),
        ('[router]\nplugin = "no-such-router"\n[[instance]]\nconfig = "a.toml"\n', "[router]"),
        (
            'transport = "rdma"\n[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\n',
            "transport = 'rdma': no such transport; installed: gloo, mooncake",
        ),
        ('transport = 3\n[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\n', "transport = 3"),
        ("[router\n", "not TOML"),
        (
            'placement = "kubernetes"\n[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\n',
            "placement = 'kubernetes': no such placement; installed: local",
        ),
        ('placement = 3\n[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\n', "placement = 3"),
        (
            '[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\nnum_cpus = -1\n',
            "instance[0].num_cpus = -1: a number in [0, 1024]",
        ),
        (
            '[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\nnum_gpus = "one"\n',
            "instance[0].num_gpus = 'one'",
        ),
        (
            '[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\nhost = "127.0.0.2"\n',
            "instance[0].host = '127.0.0.2': only a prefill or decode instance's transport binds one",
        ),
        (
            '[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\nrole = "prefill"\nhost = "192.0.2.250"\n'
            '[[instance]]\nconfig = "b.toml"\nrole = "decode"\n',
            "instance[0].host = '192.0.2.250': not an address of this machine",
        ),
        (
            '[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\nrole = "decode"\nhost = 7\n'
            '[[instance]]\nconfig = "b.toml"\nrole = "prefill"\n',
            "instance[0].host = 7: an address of this machine",
        ),
        (
            'pd_on_front_node = "yes"\n[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\n',
            "pd_on_front_node = 'yes': true or false",
        ),
    ],
)
def test_bad_file_names_the_key(folder: Path, text: str, named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        clusterfile.load(write(folder, text))
    message = str(caught.value)
    assert named in message
    assert str(folder / "cluster.toml") in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("other", "named"),
    [
        ({"engine": "replay"}, "[engine] name = 'replay'"),
        ({"model": "other"}, "[engine] model 'other' differs"),
        ({"block_size": 4}, "[prefix_cache] (plugin, block size) ('radix', 4) differs"),
    ],
)
def test_instance_configs_must_agree(folder: Path, other: dict, named: str) -> None:
    instance_config(folder, "c.toml", **other)
    text = '[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\n[[instance]]\nconfig = "c.toml"\n'
    with pytest.raises(ConfigError, match=r"instance\[1\]\.config = 'c.toml'") as caught:
        clusterfile.load(write(folder, text))
    assert named in str(caught.value)


#: `sagellm serve` is the server plugin's command (the `serve` extra); `--cluster` joins it.
needs_serve = pytest.mark.skipif(
    importlib.util.find_spec("sagellm_plugin_server") is None, reason="sagellm serve needs sagellm-plugin-server"
)


@needs_serve
def test_sagellm_serve_cluster_refuses_a_bad_file_before_starting_anything(folder: Path, capsys) -> None:
    from sagellm_core.cli import main

    path = write(folder, '[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\ncount = 0\n')
    assert main(["serve", "--cluster", str(path)]) != 0
    error = capsys.readouterr().err.strip()
    assert "instance[0].count = 0" in error and "\n" not in error


@needs_serve
def test_sagellm_serve_cluster_refuses_one_engine_flags(folder: Path, capsys) -> None:
    from sagellm_core.cli import main

    path = write(folder, '[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\n')
    assert main(["serve", "--cluster", str(path), "--max-num-seqs", "4", "--device", "cpu"]) != 0
    error = capsys.readouterr().err.strip()
    assert "--device, --max-num-seqs" in error and "cluster file" in error


def test_the_transport_is_picked_by_name(folder: Path) -> None:
    path = write(folder, 'transport = "mooncake"\n[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\n')
    assert clusterfile.load(path).transport == "mooncake"
    path = write(folder, '[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\n')
    assert clusterfile.load(path).transport == "gloo"


def test_a_transport_whose_package_is_missing_names_its_pip_install() -> None:
    from sagellm_plugin_cluster.transports import MOONCAKE, Transport

    missing = Transport("x", "sagellm_plugin_cluster.gloo", "no_such_package.engine", "pip install x-transport")
    with pytest.raises(ConfigError) as caught:
        missing.check("cluster.toml: transport = 'x'")
    message = str(caught.value)
    assert message.startswith("cluster.toml: transport = 'x': transport 'x' needs no_such_package.engine")
    assert message.endswith("; pip install x-transport") and "\n" not in message
    if importlib.util.find_spec("mooncake") is None:
        with pytest.raises(ConfigError, match=r"pip install 'sagellm-plugin-cluster\[mooncake\]'"):
            MOONCAKE.check("transport")


def test_the_placement_and_each_instance_resources(folder: Path) -> None:
    path = write(
        folder,
        '[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\ncount = 2\nnum_cpus = 2\nnum_gpus = 0.5\n'
        '[[instance]]\nconfig = "b.toml"\n',
    )
    spec = clusterfile.load(path)
    assert spec.placement == "local"
    assert [(i.num_cpus, i.num_gpus) for i in spec.instances] == [(2.0, 0.5), (2.0, 0.5), (1.0, 0.0)]
    if importlib.util.find_spec("sagellm_plugin_ray") is not None:
        path = write(folder, 'placement = "ray"\n[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\n')
        assert clusterfile.load(path).placement == "ray"


def test_missing_file_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--cluster .*nowhere.toml"):
        clusterfile.load(tmp_path / "nowhere.toml")


scalars = st.one_of(
    st.integers(-3, 70), st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.text(max_size=8)
)
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.sampled_from(["a.toml", "b.toml", "kv-aware"]))
keys = st.sampled_from([*clusterfile.TOP_KEYS, *clusterfile.INSTANCE_KEYS, "plugin", "other"])
tables = st.dictionaries(keys, values, max_size=4)
files = st.fixed_dictionaries(
    {},
    optional={
        "start_timeout_s": values,
        "transport": st.one_of(values, st.sampled_from(["gloo", "mooncake", "nixl"])),
        "placement": st.one_of(values, st.sampled_from(["local", "ray"])),
        "router": st.one_of(values, tables, st.just({"plugin": "round-robin"})),
        "instance": st.one_of(values, st.lists(tables, max_size=3), st.just([{"config": "a.toml"}])),
        "other": values,
    },
)


def toml_value(value: Any) -> str:
    """``value`` as TOML: tables inline, so a list of tables is an array of
    them, as ``[[instance]]`` reads (a string TOML refuses makes a file the
    loader must refuse in one line too)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files)
def test_fuzz_any_table_loads_or_is_one_line_error(folder: Path, table: dict) -> None:
    path = write(folder, "".join(f"{json.dumps(key)} = {toml_value(value)}\n" for key, value in table.items()))
    try:
        spec = clusterfile.load(path)
    except ConfigError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc)
    else:
        assert spec.instances and all(i.config_path.is_file() for i in spec.instances)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=80))
def test_fuzz_any_bytes_load_or_are_one_line_error(folder: Path, data: bytes) -> None:
    path = folder / "cluster.toml"
    path.write_bytes(data)
    try:
        clusterfile.load(path)
    except ConfigError as exc:
        assert "\n" not in str(exc)


def test_prefill_and_decode_bind_their_transport_where_the_file_says(folder: Path) -> None:
    """An instance's ``host`` is the address its transport binds and
    advertises (the placement's, where it serves, by default); prefill and
    decode instances go where the placement puts them unless
    ``pd_on_front_node`` pins them to the front's machine."""
    pytest.importorskip("httpx")  # the launcher's (the serve extra's)
    from sagellm_plugin_cluster.launcher import instance_command

    from sagellm_core.drivers.placement import HOST

    text = (
        '[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "a.toml"\nrole = "prefill"\nhost = "127.0.0.2"\n'
        '[[instance]]\nconfig = "b.toml"\nrole = "decode"\n'
    )
    spec = clusterfile.load(write(folder, text))
    assert [i.host for i in spec.instances] == ["127.0.0.2", None] and not spec.pd_on_front_node
    commands = [instance_command(spec, i, "warning", ("127.0.0.1", 1234)) for i in spec.instances]
    hosts = [c.argv[c.argv.index("--transport-host") + 1] for c in commands]
    assert hosts == ["127.0.0.2", HOST]  # the decode instance's: the address it serves on, filled in by the placement
    assert [c.with_front for c in commands] == [False, False]
    pinned = clusterfile.load(write(folder, "pd_on_front_node = true\n" + text))
    assert [instance_command(pinned, i, "warning", ("h", 1)).with_front for i in pinned.instances] == [True, True]
