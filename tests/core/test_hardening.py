"""The hardening examples, one test each, named for the class they belong to
(docs/benchmarks/hardening.md lists the classes; the fuzzing suite in
tests/fuzz covers each class more broadly)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import tarfile
from pathlib import Path

import pytest

from sagellm_core.cli import main
from sagellm_core.drivers.engines import build_engine
from sagellm_core.errors import TraceError
from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.replay import report, session, workloads

ROOT = Path(__file__).resolve().parents[2]
SMALL = """
[engine]
name = "replay"
mode = "{mode}"
[workload]
source = "mooncake"
path = "t.jsonl"
trace_block_tokens = 16
{workload}
[kv_pool]
plugin = "{pool}"
num_blocks = 64
"""
LINE = '{{"timestamp": {t}, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, {h}]}}\n'


@pytest.fixture
def trace_config(tmp_path):
    """A config replaying a small Mooncake trace next to it: (config path, trace path)."""

    def make(lines=None, mode="cache-only", workload="", pool="tiny"):
        trace = tmp_path / "t.jsonl"
        trace.write_text("".join(lines or [LINE.format(t=i * 10, h=3 + i) for i in range(5)]))
        config = tmp_path / "c.toml"
        config.write_text(SMALL.format(mode=mode, workload=workload, pool=pool))
        return config, trace

    return make


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


# -- class 2: every request read ends finished or rejected; strict JSON -------


@pytest.mark.parametrize("mode", ["timed", "cache-only"])
def test_class2_a_time_scale_that_overflows_an_arrival_is_refused_not_lost(sample_plugins, trace_config, capsys, mode):
    config, trace = trace_config([LINE.format(t=0, h=3), LINE.format(t=1e300, h=4)], mode=mode)
    assert main(["replay", "--config", str(config), "--quiet", "--set", "workload.time_scale=1e300"]) == 2
    err = one_line_error(capsys)
    assert str(trace) in err and "arrival_s = inf: finite seconds (time_scale may overflow it)" in err


def test_class2_the_report_counts_every_request_read_with_its_reason(sample_plugins, trace_config, tmp_path):
    hashes = ", ".join(str(i) for i in range(125))
    long_line = f'{{"timestamp": 50, "input_length": 2000, "output_length": 5, "hash_ids": [{hashes}]}}\n'
    config, _ = trace_config([LINE.format(t=0, h=3), long_line, LINE.format(t=90, h=4)], mode="timed")
    assert main(["replay", "--config", str(config), "--quiet", "--json", str(tmp_path / "r.json")]) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["requests_read"] == 3 and data["requests"] == 2 and data["rejected"] == 1
    assert data["rejections"] == {"never fits the pool": 1}


def test_class2_reports_are_strict_json():
    assert report.finite({"a": math.nan, "b": [math.inf, 1.5], "c": {"d": -math.inf}}) == {
        "a": None,
        "b": [None, 1.5],
        "c": {"d": None},
    }


def test_class2_an_engine_that_loses_a_request_is_named(sample_plugins, trace_config, monkeypatch):
    config, _ = trace_config()
    settings = session.load_settings(config)
    engine_class = type(build_engine(settings)[0])
    real_run = engine_class.run
    # An engine that drops the first request it reads on the floor.
    monkeypatch.setattr(
        engine_class, "run", lambda self, rt, requests, *a: real_run(self, rt, iter(list(requests)[1:]))
    )
    with pytest.raises(Exception, match=r"engine 'replay' read 5 requests but finished 4 and rejected 0"):
        session.run(settings)


# -- class 6: one line, never a traceback ----------------------------------------


def test_class6_a_folder_given_as_a_config_is_one_line(tmp_path, capsys):
    assert main(["replay", "--config", str(tmp_path), "--quiet"]) == 2
    assert one_line_error(capsys).startswith(f"sagellm: error: {tmp_path}: cannot read the config: ")


def test_class6_deeply_nested_toml_is_one_line(tmp_path, capsys):
    config = tmp_path / "deep.toml"
    config.write_text("x = " + "[" * 50_000 + "]" * 50_000 + "\n")
    assert main(["config", "check", str(config)]) == 2
    assert one_line_error(capsys).endswith("invalid TOML: arrays or tables nested too deeply")


def test_class6_deeply_nested_trace_lines_and_binary_traces_are_one_line(tmp_path):
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(TraceError, match=r"deep.jsonl:1: not a JSON object: nested too deeply"):
        list(workloads.mooncake(str(deep)))
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage\n")
    settings = settings_from_toml(f'[kv_pool]\nnum_blocks = 4\n[workload]\nsource = "mooncake"\npath = "{binary}"\n')
    with pytest.raises(TraceError, match=r"binary.jsonl: not UTF-8 text after request 0"):
        list(workloads.load(settings.workload))


def test_class6_an_over_long_csv_field_is_one_line(tmp_path):
    trace = tmp_path / "long.csv"
    trace.write_text(f'TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,"{"1" * 200_000}",3\n')
    settings = settings_from_toml(f'[kv_pool]\nnum_blocks = 4\n[workload]\nsource = "azure"\npath = "{trace}"\n')
    with pytest.raises(TraceError, match=r"long.csv: after request 0: field larger than field limit"):
        list(workloads.load(settings.workload))


@pytest.mark.parametrize(
    "flag, path, message",
    [
        ("--json", "missing/r.json", "no folder"),
        ("--markdown", ".", "is a folder"),
        ("--plot", "plot.txt", "a file ending in .png"),
    ],
)
def test_class6_output_paths_are_checked_before_the_run(
    sample_plugins, trace_config, tmp_path, capsys, monkeypatch, flag, path, message
):
    config, _ = trace_config()
    ran = []
    monkeypatch.setattr(session, "run", lambda *a, **k: ran.append(1))
    assert main(["replay", "--config", str(config), "--quiet", flag, str(tmp_path / path)]) == 2
    assert message in one_line_error(capsys) and not ran


@pytest.mark.parametrize("args", [["--max-requests", "abc"], ["--bogus"], ["--max-requests"]])
def test_class6_bad_command_line_arguments_are_one_line(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["replay", *args])
    assert exit_.value.code == 2
    error = one_line_error(capsys)
    assert error.startswith("sagellm") and ": error: " in error and "--help" in error


# -- class 7: smaller --------------------------------------------------------------


def test_class7_turns_zero_and_max_requests_zero_are_errors(sample_plugins, trace_config, capsys):
    config, _ = trace_config()
    assert main(["replay", "--config", str(config), "--quiet", "--max-requests", "0"]) == 2
    assert one_line_error(capsys).endswith("--max-requests 0: at least 1")
    generator = config.parent / "g.toml"
    generator.write_text('[kv_pool]\nplugin = "tiny"\nnum_blocks = 64\n[workload]\nturns = 0\n')
    assert main(["replay", "--config", str(generator), "--quiet"]) == 2
    assert one_line_error(capsys).endswith("[workload] turns = 0: a positive integer")


def test_class7_true_is_not_a_length(trace_config):
    config, trace = trace_config(['{"timestamp": 0, "input_length": true, "output_length": 5, "hash_ids": [1]}\n'])
    with pytest.raises(TraceError, match=r"input_length = True: a positive integer"):
        list(workloads.mooncake(str(trace), 16))


def test_class7_a_byte_order_mark_is_accepted_in_configs_and_traces(sample_plugins, trace_config, tmp_path):
    config, trace = trace_config()
    trace.write_bytes(b"\xef\xbb\xbf" + trace.read_bytes())
    config.write_bytes(b"\xef\xbb\xbf" + config.read_bytes())
    assert session.run(session.load_settings(config)).report["requests"] == 5
    csv = tmp_path / "t.csv"
    csv.write_bytes(b"\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,40,3\n")
    assert len(list(workloads.azure(str(csv)))) == 1


def test_class7_an_integer_is_accepted_where_a_plugin_expects_a_float():
    from attrs import field, frozen, validators

    from sagellm_core.registry import build_settings

    @frozen
    class Settings:
        share: float = field(default=0.1, validator=validators.instance_of(float))

    class Plugin:
        pass

    Plugin.Settings = Settings
    assert build_settings(Plugin, {"share": 0}, "here").share == 0.0
    assert isinstance(build_settings(Plugin, {"share": 1}, "here").share, float)


def test_class7_radix_events_stay_in_the_config_s_folder_and_config_check_creates_none(tmp_path, capsys):
    pytest.importorskip("sagellm_plugin_prefix_cache")
    base = (
        '[kv_pool]\nplugin = "paged"\nnum_blocks = 64\n[eviction]\nplugin = "lru"\n[prefix_cache]\nplugin = "radix"\n'
    )
    for events, message in (("../escape.jsonl", "without '..'"), ("/tmp/abs.jsonl", "without '..'")):
        config = tmp_path / "bad.toml"
        config.write_text(base + f'events = "{events}"\n')
        assert main(["config", "check", str(config)]) == 2
        assert message in one_line_error(capsys)
    folder = tmp_path / "configs"
    folder.mkdir()
    config = folder / "events.toml"
    config.write_text(
        base
        + 'events = "kv-events.jsonl"\n[workload]\ntenants = 1\nsessions_per_tenant = 2\nsystem_prompt_tokens = 64\n'
    )
    assert main(["config", "check", str(config)]) == 0
    assert not (folder / "kv-events.jsonl").exists() and not (tmp_path / "kv-events.jsonl").exists()
    assert main(["replay", "--config", str(config), "--quiet"]) == 0
    assert (folder / "kv-events.jsonl").read_text().startswith('{"type":"stored"')


def test_class7_the_vllm_suite_runner_checks_a_cached_archive(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "vllm_suite_run", ROOT / "plugins/sagellm-plugin-vllm/tests/vllm_suite/run.py"
    )
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    archive = tmp_path / f"vllm-{run.VERSION}.tar.gz"
    with tarfile.open(archive, "w:gz"):
        pass  # an archive that is not the sdist
    monkeypatch.setattr(run.urllib.request, "urlopen", lambda *a, **k: pytest.fail("fetched"))
    with pytest.raises(SystemExit, match=r"has sha256 .*, expected "):
        run.fetch_sdist(tmp_path)
    monkeypatch.setattr(run, "SDIST_SHA256", hashlib.sha256(archive.read_bytes()).hexdigest())
    (tmp_path / f"vllm-{run.VERSION}" / run.TESTS[0]).parent.mkdir(parents=True)
    (tmp_path / f"vllm-{run.VERSION}" / run.TESTS[0]).write_text("")
    assert run.fetch_sdist(tmp_path) == tmp_path / f"vllm-{run.VERSION}"
    archive.unlink()
    with pytest.raises(SystemExit, match=r"has no checked archive beside it"):
        run.fetch_sdist(tmp_path)
