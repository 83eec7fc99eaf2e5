"""KV stores that misbehave, for tests/integration/test_kv_stores.py."""

from __future__ import annotations

from dict_store import DictStore

from sagellm_core import hookimpl
from sagellm_core.types import EvictionDecision, StoredBlocks, completed


class CorruptingStore(DictStore):
    """Gives back what it stored with one byte flipped in every third block read."""

    def __init__(self, settings, context):
        super().__init__(settings, context)
        self.reads = 0

    def get(self, keys):
        stored = super().get(keys).result()
        rows = stored.source.copy()
        for i in range(len(keys)):
            self.reads += 1
            if self.reads % 3 == 0:
                rows[i].reshape(-1)[0] ^= 0xFF
        return completed(StoredBlocks(rows, stored.row_ids, tuple(rows), stored.checksums))


class ShortReads(DictStore):
    """Reads back one block fewer than asked: a broken store."""

    def get(self, keys):
        stored = super().get(keys).result()
        return completed(StoredBlocks(stored.source, stored.row_ids[1:], stored.views[1:], stored.checksums[1:]))


class PinnedPicker:
    """An eviction policy that names every block it was told of, pinned or
    not, however few are asked: a broken policy for a store."""

    def __init__(self, settings, context):
        self.seen: list[int] = []

    @hookimpl
    def sagellm_blocks_cached(self, blocks):
        self.seen += [b.block_id for b in blocks]

    @hookimpl
    def sagellm_select_victims(self, num_blocks, candidates):
        return EvictionDecision(tuple(self.seen))
