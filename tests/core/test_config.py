"""Config errors: each one line naming the file, the key, the bad value and
what is accepted."""

from pathlib import Path

import pytest

from sagellm_core import config
from sagellm_core.cli import parse_override
from sagellm_core.errors import ConfigError
from sagellm_core.kit.testing import declare_plugins, settings_from_toml

HERE = Path(__file__).parent


@pytest.fixture
def sections(tmp_path, monkeypatch):
    """``[greeting]``, declared by a synthetic distribution."""
    monkeypatch.syspath_prepend(str(HERE))
    declare_plugins(tmp_path, {"sagellm.sections": {"greeting": "sample_plugins:GreetingSettings"}})


GOOD = """
[engine]
name = "replay"
mode = "cache-only"
[prefix_cache]
plugin = "radix"
block_size = 32
[kv_pool]
plugin = "paged"
num_blocks = 100
[eviction]
plugin = "lru"
[scheduler]
passes = ["fcfs", "prefix-aware"]
[scheduler.prefix-aware]
max_queue = 8
[transport]
plugin = "local"
host_blocks = 10
[kv_stores]
tiers = ["host"]
bytes_per_block = 64
[kv_stores.host]
capacity_blocks = 100
[workload]
source = "generator"
tenants = 2
"""


def test_good_config_is_typed():
    s = settings_from_toml(GOOD, "good.toml")
    assert s.block_size == 32 and s.num_blocks == 100
    assert s.engine.name == "replay" and s.engine.params == {"mode": "cache-only"}
    assert [p.name for p in s.passes] == ["fcfs", "prefix-aware"]
    assert s.passes[1].params == {"max_queue": 8}
    assert s.transport.params == {"host_blocks": 10}
    assert [(t.name, t.params) for t in s.kv_stores.tiers] == [("host", {"capacity_blocks": 100})]
    assert s.kv_stores.bytes_per_block == 64 and s.kv_stores.tiers[0].where == "good.toml: [kv_stores.host]"
    assert s.workload.options.tenants == 2 and s.workload.options.turns == 4  # the generator's keys


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            ("num_blocks = 100", "num_blocks = -3"),
            'good.toml: [kv_pool] num_blocks = -3: a number of blocks from 1 to 16,777,216, or "auto"',
        ),
        (
            ("num_blocks = 100", "num_blocks = 'many'"),
            "good.toml: [kv_pool] num_blocks = 'many': a number of blocks from 1 to 16,777,216, or \"auto\"",
        ),
        (("num_blocks = 100", ""), "good.toml: [kv_pool]: missing key 'num_blocks'"),
        (
            ("block_size = 32", "block_size = 0"),
            "good.toml: [prefix_cache] block_size = 0: a positive number of tokens",
        ),
        (("[workload]", "[wrkload]"), "good.toml: unknown section [wrkload]; accepted: engine,"),
        (("tenants = 2", 'tenants = 2\ncolour = "red"'), "good.toml: [workload]: unknown key 'colour'"),
        (("tenants = 2", "tenants = -1"), "good.toml: [workload] tenants = -1: a non-negative integer"),
        (
            ('source = "generator"', 'source = "kafka"'),
            "good.toml: [workload] source = 'kafka': accepted: generator, mooncake, azure",
        ),
        (
            ('source = "generator"', 'source = "mooncake"'),
            "good.toml: [workload] source = 'mooncake' needs path = FILE",
        ),
        (
            ('passes = ["fcfs", "prefix-aware"]', 'passes = ["fcfs", "fcfs"]'),
            "good.toml: [scheduler] passes = ['fcfs', 'fcfs']: each pass at most once",
        ),
        (
            ('passes = ["fcfs", "prefix-aware"]', 'passes = "fcfs"'),
            "good.toml: [scheduler] passes = 'fcfs': a list of pass names",
        ),
        (
            ('passes = ["fcfs", "prefix-aware"]', 'passes = ["fcfs"]'),
            "good.toml: [scheduler]: unknown key 'prefix-aware'",
        ),
        (('tiers = ["host"]', 'tiers = "host"'), "good.toml: [kv_stores] tiers = 'host': a list of store names"),
        (
            ('tiers = ["host"]', 'tiers = ["host", "host"]'),
            "good.toml: [kv_stores] tiers = ['host', 'host']: each store at most once",
        ),
        (('tiers = ["host"]', "tiers = []"), "good.toml: [kv_stores]: [kv_stores.host] is not among tiers = []"),
        (
            ("bytes_per_block = 64", "bytes_per_block = 0"),
            "good.toml: [kv_stores] bytes_per_block = 0: a positive number of bytes",
        ),
        (('[eviction]\nplugin = "lru"', ""), "good.toml: [prefix_cache] is set but [eviction] is missing"),
    ],
)
def test_bad_config_is_one_line_naming_the_culprit(edit, expected):
    text = GOOD.replace(*edit)
    with pytest.raises(ConfigError) as err:
        settings_from_toml(text, "good.toml")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(expected), message


