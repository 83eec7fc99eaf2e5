"""What is wrong with a plugin's answer, checked against the ground truth
the runtime keeps (issue 16, class 3): each function returns a one-line
problem, or ``None`` for a sound answer, and costs O(answer), so the hot
decisions (victims, allocations) pay for what they return, never for the
size of the cache. An answer of the right type with bad contents (``None``
inside, a generator, a string budget) is a problem here, not a traceback
from inside the runtime; :mod:`sagellm_core.plugin_host` names the plugin."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import repeat
from operator import attrgetter
from typing import Any

from sagellm_core.types import (
    Admission,
    AdmissionDecision,
    BlockAllocation,
    CachedBlock,
    EvictionDecision,
    PoolUsage,
    PrefixInsert,
    PrefixMatch,
    ScheduleIR,
    SequenceState,
    TransferPlan,
    TransferResult,
)

_INT, _BLOCK = {int}, {CachedBlock}


def _ints(values: Any) -> bool:
    # The set of the elements' types, built at C speed: the hot answers pay
    # no Python-level loop here.
    return isinstance(values, (tuple, list)) and {*map(type, values)} <= _INT


def _blocks(values: Any) -> bool:
    return isinstance(values, tuple) and (
        {*map(type, values)} <= _BLOCK or all(isinstance(b, CachedBlock) for b in values)
    )


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def match(answer: Any, num_prompt_tokens: int, block_size: int, cached: set[int]) -> str | None:
    if not isinstance(answer, PrefixMatch) or not _blocks(answer.blocks):
        return f"returned {answer!r}, not a PrefixMatch of CachedBlocks"
    limit = (num_prompt_tokens - 1) // block_size
    if answer.num_blocks > limit:
        return (
            f"matched {answer.num_blocks} blocks of a {num_prompt_tokens}-token prompt"
            f" (at most {limit}: one token is always computed)"
        )
    ids = answer.block_ids
    if len(set(ids)) != len(ids) or not cached.issuperset(ids):
        return f"matched blocks that are not cached: {ids}"
    return None


def insert(answer: PrefixInsert, given: Sequence[int], cached: set[int]) -> str | None:
    replaced = answer.replaced
    if not (
        _blocks(answer.adopted)
        and _blocks(answer.locked)
        and isinstance(replaced, tuple)
        and all(isinstance(r, tuple) and len(r) == 2 and isinstance(r[1], CachedBlock) for r in replaced)
    ):
        return f"returned {answer!r}: adopted, locked and replaced must be tuples of CachedBlocks (and block ids)"
    ids = set(given)
    adopted = [b.block_id for b in answer.adopted]
    if any(b not in ids or b in cached for b in adopted) or any(
        g not in ids or g in cached or b.block_id not in cached for g, b in replaced
    ):
        return (
            f"adopted {adopted} / replaced {[g for g, _ in replaced]} of blocks {list(given)}"
            " it was not given or that were cached"
        )
    stray = [b.block_id for b in answer.locked if b.block_id not in cached]
    return f"locked blocks that are not cached: {stray[:8]}" if stray else None


def released(answer: Any, cached: set[int]) -> str | None:
    if not _blocks(answer) or not cached.issuperset(b.block_id for b in answer):
        return f"returned {answer!r}, not a tuple of cached blocks"
    return None


def removal(
    answer: Any, victims: Sequence[int], cached: set[int], taken: Mapping[int, int], returned: Mapping[int, int]
) -> str | None:
    """``taken`` and ``returned`` count the times requests took and gave
    back each cached block: a block taken more often than returned is held."""
    if not _blocks(answer):
        return f"returned {answer!r}, not CachedBlocks"
    ids = [b.block_id for b in answer]
    if len(set(ids)) != len(ids) or not set(victims) <= set(ids) or not cached.issuperset(ids):
        return f"removed {ids} for victims {list(victims)}"
    if list(map(taken.get, ids, repeat(0))) == list(map(returned.get, ids, repeat(0))):
        return None  # nothing held: the common case, at C speed
    locked = [b for b in ids if taken.get(b, 0) != returned.get(b, 0)]
    if locked:
        return f"removed blocks that requests hold (locked, not evictable): {locked[:8]}"
    return None


def allocation(answer: Any, num_blocks: int, pool_size: int, in_use: set[int]) -> str | None:
    if not isinstance(answer, BlockAllocation):
        return f"returned {answer!r}, not a BlockAllocation"
    ids = answer.block_ids
    if not isinstance(ids, (tuple, list)):
        return f"returned block_ids {ids!r}, not a tuple of block ids"
    if len(ids) != num_blocks:
        return f"returned {len(ids)} blocks, asked for {num_blocks} with enough free"
    if not (_ints(ids) and (not ids or (min(ids) >= 0 and max(ids) < pool_size))):
        bad = [b for b in ids if not (type(b) is int and 0 <= b < pool_size)]
        return f"returned block ids out of range: {bad[:8]}"
    if len(set(ids)) != len(ids):
        return f"returned duplicate blocks {ids}"
    if in_use.isdisjoint(ids):
        return None
    return f"returned blocks already in use: {sorted(in_use.intersection(ids))[:8]}"


def victims(answer: Any, num_blocks: int, candidates: Any) -> str | None:
    if not isinstance(answer, EvictionDecision):
        return f"returned {answer!r}, not an EvictionDecision"
    chosen = answer.victim_ids
    if not isinstance(chosen, (tuple, list)):
        return f"returned victim_ids {chosen!r}, not a tuple of block ids"
    if len(chosen) > num_blocks:
        return f"returned {len(chosen)} victims, asked for at most {num_blocks}"
    try:  # None or an unhashable thing inside is no candidate
        distinct = set(chosen)
        if len(distinct) != len(chosen):
            return f"returned duplicate victims {chosen}"
        if isinstance(candidates, (set, frozenset)) and distinct <= candidates:
            return None  # the common case, at C speed
        stray = [v for v in chosen if v not in candidates]
    except TypeError:
        stray = [v for v in chosen if not isinstance(v, int)]
    return f"returned victims that are not evictable candidates: {stray[:8]}" if stray else None


def admission(answer: Any) -> str | None:
    if not isinstance(answer, AdmissionDecision) or not isinstance(answer.verdict, Admission):
        return f"returned {answer!r}, not an AdmissionDecision with an Admission verdict"
    reason = answer.reason
    if not isinstance(reason, str) or not reason or "\n" in reason or len(reason) > 200:
        return f"returned the reason {reason!r}: a few words on one line"
    return None


def usage(answer: Any, pool_size: int) -> str | None:
    if not isinstance(answer, PoolUsage):
        return f"returned {answer!r}, not a PoolUsage"
    if not (_count(answer.num_blocks) and _count(answer.num_free_blocks) and _count(answer.num_free_runs)):
        return f"returned {answer!r}: counts must be non-negative integers"
    if answer.num_free_blocks > answer.num_blocks:
        return f"returned {answer!r}: more free blocks than blocks"
    return None


def collection(answer: Any) -> str | None:
    """An evictable-blocks or pinned-blocks answer: sized, with membership."""
    kind = type(answer)
    if hasattr(kind, "__contains__") and hasattr(kind, "__len__") and hasattr(kind, "__iter__"):
        return None
    return f"returned {answer!r}, not a collection of block ids (len, in, iteration)"


def keys(answer: Any, num_blocks: int) -> str | None:
    if not isinstance(answer, tuple) or len(answer) > num_blocks:
        return f"returned {answer!r}, not a tuple of at most {num_blocks} keys"
    try:
        hash(answer)  # every key is hashed, nothing built (a tier lookup asks a whole prompt's keys)
    except TypeError:
        return f"returned keys that cannot be hashed: {answer[:4]!r}"
    return None


def transfer(answer: Any, plan: TransferPlan) -> str | None:
    if not isinstance(answer, TransferResult):
        return f"returned {answer!r}, not a TransferResult"
    n = len(plan.src_block_ids)
    seconds = answer.seconds
    if not (
        type(answer.ok) is bool
        and _count(answer.num_blocks)
        and answer.num_blocks <= n
        and _count(answer.num_bytes)
        and isinstance(seconds, (int, float))
        and math.isfinite(seconds)
        and seconds >= 0
        and _ints(answer.dst_block_ids)
        and len(answer.dst_block_ids) <= n
    ):
        return (
            f"returned {answer!r}: ok a bool; num_blocks (at most {n}), num_bytes and"
            " seconds finite and non-negative; dst_block_ids block ids"
        )
    return None


#: The fields of a running request's state that the block accounting rests
#: on (the lists by identity; their lengths are summed apart).
_STATE_FIELDS = attrgetter(
    "block_ids", "private_block_ids", "status", "num_computed_tokens", "num_output_tokens", "num_preemptions"
)
_BLOCK_LISTS = attrgetter("block_ids")
_PRIVATE_SETS = attrgetter("private_block_ids")


def fingerprint(states: Sequence[SequenceState]) -> tuple[Any, ...]:
    """What a pass may not change of the running requests' states (passes
    only read them): taken before the pass, compared after it. The fields
    the accounting rests on, the block lists by identity and their total
    lengths, all at C speed: O(states), with no Python-level loop."""
    return (
        list(map(_STATE_FIELDS, states)),
        sum(map(len, map(_BLOCK_LISTS, states))),
        sum(map(len, map(_PRIVATE_SETS, states))),
    )


def schedule(ir: ScheduleIR, before: dict[str, list[SequenceState]], budget: int, seqs: int) -> str | None:
    """After the passes: the lists reordered at most, the budgets lowered
    at most and still positive."""
    for name, was in before.items():
        now = getattr(ir, name)
        if type(now) is not list:
            return f"replaced the {name} list with {type(now).__name__}; passes reorder it in place"
        # SequenceState compares by identity, so == is a C-speed check
        # that nothing moved; only a reordered list needs the set check.
        if now != was and (len(now) != len(was) or {id(s) for s in now} != {id(s) for s in was}):
            return f"changed the set of {name} requests ({len(was)} -> {len(now)}); passes may only reorder"
    for name, limit in (("token_budget", budget), ("max_num_seqs", seqs)):
        value = getattr(ir, name)
        if type(value) is not int or not 0 < value <= limit:
            return f"set {name} = {value!r}; passes may lower it, to a positive integer (it was {limit})"
    return chunk_limits(ir) if ir.chunk_limits else None


def chunk_limits(ir: ScheduleIR) -> str | None:
    """Each cap names a request of the step, as a non-negative integer, one
    that runs at least 1 (a running request held at 0 could hold its
    blocks forever), and they do not hold back every request."""
    limits = ir.chunk_limits
    if type(limits) is not dict:
        return f"set chunk_limits to {type(limits).__name__}; it is a dict of request id -> tokens"
    floors = {s.request_id: 1 for s in ir.running} | {s.request_id: 0 for s in ir.waiting}
    for request_id, tokens in limits.items():
        if request_id not in floors:
            return f"capped the chunk of {request_id!r}, which is not a request of the step"
        if type(tokens) is not int or tokens < floors[request_id]:
            least = "1 (it runs)" if floors[request_id] else "0"
            return f"set the chunk limit of {request_id!r} to {tokens!r}; it is an integer of at least {least}"
    if not ir.running and all(limits.get(s.request_id) == 0 for s in ir.waiting):
        return "held every waiting request back with nothing running: the step would do nothing"
    return None


def culprit(exc: BaseException, plugins: Mapping[str, Sequence[Any]], hook_name: str) -> str:
    """The plugin whose code raised ``exc`` (a method of it, or a function of
    its module), found in its traceback; else those implementing the hook."""
    loaded = [p for ps in plugins.values() for p in ps]
    by_instance = {id(p.instance): p for p in loaded}
    by_module = {type(p.instance).__module__: p for p in loaded}
    tb, found = exc.__traceback__, None
    while tb is not None:
        frame = tb.tb_frame
        owner = by_instance.get(id(frame.f_locals.get("self")))
        found = owner or by_module.get(frame.f_globals.get("__name__", "")) or found
        tb = tb.tb_next
    return str(found) if found else " / ".join(str(p) for p in loaded if hasattr(p.instance, hook_name))
