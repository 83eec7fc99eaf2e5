"""Installing sagellm's decisions into LMDeploy.

LMDeploy has no plugin mechanism: the adapter rebinds the two module
attributes ``compat`` names, before a ``Scheduler`` is built, in the process
that builds it (with ``enable_mp_engine``, the engine process: import
``sagellm_plugin_lmdeploy.install`` and call :func:`install` there, e.g.
from a ``sitecustomize`` module).

* :func:`installed` (a context manager) for a harness that owns its runtime;
* :func:`install` for a live engine: each trie builds its runtime from the
  config named by ``$SAGELLM_CONFIG``, sized to LMDeploy's pool.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import attrs

from sagellm_core import config as config_mod
from sagellm_core.errors import ConfigError
from sagellm_core.runtime import Runtime

from sagellm_plugin_lmdeploy import compat
from sagellm_plugin_lmdeploy.reorder import SagellmPrefillReorderer
from sagellm_plugin_lmdeploy.trie import SagellmBlockTrie

CONFIG_ENV = "SAGELLM_CONFIG"
#: LMDeploy serves these sections with its own trie and allocator.
ENGINE_OWNS = ("prefix_cache", "kv_pool")


def load_runtime(num_blocks: int, block_size: int, path: str | None = None) -> Runtime:
    path = path or os.environ.get(CONFIG_ENV)
    if not path:
        raise ConfigError(f"sagellm-plugin-lmdeploy: no sagellm config; set {CONFIG_ENV}")
    settings = attrs.evolve(config_mod.load(path), num_blocks=num_blocks, block_size=block_size)
    return Runtime(settings, engine_owns=ENGINE_OWNS)


def install(runtime: Runtime | None = None) -> None:
    """Make every ``Scheduler`` built from now on use sagellm's trie and
    reorderer (with ``runtime``, or one per trie from ``$SAGELLM_CONFIG``)."""
    SagellmBlockTrie.runtime = runtime
    compat.scheduler_module.BlockTrie = SagellmBlockTrie
    compat.prefill_scheduler_module._PrefillReorderer = SagellmPrefillReorderer


def uninstall() -> None:
    SagellmBlockTrie.runtime = None
    compat.scheduler_module.BlockTrie = compat.BlockTrie
    compat.prefill_scheduler_module._PrefillReorderer = compat._PrefillReorderer


@contextmanager
def installed(runtime: Runtime | None = None):
    """:func:`install` for the ``with`` block; LMDeploy's own classes after."""
    install(runtime)
    try:
        yield
    finally:
        uninstall()