def test_invalid_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine\nname = 1\n")
    with pytest.raises(ConfigError, match=r"bad.toml: invalid TOML: .*line 1"):
        config.load(bad)
    with pytest.raises(ConfigError, match=r"nope.toml: no such config file"):
        config.load(tmp_path / "nope.toml")


def test_trace_path_is_relative_to_the_config_file(tmp_path):
    (tmp_path / "sub").mkdir()
    cfg = tmp_path / "sub" / "c.toml"
    cfg.write_text('[kv_pool]\nplugin = "paged"\nnum_blocks = 4\n[workload]\nsource = "azure"\npath = "../t.csv"\n')
    assert config.load(cfg).workload.path == str(tmp_path / "sub" / ".." / "t.csv")


@pytest.mark.parametrize(
    "text, keys, values",
    [
        ("kv_pool.num_blocks=2000,5000", ("kv_pool", "num_blocks"), [2000, 5000]),
        ("eviction.plugin=lru,belady", ("eviction", "plugin"), ["lru", "belady"]),
        ('engine.mode="timed"', ("engine", "mode"), ["timed"]),
        ('scheduler.passes=["fcfs"]', ("scheduler", "passes"), [["fcfs"]]),
        ("scheduler.prefix-aware.max_queue=4", ("scheduler", "prefix-aware", "max_queue"), [4]),
    ],
)
def test_overrides_parse(text, keys, values):
    assert parse_override(text) == (keys, values)


def test_num_blocks_auto_is_the_one_string_a_pool_size_takes():
    settings = settings_from_toml(GOOD.replace("num_blocks = 100", 'num_blocks = "auto"'), "good.toml")
    assert settings.num_blocks == "auto"
    with pytest.raises(ConfigError, match=r'num_blocks = \'Auto\': a number of blocks from 1 to .*, or "auto"$'):
        settings_from_toml(GOOD.replace("num_blocks = 100", 'num_blocks = "Auto"'), "good.toml")


@pytest.mark.parametrize("text", ["num_blocks=3", "kv_pool.num_blocks", "kv_pool..x=1", "a.b="])
def test_bad_overrides(text):
    with pytest.raises(ConfigError, match=r"^--set "):
        parse_override(text)


