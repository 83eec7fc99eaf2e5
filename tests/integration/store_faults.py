"""KV stores that misbehave, for tests/integration/test_kv_stores.py."""

from __future__ import annotations

from dict_store import DictStore

from sagellm_core.types import StoredBlocks, completed


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
