"""Every LMDeploy name the adapter touches, in one place, behind a version
check.

LMDeploy declares no plugin entry points; its PyTorch engine's paging layer
looks its builders up as module attributes when a ``Scheduler`` is built.
The adapter's patch points (``sagellm_plugin_lmdeploy.install``):

* ``lmdeploy.pytorch.paging.scheduler.BlockTrie``: the prefix-cache trie,
  replaced by ``SagellmBlockTrie`` (a subclass overriding
  ``_match_block_prefix``, ``allocate`` and ``evict``: sagellm observes
  caching, hits and frees, and its eviction policy chooses the blocks
  ``evict`` frees). Without a ``[prefix_cache] plugin`` LMDeploy's matching
  and block identity stay (the subclass reads ``Node`` paths from
  ``seq.prefix_cache.trie_cursor``). With one, the plugin matches
  (``matching.PluginMatcher``), reading ``seq.history_cache``,
  ``get_prefix_cache_max_match_step``, ``num_history_ids``,
  ``num_valid_ids``, ``kv_token_limit`` and the multimodal / routed-expert /
  recompute-overlap fields that rule a sequence out; the trie then does
  what LMDeploy's walk does with a match: ``logical_blocks.append`` (and
  ``[i] =`` for a folded duplicate), ``set_step``, the allocator's
  ``update_access_time`` / ``add_ref_count`` / ``free`` and
  ``BlockTrie._record_match_stats``.
* ``lmdeploy.pytorch.paging.prefill_scheduler._PrefillReorderer``: the
  waiting-prefill order, replaced by ``SagellmPrefillReorderer`` (sagellm's
  scheduling passes). A new one is built every prefill turn, so the module
  attribute is what must change. For each waiting sequence's cached-token
  hint it calls ``BlockTrie._find_deepest_block_match_step`` (a lookup that
  changes nothing) from ``BlockTrie._get_or_create_root``.

* ``lmdeploy.pytorch.paging.scheduler.build_eviction_helper``: builds
  ``SagellmEvictionHelper``, a ``RecomputeEvictionHelper`` subclass
  (``try_make_capacity_for``), in place of LMDeploy's; and
  ``Scheduler.schedule_running``, wrapped to tell it the decode batch, so
  sagellm chooses which running sequence is preempted
  (``Scheduler.preempt_seqs``, ``MessageStatus.RUNNING``).
* ``SequenceLifecycle.add_sequence`` / ``transition`` / ``remove_sequence``
  (``paging.seq_states``), wrapped to observe a live engine's arrivals and
  finishes (``MessageStatus.STOPPED`` / ``WAITING``) (``lifecycle``; the trie is found through
  ``SequenceLifecycle._block_manager.allocator``), reading a sequence's
  ``arrive_time``, ``all_ids``, ``num_new_tokens``, ``session_id``,
  ``seq_id`` and ``sampling_param.max_new_tokens``.
* ``LogicalAllocator`` (``paging.block_manager``): when the config names a
  kv-pool plugin, its ``_gpu_allocator`` (LMDeploy's physical GPU-block
  allocator: ``allocate``/``free``/``get_num_free_blocks``, ``_offset``) is
  replaced by ``SagellmPhysicalAllocator``, and the allocator itself becomes
  a ``SagellmLogicalAllocator`` (its ``allocate``/``free`` over
  ``_log_mem.phy_map``/``ref_count``, ``_free_count``,
  ``update_access_time``); ``LogicalAllocator.free`` is watched for blocks
  left to the trie.
* ``lmdeploy.pytorch.kv_connector.base.KVConnectorBase``: ``SagellmConnector``,
  sagellm's transport hook as a host tier. LMDeploy's ``build_kv_connector``
  knows only Mooncake; ``lmdeploy.pytorch.engine.engine`` and
  ``...engine.model_agent.agent`` each bound it at import, and both get a
  factory that also knows ``SagellmConnector``.

``SUPPORTED`` is the range this module was tested against; outside it the
adapter refuses to start.
"""

from __future__ import annotations

from sagellm_core.drivers.engines import check_engine_version

SUPPORTED = ((0, 18, 0), (0, 19, 0))  # [low, high)
INSTALL_HINT = "see plugins/sagellm-plugin-lmdeploy/README.md, 'Installing LMDeploy'"

LMDEPLOY_VERSION = check_engine_version("lmdeploy", "lmdeploy", SUPPORTED, INSTALL_HINT)

import numpy  # noqa: E402
import torch  # noqa: E402
from lmdeploy.messages import KVTransferConfig  # noqa: E402
from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig  # noqa: E402
from lmdeploy.pytorch.kv_connector import build_kv_connector  # noqa: E402
from lmdeploy.pytorch.kv_connector.base import (  # noqa: E402
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorResult,
    KVConnectorRole,
    KVLoadResult,
    KVSaveBlockLease,
)
from lmdeploy.pytorch.messages import MessageStatus, SamplingParam, SequenceMeta, UpdateTokenMode  # noqa: E402
from lmdeploy.pytorch.paging import prefill_scheduler as prefill_scheduler_module  # noqa: E402
from lmdeploy.pytorch.paging import scheduler as scheduler_module  # noqa: E402
from lmdeploy.pytorch.paging.block_manager.base_block_manager import LogicalAllocator  # noqa: E402
from lmdeploy.pytorch.paging.block_trie import BlockTrie  # noqa: E402
from lmdeploy.pytorch.paging.eviction_helper import build_eviction_helper  # noqa: E402
from lmdeploy.pytorch.paging.eviction_helper.recompute_eviction_helper import RecomputeEvictionHelper  # noqa: E402
from lmdeploy.pytorch.paging.prefill_scheduler import _PrefillReorderer  # noqa: E402
from lmdeploy.pytorch.paging.scheduler import Scheduler  # noqa: E402
from lmdeploy.pytorch.paging.seq_states import SequenceLifecycle  # noqa: E402

# LMDeploy's own methods, kept before ``install`` wraps them.
stock_schedule_running = Scheduler.schedule_running
stock_add_sequence = SequenceLifecycle.add_sequence
stock_transition = SequenceLifecycle.transition
stock_remove_sequence = SequenceLifecycle.remove_sequence
from lmdeploy.pytorch.strategies.ar.sequence import ARSequenceStrategy  # noqa: E402


def connector_factory_users() -> list:
    """The modules that bound LMDeploy's ``build_kv_connector`` at import:
    the engine (scheduler side) and the model agent (workers). Imported on
    demand: they pull in LMDeploy's engine."""
    from lmdeploy.pytorch.engine import engine
    from lmdeploy.pytorch.engine.model_agent import agent

    return [engine, agent]


__all__ = [
    "LMDEPLOY_VERSION",
    "ARSequenceStrategy",
    "BlockTrie",
    "CacheConfig",
    "KVConnectorBase",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorResult",
    "KVConnectorRole",
    "KVLoadResult",
    "KVSaveBlockLease",
    "KVTransferConfig",
    "LogicalAllocator",
    "MessageStatus",
    "RecomputeEvictionHelper",
    "SamplingParam",
    "Scheduler",
    "SchedulerConfig",
    "SequenceLifecycle",
    "SequenceMeta",
    "UpdateTokenMode",
    "_PrefillReorderer",
    "build_eviction_helper",
    "build_kv_connector",
    "connector_factory_users",
    "numpy",
    "prefill_scheduler_module",
    "scheduler_module",
    "stock_add_sequence",
    "stock_remove_sequence",
    "stock_transition",
    "stock_schedule_running",
    "torch",
]
