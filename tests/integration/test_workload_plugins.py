"""A workload plugin's requests are checked as they are read: one line
naming the plugin, never a traceback."""

import pytest

from sagellm_core.cli import main
from sagellm_core.kit.testing import declare_plugins
from sagellm_core.types import Request

CONFIG = """
[workload]
source = "numbered-sessions"
session_to = 0.5
[prefix_cache]
plugin = "radix"
[kv_pool]
plugin = "paged"
num_blocks = 64
[eviction]
plugin = "lru"
[report]
hook_timing = false
"""


def numbered_sessions(settings):
    """Two turns of a session named by a number, not a string."""
    for turn in range(2):
        yield Request(f"r{turn}", [1, 2, 3] * (turn + 1), 4, session_id=7)


@pytest.fixture
def workload_plugin(tmp_path):
    declare_plugins(tmp_path, {"sagellm.workloads": {"numbered-sessions": f"{__name__}:numbered_sessions"}})


def test_a_session_id_that_is_not_a_string_is_one_line(workload_plugin, tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text(CONFIG)
    assert main(["replay", "--config", str(config), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "numbered-sessions" in err and "request 'r0' whose session_id is 7, not a string" in err
