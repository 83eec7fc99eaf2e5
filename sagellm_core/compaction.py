"""Compaction: a pool that plans moves of cached blocks to rejoin runs of free
blocks (``sagellm_plan_compaction``), the prefix cache relabelling them
(``sagellm_move_blocks``) and every plugin told (``sagellm_blocks_moved``),
each answer checked before anything changes.

A move relabels a block in every plugin that keeps blocks by id, so a
compacting pool is refused at start unless the prefix cache relabels and
every plugin that observes blocks (or chooses victims) follows moves: a
policy left holding the old ids would name blocks that are gone.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from sagellm_core.counters import Counters
from sagellm_core.errors import ConfigError
from sagellm_core.ledger import BlockLedger
from sagellm_core.plugin_host import PluginHost
from sagellm_core.types import CachedBlock, EvictionCandidates

#: Hooks whose plugins keep blocks by id: they must follow moves.
BLOCK_KEEPERS = (
    "sagellm_blocks_cached",
    "sagellm_blocks_touched",
    "sagellm_blocks_released",
    "sagellm_blocks_evicted",
    "sagellm_select_victims",
)


def compacts(host: PluginHost) -> bool:
    """Whether the pool compacts; a ConfigError, naming the plugin, if a
    plugin that keeps blocks by id cannot follow its moves."""
    if "kv_pool" in host.engine_owns or not host.dispatch.implemented("sagellm_plan_compaction"):
        return False
    if "prefix_cache" not in host.plugins:
        return False  # nothing is cached: nothing to move
    where = f"{host.settings.path}: [kv_pool]: {host.who('kv_pool')} compacts (moves cached blocks), but"
    if not any(hasattr(p.instance, "sagellm_move_blocks") for p in host.plugins.get("prefix_cache", ())):
        raise ConfigError(f"{where} {host.who('prefix_cache')} does not relabel them (sagellm_move_blocks)")
    for loaded in host.plugins.values():
        for plugin in loaded:
            keeps = any(hasattr(plugin.instance, hook) for hook in BLOCK_KEEPERS)
            if keeps and not hasattr(plugin.instance, "sagellm_blocks_moved"):
                raise ConfigError(
                    f"{where} {plugin} keeps blocks by id and does not follow moves (sagellm_blocks_moved)"
                )
    return True


def moves_problem(answer: Any, movable: EvictionCandidates, in_use: Collection[int], pool_size: int) -> str | None:
    if not (isinstance(answer, tuple) and all(isinstance(m, tuple) and len(m) == 2 for m in answer)):
        return f"returned {answer!r}, not a tuple of (src, dst) block ids"
    src, dst = [m[0] for m in answer], [m[1] for m in answer]
    if not all(type(b) is int for b in src + dst) or len(set(src)) != len(src) or len(set(dst)) != len(dst):
        return f"returned moves {list(answer)[:8]}: distinct int ids each side"
    if not all(b in movable for b in src):
        return f"moves blocks that are not evictable cached blocks: {[b for b in src if b not in movable][:8]}"
    if not all(0 <= b < pool_size and b not in in_use for b in dst):
        return f"moves blocks onto blocks that are not free: {[b for b in dst if b in in_use or not 0 <= b][:8]}"
    return None


def relabel_problem(answer: Any, moves: Sequence[tuple[int, int]], cached: Collection[int]) -> str | None:
    if not (isinstance(answer, tuple) and all(isinstance(b, CachedBlock) for b in answer)):
        return f"returned {answer!r}, not a tuple of CachedBlocks"
    ids, src = {b.block_id for b in answer}, {s for s, _ in moves}
    missing = [d for _, d in moves if d not in ids]
    stray = [b for b in ids if b in src or (b not in cached and b not in {d for _, d in moves})]
    if missing or stray:
        return f"relabelled {sorted(ids)[:8]}: moved blocks missing {missing[:8]}, not cached or moved away {stray[:8]}"
    return None


def compact(host: PluginHost, ledger: BlockLedger, counters: Counters, now_s: float) -> int:
    """Ask the pool for moves and carry them out; return the blocks moved."""
    movable = host.evictable()
    hook = "sagellm_plan_compaction"
    moves = host._call("kv_pool", hook, movable=movable)
    if not moves:
        return 0
    host._checked("kv_pool", hook, moves, moves_problem(moves, movable, ledger.in_use, ledger.num_blocks))
    hook = "sagellm_move_blocks"
    blocks = host._call("prefix_cache", hook, moves=moves)
    host._checked("prefix_cache", hook, blocks, relabel_problem(blocks, moves, ledger.cached))
    src, dst = [m[0] for m in moves], [m[1] for m in moves]
    for records in (ledger.in_use, ledger.cached):
        records.difference_update(src)
        records.update(dst)
    counters.compactions += 1
    counters.moved_blocks += len(moves)
    host.observe("sagellm_blocks_moved", moves=moves, blocks=blocks, now_s=now_s)
    return len(moves)
