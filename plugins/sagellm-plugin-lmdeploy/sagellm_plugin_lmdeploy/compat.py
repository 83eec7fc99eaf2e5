"""Every LMDeploy name the adapter touches, in one place, behind a version
check.

LMDeploy declares no plugin entry points; its PyTorch engine's paging layer
looks its builders up as module attributes when a ``Scheduler`` is built.
The adapter's patch points (``sagellm_plugin_lmdeploy.install``):

* ``lmdeploy.pytorch.paging.scheduler.BlockTrie``: the prefix-cache trie,
  replaced by ``SagellmBlockTrie`` (a subclass: LMDeploy's matching and
  block identity stay; sagellm observes caching, hits and frees, and its
  eviction policy chooses the blocks ``evict`` frees).
* ``lmdeploy.pytorch.paging.prefill_scheduler._PrefillReorderer``: the
  waiting-prefill order, replaced by ``SagellmPrefillReorderer`` (sagellm's
  scheduling passes). A new one is built every prefill turn, so the module
  attribute is what must change.

``SUPPORTED`` is the range this module was tested against; outside it the
adapter refuses to start.
"""

from __future__ import annotations

from sagellm_core.adapters import check_engine_version

SUPPORTED = ((0, 18, 0), (0, 19, 0))  # [low, high)
INSTALL_HINT = "see plugins/sagellm-plugin-lmdeploy/README.md, 'Installing LMDeploy'"

LMDEPLOY_VERSION = check_engine_version("lmdeploy", "lmdeploy", SUPPORTED, INSTALL_HINT)

import numpy  # noqa: E402
from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig  # noqa: E402
from lmdeploy.pytorch.messages import SamplingParam, SequenceMeta, UpdateTokenMode  # noqa: E402
from lmdeploy.pytorch.paging import prefill_scheduler as prefill_scheduler_module  # noqa: E402
from lmdeploy.pytorch.paging import scheduler as scheduler_module  # noqa: E402
from lmdeploy.pytorch.paging.block_trie import BlockTrie  # noqa: E402
from lmdeploy.pytorch.paging.prefill_scheduler import _PrefillReorderer  # noqa: E402
from lmdeploy.pytorch.paging.scheduler import Scheduler  # noqa: E402
from lmdeploy.pytorch.strategies.ar.sequence import ARSequenceStrategy  # noqa: E402

__all__ = [
    "LMDEPLOY_VERSION",
    "ARSequenceStrategy",
    "BlockTrie",
    "CacheConfig",
    "SamplingParam",
    "Scheduler",
    "SchedulerConfig",
    "SequenceMeta",
    "UpdateTokenMode",
    "_PrefillReorderer",
    "numpy",
    "prefill_scheduler_module",
    "scheduler_module",
]
