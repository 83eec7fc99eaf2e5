from pathlib import Path

import pytest

from sagellm_core.kit.testing import declare_plugins

HERE = Path(__file__).parent


@pytest.fixture
def sample_plugins(tmp_path, monkeypatch):
    """The plugins of ``sample_plugins.py`` (and one that fails to import),
    declared as entry points of a synthetic distribution."""
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.syspath_prepend(str(tmp_path))
    declare_plugins(
        tmp_path,
        {
            "sagellm.kv_pool": {"tiny": "sample_plugins:TinyPool"},
            "sagellm.lifetime": {
                "fixed": "sample_plugins:FixedLifetime",
                "silent": "sample_plugins:Silent",
                "misspelt": "sample_plugins:Misspelt",
                "broken": "broken_plugin:Nothing",
            },
        },
        name="sagellm-sample-plugins",
    )
