"""The sagellm runtime of a live vLLM: built from the config file a user
names, sized to the pool vLLM actually allocated."""

from __future__ import annotations

import os

import attrs

from sagellm_core import config as config_mod
from sagellm_core.errors import ConfigError
from sagellm_core.runtime import Runtime

CONFIG_ENV = "SAGELLM_CONFIG"
#: vLLM serves these sections with its own hash table and block pool.
ENGINE_OWNS = ("prefix_cache", "kv_pool")


def load_runtime(num_blocks: int, block_size: int, path: str | None = None) -> Runtime:
    """The runtime for the config at ``path`` (else ``$SAGELLM_CONFIG``).
    vLLM's pool size and block size replace the config's: inside vLLM they
    are vLLM's to decide."""
    path = path or os.environ.get(CONFIG_ENV)
    if not path:
        raise ConfigError(
            "sagellm-plugin-vllm: no sagellm config; pass --additional-config"
            f" '{{\"sagellm_config\": \"FILE\"}}' or set {CONFIG_ENV}"
        )
    settings = attrs.evolve(config_mod.load(path), num_blocks=num_blocks, block_size=block_size)
    return Runtime(settings, engine_owns=ENGINE_OWNS)
