"""The sagellm runtime of an LMDeploy scheduler: a harness's own, or a live
engine's from the config ``$SAGELLM_CONFIG`` names, sized to the pool
LMDeploy actually allocated. LMDeploy's trie and allocator serve the
prefix cache and the pool unless the config names a plugin for them."""

from __future__ import annotations

from sagellm_core.config import Settings
from sagellm_core.drivers.engines import engine_sections, load_engine_runtime
from sagellm_core.runtime import Runtime

#: LMDeploy's trie matches prefixes and its allocator picks physical blocks,
#: unless the config names a prefix-cache / kv-pool plugin to decide them.
OWNS_UNLESS_CONFIGURED = ("prefix_cache", "kv_pool")


def runtime_for(settings: Settings) -> Runtime:
    """The runtime of a harness's ``settings``, with the sections LMDeploy serves."""
    return Runtime(settings, engine_owns=engine_sections(settings, (), OWNS_UNLESS_CONFIGURED))


def load_runtime(num_blocks: int, block_size: int, path: str | None = None) -> Runtime:
    return load_engine_runtime(
        num_blocks,
        block_size,
        engine_owns=(),
        path=path,
        where="sagellm-plugin-lmdeploy",
        unless_configured=OWNS_UNLESS_CONFIGURED,
    )