def test_overrides_apply_before_validation(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[kv_pool]\nplugin = "paged"\nnum_blocks = 8\n')
    assert config.load(path, {("kv_pool", "num_blocks"): 64}).num_blocks == 64
    assert config.load(path, {("workload", "tenants"): 2}).workload.options.tenants == 2
    with pytest.raises(ConfigError, match=r"c.toml: \[kv_pool\] num_blocks = 0: a number of blocks from 1"):
        config.load(path, {("kv_pool", "num_blocks"): 0})


@pytest.mark.parametrize("value", ["0", "-1", '"soon"', "true"])
def test_ttft_slo_must_be_a_positive_number(value):
    with pytest.raises(ConfigError, match=r"good.toml: \[workload\] ttft_slo_s = .*: a positive number of seconds"):
        settings_from_toml(GOOD.replace("tenants = 2", f"tenants = 2\nttft_slo_s = {value}"), "good.toml")
    assert (
        settings_from_toml(GOOD.replace("tenants = 2", "tenants = 2\nttft_slo_s = 2"), "good.toml").workload.ttft_slo_s
        == 2
    )


def test_time_scale_must_be_positive():
    with pytest.raises(ConfigError, match=r"good.toml: \[workload\] time_scale = 0: a positive number"):
        settings_from_toml(GOOD.replace("tenants = 2", "tenants = 2\ntime_scale = 0"), "good.toml")


def test_session_range_must_be_a_range_within_0_and_1():
    from sagellm_core.errors import ConfigError
    from sagellm_core.kit.testing import settings_from_toml

    with pytest.raises(
        ConfigError, match=r"\[workload\] session_from = 0.5, session_to = 0.2: 0 <= session_from < session_to <= 1"
    ):
        settings_from_toml(
            '[kv_pool]\nnum_blocks = 8\nplugin = "paged"\n[workload]\nsession_from = 0.5\nsession_to = 0.2\n'
        )


@pytest.mark.parametrize(
    "section, words",
    [
        ("[greeting]\nrepeat = 0\n", r"^good.toml: \[greeting\] repeat = 0: a positive integer$"),
        ("[greeting]\nrepeat = -3\n", r"^good.toml: \[greeting\] repeat = -3: a non-negative integer$"),
        ('[greeting]\nrepeat = "many"\n', r"^good.toml: \[greeting\] repeat = 'many': a non-negative integer$"),
        ("[greeting]\nport = 8000\n", r"^good.toml: \[greeting\]: unknown key 'port'$"),
        (
            "[greting]\nrepeat = 1\n",
            r"^good.toml: unknown section \[greting\]; accepted: engine, .*, limits, (.*, )?greeting",
        ),
    ],
)
def test_a_section_an_installed_distribution_declares_is_checked_as_the_kernel_s(sections, section, words):
    with pytest.raises(ConfigError, match=words):
        settings_from_toml(GOOD + "\n" + section, "good.toml")
    good = settings_from_toml(GOOD + '\n[greeting]\nrepeat = 8\ntext = "hi"\n', "good.toml")
    greeting = good.section("greeting")
    assert type(greeting).__name__ == "GreetingSettings" and (greeting.repeat, greeting.text) == (8, "hi")
    default = settings_from_toml(GOOD, "good.toml").section("greeting")  # not in the file: its defaults
    assert (default.repeat, default.text) == (1, "hello")


def test_a_section_no_distribution_declares_is_refused_when_read():
    with pytest.raises(ConfigError, match=r"^good.toml: no installed distribution declares a section \[nothing\]$"):
        settings_from_toml(GOOD, "good.toml").section("nothing")


@pytest.mark.parametrize(
    "text, words",
    [
        (
            '[instance]\nrole = "encode"\n',
            r"^c.toml: \[instance\] role = 'encode': accepted: colocated, prefill, decode$",
        ),
        ('[instance]\nid = ""\n', r"^c.toml: \[instance\] id = '': a name for this instance$"),
        ("[instance]\nid = 3\n", r"^c.toml: \[instance\] id = 3: a string$"),
    ],
)
def test_an_instance_s_identity_is_checked(text, words):
    with pytest.raises(ConfigError, match=words):
        settings_from_toml("[kv_pool]\nnum_blocks = 8\n" + text, "c.toml")


def test_the_generator_s_keys_are_its_own_and_a_trace_takes_none():
    with pytest.raises(ConfigError, match=r"^good.toml: \[workload\]: unknown key 'tenants'$"):
        settings_from_toml(GOOD.replace('source = "generator"', 'source = "azure"\npath = "a.csv"'), "good.toml")
    moved = config.with_workload(settings_from_toml(GOOD, "good.toml"), source="azure", path="a.csv")
    assert moved.workload.options is None  # the generator's keys do not follow it to a trace


def test_a_byte_order_mark_is_accepted_and_binary_is_one_line(tmp_path):
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert config.load(bom).num_blocks == settings_from_toml(GOOD, "good.toml").num_blocks
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\x00\xff\xfe garbage")
    with pytest.raises(ConfigError, match=r"binary.toml: not UTF-8 text \(byte 1\); a config is a TOML file"):
        config.load(binary)


@pytest.mark.parametrize("key", ["tenants", "sessions_per_tenant", "turns"])
def test_generator_counts_must_be_positive(key):
    with pytest.raises(ConfigError, match=rf"good.toml: \[workload\] {key} = 0: a positive integer"):
        settings_from_toml(
            GOOD.replace("tenants = 2", f"tenants = 2\n{key} = 0" if key != "tenants" else "tenants = 0"), "good.toml"
        )


# Hardening classes 5 and 6: values that divided by zero, overflowed to
# infinity or allocated gigabytes are one-line errors at load.


@pytest.mark.parametrize(
    "section, line, message",
    [
        ("workload", "think_time_s = inf", "think_time_s = inf: a finite number >= 0"),
        ("workload", "time_scale = 1e400", "time_scale = inf: a finite number >= 0"),
        ("workload", "session_rate = nan", "session_rate = nan: a finite number >= 0"),
        ("workload", "trace_block_tokens = 0", "trace_block_tokens = 0: a positive integer"),
        ("workload", "trace_block_tokens = 1000000000", "trace_block_tokens = 1000000000: at most 4,194,304 tokens"),
        ("workload", "system_prompt_tokens = 100000000", "system_prompt_tokens = 100000000: at most 4,194,304 tokens"),
        (
            "kv_pool",
            "num_blocks = 1000000000",
            'num_blocks = 1000000000: a number of blocks from 1 to 16,777,216, or "auto"',
        ),
    ],
)
def test_class5_and_class6_unbounded_or_non_finite_values_are_refused(section, line, message):
    text = f'[kv_pool]\nplugin = "paged"\nnum_blocks = 64\n[{section}]\n{line}\n'
    if section == "kv_pool":
        text = f'[kv_pool]\nplugin = "paged"\n{line}\n'
    with pytest.raises(ConfigError) as err:
        settings_from_toml(text, "c.toml")
    assert str(err.value) == f"c.toml: [{section}] {message}"
