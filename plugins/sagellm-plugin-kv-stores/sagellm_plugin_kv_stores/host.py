"""``[kv_stores] tiers = ["host"]``: KV blocks in host memory.

``capacity_blocks`` rows shaped like the device's blocks (pinned on a CUDA
device): blocks the device evicts are copied in, found again by content
key, and read back instead of recomputed. A full store reuses the row
written longest ago (:class:`~sagellm_core.kit.slots.SlotIndex`), or those
of the blocks a ``sagellm.eviction`` policy picks (``eviction``:
:class:`~sagellm_core.kit.store_eviction.StoreEviction`).

Admission: a copy pays for itself only if the block comes back. Once the
store's whole content has turned over with none read back (twice the blocks
it holds written since the last read), the store declines what it is
offered: one eviction round in ``PROBE_EVERY`` is still written, and as the
store is then written more slowly those blocks stay longer to be found; any
read opens it to every round again. On a trace without reuse this saves
every copy but the probes' (and their content keys: the keys of a declined
round are never read). A block can only come back within one turnover (then
it is overwritten), so the store declines only where returns are rarer than
one in two turnovers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.kit.slots import SlotIndex
from sagellm_core.kit.store_eviction import StoreEviction
from sagellm_core.types import CachedBlock, KVCaches, StoredBlocks, block_checksum, completed
from sagellm_plugin_kv_stores.rows import HostRows

#: While the store declines, one eviction round in this many is still
#: written: the probe that notices when blocks start to come back.
PROBE_EVERY = 64
#: The answer to a round not written (a done future is read, never changed).
NOTHING = completed(0)


@frozen
class HostSettings:
    #: Blocks the store holds (each the device's KV bytes of one block).
    capacity_blocks: int = field(default=4096, validator=[validators.instance_of(int), validators.ge(0)])
    #: The ``sagellm.eviction`` policy that picks the rows reused once the
    #: store is full; empty: the row written longest ago.
    eviction: str = field(default="", validator=validators.instance_of(str))


class HostStore:
    """Host memory as a KV store (:class:`sagellm_core.types.KVStore`)."""

    Settings = HostSettings

    def __init__(self, settings: HostSettings, context: PluginContext):
        where = f"[kv_stores.{context.name}] eviction"
        self.policy = StoreEviction(settings.eviction, settings.capacity_blocks, where) if settings.eviction else None
        self.index = SlotIndex(settings.capacity_blocks, self.policy.make_room if self.policy is not None else None)
        self.rows: HostRows | None = None
        #: The checksum of each row's content, recorded when it was written.
        self.checksums = [0] * settings.capacity_blocks
        #: Blocks written since a read; eviction rounds offered while declining.
        self.written_since_read = 0
        self._declined_rounds = 0

    @hookimpl
    def sagellm_kv_caches_allocated(self, kv_caches: KVCaches) -> None:
        self.rows = HostRows(kv_caches, self.index.capacity)

    @property
    def declining(self) -> bool:
        return bool(self.index) and self.written_since_read >= 2 * len(self.index)

    def contains(self, keys: Sequence[int]) -> int:
        return self.index.leading(keys)

    def put(self, blocks: Sequence[CachedBlock]) -> Future[int]:
        if self.declining:
            self._declined_rounds += 1
            if self._declined_rounds % PROBE_EVERY:
                return NOTHING
        assert self.rows is not None, "the runtime announces the device KV before the first put"
        # Rows in device-block order: blocks adjacent on the device land in
        # adjacent rows, so the device copies them as runs (an eviction round
        # comes in its policy's order, LRU's from a prefix's tail).
        blocks = sorted(blocks, key=lambda b: b.block_id)
        slots = self.index.place([b.key for b in blocks])
        if slots is None:  # more blocks than the store holds
            return NOTHING
        rows = self.rows
        rows.copy_in([b.block_id for b in blocks], slots)
        if self.policy is not None:
            self.policy.written([b.key for b in blocks])
        for slot in slots:
            self.checksums[slot] = block_checksum(rows.view(slot))
        self.written_since_read += len(slots)
        return completed(len(slots))

    def get(self, keys: Sequence[int]) -> Future[StoredBlocks]:
        rows = self.rows
        assert rows is not None
        slots = tuple(self.index.slots(keys))
        self.written_since_read = 0
        if self.policy is not None:
            self.policy.read(keys)
        views = tuple(rows.view(slot) for slot in slots)
        return completed(StoredBlocks(rows.source, slots, views, tuple(self.checksums[s] for s in slots)))

    def prefetch(self, keys: Sequence[int]) -> Future[int]:
        return completed(self.index.leading(keys))  # host memory is where get reads from

    def pin(self, keys: Sequence[int]) -> None:
        self.index.pin(keys)

    def unpin(self, keys: Sequence[int]) -> None:
        self.index.unpin(keys)

    def remove(self, keys: Sequence[int]) -> None:
        self.index.forget(keys)
        if self.policy is not None:
            self.policy.dropped(keys)

    def stats(self) -> Mapping[str, int]:
        return {"held": len(self.index), "declining": int(self.declining)}
