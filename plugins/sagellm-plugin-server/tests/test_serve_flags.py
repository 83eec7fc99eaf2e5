"""``sagellm serve MODEL`` with vLLM's flags: each sets a config key, so
flags and a TOML file that says the same check the same."""

import argparse

import openai
import pytest
from sagellm_plugin_server import commands
from sagellm_plugin_server.testing import Server

from sagellm_core.cli import main

TOML = """
[engine]
name = "torch"
model = "{model}"
device = "cpu"
dtype = "float32"
max_model_len = 256
max_num_seqs = 4
max_num_batched_tokens = 128

[prefix_cache]
block_size = 8
{cache}
[kv_pool]
plugin = "paged"
num_blocks = 64

[eviction]
plugin = "lfu"

[scheduler]
passes = ["fcfs"]

[server]
model_name = "tiny"
"""
FLAGS = (
    "--device cpu --dtype float32 --max-model-len 256 --max-num-seqs 4 --max-num-batched-tokens 128"
    " --block-size 8 --num-blocks 64 --eviction lfu --served-model-name tiny"
).split()


def checked(capsys, argv: list[str]) -> list[str]:
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("cache", [True, False])
def test_flags_and_a_toml_file_check_the_same(tiny_model_dir, tmp_path, capsys, cache):
    path = tmp_path / "same.toml"
    path.write_text(TOML.format(model=tiny_model_dir, cache='plugin = "radix"' if cache else ""))
    from_file = checked(capsys, ["config", "check", str(path)])
    caching = "--enable-prefix-caching" if cache else "--no-enable-prefix-caching"
    from_flags = checked(capsys, ["serve", str(tiny_model_dir), *FLAGS, caching, "--check"])
    picked = f"scheduler=fcfs, {'prefix_cache=radix, ' if cache else ''}kv_pool=paged, eviction=lfu"
    assert from_file[0] == f"{path}: ok (engine torch; {picked})"
    assert from_flags[0].split(": ok ", 1)[1] == from_file[0].split(": ok ", 1)[1]
    assert from_flags[1:] == from_file[1:]
    assert any("'max_num_seqs': 4" in line and "'max_model_len': 256" in line for line in from_flags)
    assert "  server: {'max_waiting': 256, 'model_name': 'tiny', 'pin_budget_blocks': 64}" in from_flags


def test_flags_and_set_override_a_config_file(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "base.toml"
    path.write_text(TOML.format(model=tiny_model_dir, cache='plugin = "radix"'))
    by_set = checked(
        capsys, ["config", "check", str(path), "--set", "engine.max_num_seqs=2", "--set", "eviction.plugin=lru"]
    )
    by_flags = checked(capsys, ["serve", "--config", str(path), "--max-num-seqs", "2", "--eviction", "lru", "--check"])
    by_serve_set = checked(
        capsys, ["serve", "--config", str(path), "--set", "engine.max_num_seqs=2", "--eviction", "lru", "--check"]
    )
    assert by_set == by_flags == by_serve_set
    assert "eviction=lru" in by_set[0] and any("'max_num_seqs': 2" in line for line in by_set)
    unchanged = checked(capsys, ["config", "check", str(path)])
    assert any("'max_num_seqs': 4" in line for line in unchanged)


def test_no_prefix_caching_keeps_a_block_size_given_by_set(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "base.toml"
    path.write_text(TOML.format(model=tiny_model_dir, cache='plugin = "radix"'))
    out = checked(
        capsys,
        [
            "serve",
            "--config",
            str(path),
            "--set",
            "prefix_cache.block_size=16",
            "--no-enable-prefix-caching",
            "--check",
        ],
    )
    assert "prefix_cache=" not in out[0] and "  block_size: 16" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--max-num-seqs", "3", "--set", "engine.max_num_seqs=2"],
            "--max-num-seqs 3 and --set engine.max_num_seqs=...: both set engine.max_num_seqs; give one",
        ),
        (["--no-enable-prefix-caching", "--set", "prefix_cache.plugin=radix"], "--no-enable-prefix-caching"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5: a fraction in (0, 1]"),
        (["--max-num-seqs", "0"], "max_num_seqs = 0"),
        (["--eviction", "lur"], "unknown eviction plugin 'lur'"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(tiny_model_dir, capsys, argv, message):
    assert main(["serve", str(tiny_model_dir), *argv, "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_serve_needs_a_model_or_a_config(capsys):
    assert main(["serve", "--check"]) == 2
    assert "give a MODEL" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # argparse's own refusal
        main(["serve", "smollm2", "--num-blocks", "8", "--gpu-memory-utilization", "0.5"])
    assert exited.value.code == 2
    assert "--gpu-memory-utilization: not allowed with argument --num-blocks" in capsys.readouterr().err


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    commands.sagellm_register_commands(subparsers=parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_gpu_memory_utilization_asks_the_engine_to_size_the_pool(tiny_model_dir):
    settings = commands.serve_settings(parse([str(tiny_model_dir), "--gpu-memory-utilization", "0.5"]))
    assert settings.num_blocks == "auto"
    assert settings.engine.params == {"model": str(tiny_model_dir), "device": "cpu", "gpu_memory_utilization": 0.5}


def test_async_scheduling_flag_sets_the_engine_key_either_way(tiny_model_dir, tmp_path):
    path = tmp_path / "async.toml"
    path.write_text(
        TOML.format(model=tiny_model_dir, cache="").replace(
            'dtype = "float32"', 'dtype = "float32"\nasync_scheduling = true'
        )
    )
    assert commands.serve_settings(parse(["--config", str(path)])).engine.params["async_scheduling"] is True
    off = commands.serve_settings(parse(["--config", str(path), "--no-async-scheduling"]))
    assert off.engine.params["async_scheduling"] is False
    on = commands.serve_settings(parse([str(tiny_model_dir), "--async-scheduling"]))
    assert on.engine.params["async_scheduling"] is True
    assert "async_scheduling" not in commands.serve_settings(parse([str(tiny_model_dir)])).engine.params


def test_serve_smollm2_without_a_config_file_answers():
    server = Server(args=["smollm2"])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["smollm2"]
        answer = client.completions.create(
            model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0
        )
        assert answer.choices[0].text and answer.choices[0].finish_reason in ("stop", "length")
        assert answer.usage.completion_tokens >= 1
    finally:
        server.stop()
