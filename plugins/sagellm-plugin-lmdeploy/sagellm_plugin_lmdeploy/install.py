"""Installing sagellm's decisions into LMDeploy.

LMDeploy has no plugin mechanism: the adapter rebinds the module
attributes ``compat`` names (and wraps ``Scheduler.schedule_running``)
before a ``Scheduler`` is built, in the process that builds it (with
``enable_mp_engine``, the engine process: import
``sagellm_plugin_lmdeploy.install`` and call :func:`install` there, e.g.
from a ``sitecustomize`` module).

* :func:`installed` (a context manager) for a harness that owns its runtime;
* :func:`install` for a live engine: each trie builds its runtime from the
  config named by ``$SAGELLM_CONFIG``, sized to LMDeploy's pool.
"""

from __future__ import annotations

from contextlib import contextmanager

from sagellm_core.runtime import Runtime
from sagellm_plugin_lmdeploy import compat, lifecycle, preemption
from sagellm_plugin_lmdeploy.connector import NAME, SagellmConnector
from sagellm_plugin_lmdeploy.reorder import SagellmPrefillReorderer
from sagellm_plugin_lmdeploy.trie import SagellmBlockTrie


def build_kv_connector(role, cache_config, **kwargs):
    """LMDeploy's connector factory, knowing ``SagellmConnector`` too."""
    config = cache_config.kv_transfer_config
    if config is not None and config.kv_connector == NAME:
        return SagellmConnector(role, cache_config, runtime=SagellmBlockTrie.runtime)
    return compat.build_kv_connector(role, cache_config, **kwargs)


def install(runtime: Runtime | None = None, *, observe_requests: bool = True) -> None:
    """Make every ``Scheduler`` built from now on use sagellm's trie,
    eviction helper (preemption victims) and reorderer (with ``runtime``, or
    one per trie from ``$SAGELLM_CONFIG``), and ``--kv-transfer-config '{"kv_connector": "SagellmConnector", ...}'``
    build sagellm's connector (the engine and its model workers hold their
    own reference to LMDeploy's factory: both are rebound). With
    ``observe_requests``, sequences arriving and leaving are observed
    (:mod:`sagellm_plugin_lmdeploy.lifecycle`)."""
    SagellmBlockTrie.runtime = runtime
    SagellmBlockTrie.observe_requests = observe_requests
    compat.SequenceLifecycle.add_sequence = lifecycle.add_sequence
    compat.SequenceLifecycle.transition = lifecycle.transition
    compat.SequenceLifecycle.remove_sequence = lifecycle.remove_sequence
    compat.scheduler_module.BlockTrie = SagellmBlockTrie
    compat.scheduler_module.build_eviction_helper = preemption.build_eviction_helper
    compat.Scheduler.schedule_running = preemption.schedule_running
    compat.prefill_scheduler_module._PrefillReorderer = SagellmPrefillReorderer
    for module in compat.connector_factory_users():
        module.build_kv_connector = build_kv_connector


def uninstall() -> None:
    SagellmBlockTrie.runtime = None
    SagellmBlockTrie.observe_requests = True
    compat.SequenceLifecycle.add_sequence = compat.stock_add_sequence
    compat.SequenceLifecycle.transition = compat.stock_transition
    compat.SequenceLifecycle.remove_sequence = compat.stock_remove_sequence
    compat.scheduler_module.BlockTrie = compat.BlockTrie
    compat.scheduler_module.build_eviction_helper = compat.build_eviction_helper
    compat.Scheduler.schedule_running = compat.stock_schedule_running
    compat.prefill_scheduler_module._PrefillReorderer = compat._PrefillReorderer
    for module in compat.connector_factory_users():
        module.build_kv_connector = compat.build_kv_connector


@contextmanager
def installed(runtime: Runtime | None = None, *, observe_requests: bool = True):
    """:func:`install` for the ``with`` block; LMDeploy's own classes after."""
    install(runtime, observe_requests=observe_requests)
    try:
        yield
    finally:
        uninstall()
