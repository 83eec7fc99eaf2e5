"""pytest plugin: vLLM's own tests, with sagellm's classes in vLLM's place.

    pytest -p sagellm_substitute --noconftest tests/v1/core/...

Loaded before the test modules import vLLM's names, it rebinds them:
``Scheduler`` and ``AsyncScheduler`` become sagellm's subclasses, and
``BlockPool`` (where tests build it and where vLLM's coordinator does)
becomes ``SagellmBlockPool`` with sagellm's free-block queue. The sagellm
config reproduces vLLM's defaults (``vllm-defaults.toml``), or its priority
policy (``vllm-priority.toml``) where a test configures that.
"""

import os
from pathlib import Path

os.environ.setdefault("SAGELLM_CONFIG", str(Path(__file__).with_name("vllm-defaults.toml")))

import vllm.v1.core.block_pool as block_pool_module  # noqa: E402
import vllm.v1.core.kv_cache_coordinator as coordinator_module  # noqa: E402
import vllm.v1.core.sched.async_scheduler as async_scheduler_module  # noqa: E402
import vllm.v1.core.sched.scheduler as scheduler_module  # noqa: E402
from sagellm_plugin_vllm.block_pool import SagellmBlockPool  # noqa: E402
from sagellm_plugin_vllm.scheduler import SagellmAsyncScheduler, SagellmScheduler  # noqa: E402

HERE = Path(__file__).resolve().parent


class MatchVllmPolicy:
    """Pick the sagellm config that reproduces the scheduling policy the
    test configured vLLM with (FCFS, vLLM's default, or priority)."""

    def __init__(self, vllm_config, *args, **kwargs):
        name = "vllm-priority.toml" if vllm_config.scheduler_config.policy == "priority" else "vllm-defaults.toml"
        vllm_config.additional_config = {**(vllm_config.additional_config or {}), "sagellm_config": str(HERE / name)}
        super().__init__(vllm_config, *args, **kwargs)


class SuiteScheduler(MatchVllmPolicy, SagellmScheduler):
    pass


class SuiteAsyncScheduler(MatchVllmPolicy, SagellmAsyncScheduler):
    pass


scheduler_module.Scheduler = SuiteScheduler
async_scheduler_module.AsyncScheduler = SuiteAsyncScheduler
block_pool_module.BlockPool = SagellmBlockPool
coordinator_module.BlockPool = SagellmBlockPool


def pytest_report_header(config):
    return "sagellm: Scheduler, AsyncScheduler and BlockPool substituted by sagellm-plugin-vllm"
