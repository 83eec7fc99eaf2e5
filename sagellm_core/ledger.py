"""The block ledger: the runtime's ground truth of blocks, which every
plugin's answer is checked against (:mod:`sagellm_core.plugin_host`) and
the lifecycle (:mod:`sagellm_core.runtime`) keeps up to date.

* ``in_use``: the blocks taken from the pool and not yet returned; of
  these, ``cached``: the ones the prefix cache holds;
* ``taken`` / ``returned``: how often running requests took and gave back
  each cached block (counted at C speed by ``Counter.update``), so the
  requests holding a block are ``taken - returned``;
* ``active``: the requests admitted and not finished or preempted, and per
  tenant the blocks in their block tables and how many they are (the
  :class:`~sagellm_core.types.TenantLedger` admission plugins read).

:meth:`BlockLedger.check` recomputes all of it from the requests and the
plugins' own reports: O(blocks), for tests and the end of a run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from types import MappingProxyType

from sagellm_core.types import EvictionCandidates, PoolUsage, SequenceState, TenantLedger


class BlockLedger:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.in_use: set[int] = set()
        self.cached: set[int] = set()
        self.taken: Counter[int] = Counter()
        self.returned: Counter[int] = Counter()
        self.active: dict[str, SequenceState] = {}
        self._tenant_blocks: dict[str, int] = {}
        self._tenant_requests: dict[str, int] = {}
        #: What each tenant's admitted requests hold, live and read-only.
        self.tenants = TenantLedger(MappingProxyType(self._tenant_blocks), MappingProxyType(self._tenant_requests))

    def holders(self, block_id: int) -> int:
        """How many running requests hold the cached ``block_id``."""
        return self.taken.get(block_id, 0) - self.returned.get(block_id, 0)

    def start(self, state: SequenceState, cached_ids: Collection[int]) -> None:
        """``state`` was admitted holding its block table, ``cached_ids``
        (the cached prefix it matched) first."""
        self.taken.update(cached_ids)
        self.active[state.request_id] = state
        tenant = state.request.tenant
        self._tenant_blocks[tenant] = self._tenant_blocks.get(tenant, 0) + len(state.block_ids)
        self._tenant_requests[tenant] = self._tenant_requests.get(tenant, 0) + 1

    def grew(self, state: SequenceState, num_blocks: int) -> None:
        self._tenant_blocks[state.request.tenant] += num_blocks

    def end(self, state: SequenceState) -> None:
        """``state`` gave its blocks back: its cached ones are returned."""
        held, private = state.block_ids, state.private_block_ids
        shared = held[: len(held) - len(private)]  # the cached blocks come first
        self.returned.update(shared if private.isdisjoint(shared) else [b for b in held if b not in private])
        if self.active.pop(state.request_id, None) is not None:
            tenant = state.request.tenant
            self._tenant_blocks[tenant] -= len(held)
            self._tenant_requests[tenant] -= 1

    def check(
        self, usage: PoolUsage, evictable: EvictionCandidates, pinned: Collection[int], *, pool_is_ours: bool = True
    ) -> None:
        """Raise AssertionError if the accounting is inconsistent, given the
        pool's and the prefix cache's own reports (``pool_is_ours``: the
        runtime takes the pool's blocks, so it knows their holders)."""
        assert usage.num_free_blocks + len(self.in_use) == self.num_blocks, (
            f"pool reports {usage.num_free_blocks} free, runtime holds {len(self.in_use)} of {self.num_blocks}"
        )
        private: set[int] = set()
        holders: Counter[int] = Counter()
        tenant_blocks: Counter[str] = Counter()
        tenant_requests: Counter[str] = Counter()
        for state in self.active.values():
            tenant_blocks[state.request.tenant] += len(state.block_ids)
            tenant_requests[state.request.tenant] += 1
            assert not (private & state.private_block_ids), "a private block is owned twice"
            private |= state.private_block_ids
            holders.update(b for b in state.block_ids if b not in state.private_block_ids)
            assert set(state.block_ids) <= self.in_use, "a request holds a free block"
        assert {t: n for t, n in self._tenant_blocks.items() if n} == +tenant_blocks, (
            "the tenant ledger's blocks are off"
        )
        assert {t: n for t, n in self._tenant_requests.items() if n} == dict(tenant_requests), (
            "the tenant ledger's requests are off"
        )
        referenced = set(holders)
        assert not (private & self.cached), "a block is both private and cached"
        assert private | self.cached == self.in_use, "a block is leaked (in use, owned by nobody)"
        if pool_is_ours:
            held = {b: n for b in self.taken if (n := self.holders(b))}
            assert dict(holders) == held, "the requests holding cached blocks are miscounted"
        evictable_set, pinned_set = set(evictable), set(pinned)
        assert evictable_set <= self.cached, "an evictable block is not cached"
        assert not (evictable_set & referenced), "a block held by a request is evictable"
        assert not (evictable_set & pinned_set), "a pinned block is evictable"
        assert evictable_set | referenced | pinned_set == self.cached, (
            "a cached block is neither held, pinned nor evictable"
        )
