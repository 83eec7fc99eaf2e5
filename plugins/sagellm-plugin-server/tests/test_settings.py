"""``[server]`` is this distribution's section (``sagellm.sections``): the
core checks it when a config is read, and ``sagellm serve`` reads it."""

import pytest
from sagellm_plugin_server.settings import ServerSettings

from sagellm_core.errors import ConfigError
from sagellm_core.kit.testing import settings_from_toml

BASE = '[kv_pool]\nplugin = "paged"\nnum_blocks = 8\n'


@pytest.mark.parametrize(
    "section, words",
    [
        ("[server]\nmax_waiting = 0\n", r"^c.toml: \[server\] max_waiting = 0: a positive integer$"),
        ("[server]\nmax_waiting = -3\n", r"^c.toml: \[server\] max_waiting = -3: a non-negative integer$"),
        ('[server]\nmax_waiting = "many"\n', r"^c.toml: \[server\] max_waiting = 'many': a non-negative integer$"),
        ("[server]\nport = 8000\n", r"^c.toml: \[server\]: unknown key 'port'$"),
    ],
)
def test_the_server_section_is_checked_when_the_config_is_read(section, words):
    with pytest.raises(ConfigError, match=words):
        settings_from_toml(BASE + section, "c.toml")


def test_the_server_reads_its_section_or_its_defaults():
    settings = settings_from_toml(BASE + '[server]\nmax_waiting = 8\nmodel_name = "m"\n', "c.toml")
    assert settings.section("server") == ServerSettings(max_waiting=8, model_name="m")
    assert settings_from_toml(BASE, "c.toml").section("server") == ServerSettings()
