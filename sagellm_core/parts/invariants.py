"""The runtime's block accounting, checked whole: O(blocks), for tests and
for the end of a run (a plugin that corrupted state it does not own is
caught there at the latest), never for the hot path."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sagellm_core.runtime import Runtime


def check(rt: Runtime) -> None:
    """Raise AssertionError if block accounting is inconsistent."""
    usage = rt.pool_usage()
    assert usage.num_free_blocks + len(rt._in_use) == rt.num_blocks, (
        f"pool reports {usage.num_free_blocks} free, runtime holds {len(rt._in_use)} of {rt.num_blocks}"
    )
    private: set[int] = set()
    holders: Counter[int] = Counter()
    for state in rt._active.values():
        assert not (private & state.private_block_ids), "a private block is owned twice"
        private |= state.private_block_ids
        holders.update(b for b in state.block_ids if b not in state.private_block_ids)
        assert set(state.block_ids) <= rt._in_use, "a request holds a free block"
    referenced = set(holders)
    assert not (private & rt._cached), "a block is both private and cached"
    assert private | rt._cached == rt._in_use, "a block is leaked (in use, owned by nobody)"
    if "kv_pool" not in rt.engine_owns:
        held = {b: n for b in rt._taken if (n := rt.holders(b))}
        assert dict(holders) == held, "the requests holding cached blocks are miscounted"
    evictable = set(rt.evictable())
    pinned = set(rt.pinned_blocks())
    assert evictable <= rt._cached, "an evictable block is not cached"
    assert not (evictable & referenced), "a block held by a request is evictable"
    assert not (evictable & pinned), "a pinned block is evictable"
    assert evictable | referenced | pinned == rt._cached, "a cached block is neither held, pinned nor evictable"
