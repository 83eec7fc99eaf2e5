"""The runtime's block accounting, checked whole: O(blocks), for tests and
for the end of a run (a plugin that corrupted state it does not own is
caught there at the latest), never for the hot path."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import Protocol

from sagellm_core.types import EvictionCandidates, PoolUsage, SequenceState, TenantLedger


class Accounts(Protocol):
    """What the check reads of the runtime: its records (private ones
    included: checking them is the point) and the plugins' answers."""

    num_blocks: int
    engine_owns: frozenset[str]
    tenant_ledger: TenantLedger
    _in_use: set[int]
    _cached: set[int]
    _taken: Counter[int]
    _active: dict[str, SequenceState]

    def pool_usage(self) -> PoolUsage: ...

    def holders(self, block_id: int) -> int: ...

    def evictable(self) -> EvictionCandidates: ...

    def pinned_blocks(self) -> Collection[int]: ...


def check(rt: Accounts) -> None:
    """Raise AssertionError if block accounting is inconsistent."""
    usage = rt.pool_usage()
    assert usage.num_free_blocks + len(rt._in_use) == rt.num_blocks, (
        f"pool reports {usage.num_free_blocks} free, runtime holds {len(rt._in_use)} of {rt.num_blocks}"
    )
    private: set[int] = set()
    holders: Counter[int] = Counter()
    tenant_blocks: Counter[str] = Counter()
    tenant_requests: Counter[str] = Counter()
    for state in rt._active.values():
        tenant_blocks[state.request.tenant] += len(state.block_ids)
        tenant_requests[state.request.tenant] += 1
        assert not (private & state.private_block_ids), "a private block is owned twice"
        private |= state.private_block_ids
        holders.update(b for b in state.block_ids if b not in state.private_block_ids)
        assert set(state.block_ids) <= rt._in_use, "a request holds a free block"
    ledger = rt.tenant_ledger
    assert {t: n for t, n in ledger.blocks.items() if n} == +tenant_blocks, "the tenant ledger's blocks are off"
    assert {t: n for t, n in ledger.requests.items() if n} == dict(tenant_requests), (
        "the tenant ledger's requests are off"
    )
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
