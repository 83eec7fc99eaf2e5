"""Replay runtimes for the transfer contract's tests: a block of four
tokens, a radix cache, no model."""

from __future__ import annotations

from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.runtime import Runtime
from sagellm_core.types import Request

CONFIG = """
[engine]
name = "replay"
[prefix_cache]
plugin = "radix"
block_size = 4
[kv_pool]
plugin = "paged"
num_blocks = {blocks}
[eviction]
plugin = "lru"
[scheduler]
passes = ["fcfs"]
"""


def runtime(blocks: int = 64) -> Runtime:
    return Runtime(settings_from_toml(CONFIG.format(blocks=blocks)))


def compute(rt: Runtime, request: Request) -> None:
    """Prefill ``request`` as an engine does and finish it: its full blocks cached."""
    state = rt.arrive(request)
    state.num_computed_tokens += rt.admit(state, 1 << 20)
    rt.finish(state)


def prompt(i: int, shared: int = 8, own: int = 9) -> Request:
    return Request(f"r{i}", [1] * shared + [100 + i] * own, 4)
