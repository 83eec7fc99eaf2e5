"""Tenant-fair eviction: each tenant is entitled to an equal share of the
cache (weighted by ``weights``); a victim comes from the tenant furthest
over its share, least recently released first within it (LRU per tenant).
Without it, LRU lets the busiest tenants push everyone else's prefixes out.

A block's tenant is ``CachedBlock.tenant``, which the prefix cache sets
with ``isolate = "tenant"``; blocks that tenants share (``None``) are
shared out as one more tenant, named ``""``.
"""

from __future__ import annotations

from collections import OrderedDict

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import CachedBlock, EvictionCandidates, EvictionDecision


@frozen
class FairSettings:
    #: Share weights by tenant name; a tenant not named weighs 1.
    weights: dict = field(
        factory=dict,
        validator=validators.deep_mapping(
            key_validator=validators.instance_of(str),
            value_validator=[validators.instance_of((int, float)), validators.gt(0)],
        ),
    )


class FairEviction:
    """``[eviction] plugin = "fair"``"""

    Settings = FairSettings

    def __init__(self, settings: FairSettings, context: PluginContext):
        self.weights = settings.weights
        self._tenant: dict[int, str] = {}  # every cached block
        self._held: dict[str, int] = {}  # cached blocks per tenant
        self._queues: dict[str, OrderedDict[int, None]] = {}  # evictable, oldest release first

    def usage(self) -> dict[str, float]:
        """Cached blocks per tenant, divided by the tenant's weight."""
        return {t: n / self.weights.get(t, 1) for t, n in self._held.items()}

    @hookimpl
    def sagellm_blocks_cached(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            tenant = "" if block.tenant is None else block.tenant
            self._tenant[block.block_id] = tenant
            self._held[tenant] = self._held.get(tenant, 0) + 1

    @hookimpl
    def sagellm_blocks_released(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in reversed(blocks):  # deepest first: leaves go before parents
            tenant = self._tenant.get(block.block_id)
            if tenant is not None:
                self._queues.setdefault(tenant, OrderedDict())[block.block_id] = None

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            queue = self._queues.get(self._tenant.get(block.block_id))
            if queue is not None:
                queue.pop(block.block_id, None)

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...]) -> None:
        for block in blocks:
            tenant = self._tenant.pop(block.block_id, None)
            if tenant is None:
                continue
            self._held[tenant] -= 1
            self._queues[tenant].pop(block.block_id, None)

    @hookimpl
    def sagellm_blocks_moved(self, moves: tuple[tuple[int, int], ...]) -> None:
        moved = dict(moves)
        for src, dst in moves:
            tenant = self._tenant.pop(src, None)
            if tenant is not None:
                self._tenant[dst] = tenant
        for tenant, queue in self._queues.items():
            if not moved.keys().isdisjoint(queue):
                self._queues[tenant] = OrderedDict((moved.get(b, b), None) for b in queue)

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision:
        # Charge each pick to its tenant as if evicted, so k picks spread as
        # k evictions would (a victim's descendants may go too: a bound).
        usage = self.usage()
        cursors = {t: iter(q) for t, q in self._queues.items() if q}
        victims: list[int] = []
        while len(victims) < num_blocks and cursors:
            tenant = max(cursors, key=lambda t: (usage[t], t))
            block = next((b for b in cursors[tenant] if b in candidates), None)
            if block is None:
                del cursors[tenant]
                continue
            victims.append(block)
            usage[tenant] -= 1 / self.weights.get(tenant, 1)
        return EvictionDecision(tuple(victims))
