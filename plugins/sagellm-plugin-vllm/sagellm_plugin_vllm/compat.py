"""Every vLLM name the adapter touches, in one place, behind a version check.

The adapter plugs into vLLM through these points only:

* ``Scheduler`` / ``AsyncScheduler`` (``vllm.v1.core.sched``): subclassed;
  selected with ``--scheduler-cls``. The subclass reorders ``waiting`` (an
  ``FCFSRequestQueue``) once per step, and chooses the preemption victim
  through vLLM's general preemption branch (``SchedulingPolicy.PRIORITY``,
  which takes ``max(running, key=(priority, arrival_time))`` and restores the
  budget of a victim already scheduled this step).
* ``Request``: each request carries its sagellm ``SequenceState`` as the
  attribute ``sagellm_state`` while the scheduler holds it.
* ``KVCacheManager.allocate_slots``: a failed allocation for a running request
  is the moment vLLM preempts; the adapter asks the victim-selection hook
  there.
* ``KVConnectorBase_V1``: ``SagellmConnector``, a host tier placed by the
  transport hook, registered with ``KVConnectorFactory``.
* ``BlockPool`` (``vllm.v1.core.block_pool``): the scheduler's pool becomes a
  subclass that reports caching, hits, frees and evictions to sagellm, and
  its ``free_block_queue`` a ``FreeKVCacheBlockQueue`` subclass whose victims
  sagellm chooses.

``SUPPORTED`` is the range this module was tested against; outside it the
adapter refuses to start rather than misbehave.
"""

from __future__ import annotations

from sagellm_core.drivers.engines import check_engine_version

SUPPORTED = ((0, 33, 0), (0, 34, 0))  # [low, high)
INSTALL_HINT = "see plugins/sagellm-plugin-vllm/README.md, 'Installing vLLM'"

VLLM_VERSION = check_engine_version("vllm", "vllm", SUPPORTED, INSTALL_HINT)

import torch  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock, get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.request_queue import FCFSRequestQueue, SchedulingPolicy  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request as VllmRequest  # noqa: E402
from vllm.v1.request import RequestStatus as VllmRequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

__all__ = [
    "VLLM_VERSION",
    "AsyncScheduler",
    "BlockPool",
    "CacheConfig",
    "CacheHitSource",
    "KVConnectorBase_V1",
    "KVConnectorFactory",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVTransferConfig",
    "FCFSRequestQueue",
    "FreeKVCacheBlockQueue",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "ModelConfig",
    "ModelRunnerOutput",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulingPolicy",
    "StructuredOutputManager",
    "VllmConfig",
    "VllmRequest",
    "VllmRequestStatus",
    "get_request_block_hasher",
    "init_none_hash",
    "register_all_kvcache_specs",
    "sha256",
    "torch",
]
