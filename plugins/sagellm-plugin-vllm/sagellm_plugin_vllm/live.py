"""The sagellm runtime of a live vLLM: the config a user names (vLLM's
``--additional-config '{"sagellm_config": FILE}'`` or ``$SAGELLM_CONFIG``),
sized to the pool vLLM actually allocated."""

from __future__ import annotations

from sagellm_core.drivers.engines import CONFIG_ENV, load_engine_runtime
from sagellm_core.runtime import Runtime

#: vLLM serves these sections with its own hash table and block pool.
ENGINE_OWNS = ("prefix_cache", "kv_pool")


def load_runtime(num_blocks: int, block_size: int, path: str | None = None) -> Runtime:
    return load_engine_runtime(
        num_blocks,
        block_size,
        engine_owns=ENGINE_OWNS,
        path=path,
        where="sagellm-plugin-vllm",
        how=f'pass --additional-config \'{{"sagellm_config": "FILE"}}\' or set {CONFIG_ENV}',
    )
