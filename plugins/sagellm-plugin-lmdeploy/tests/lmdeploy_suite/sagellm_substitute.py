"""pytest plugin: LMDeploy's own paging tests with sagellm's trie and
prefill reorderer installed (``install()``), under a config that reproduces
LMDeploy's defaults (``lmdeploy-defaults.toml``)."""

import os
from pathlib import Path

os.environ.setdefault("SAGELLM_CONFIG", str(Path(__file__).with_name("lmdeploy-defaults.toml")))

from sagellm_plugin_lmdeploy.install import install  # noqa: E402

install()


def pytest_report_header(config):
    return "sagellm: BlockTrie and _PrefillReorderer substituted by sagellm-plugin-lmdeploy"
