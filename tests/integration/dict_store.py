"""``[kv_stores] tiers = ["dict"]``: every block it is offered, in a dict.

A KV store in full: no capacity and no admission (it keeps all it is
given), synchronous copies (its futures are done when returned), for a
device pool whose blocks lie along dimension 0 (the replay's stand-in
rows; the ``host`` store handles any layout).
"""

from collections.abc import Sequence
from concurrent.futures import Future
from itertools import takewhile

import numpy as np

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import CachedBlock, KVCaches, StoredBlocks, block_checksum, completed


class DictStore:
    def __init__(self, settings: object, context: PluginContext):
        self.blocks: dict[int, tuple[np.ndarray, int]] = {}  # key -> (bytes, checksum)
        self.kv: KVCaches | None = None

    @hookimpl
    def sagellm_kv_caches_allocated(self, kv_caches: KVCaches) -> None:
        self.kv = kv_caches  # where put copies from

    def contains(self, keys: Sequence[int]) -> int:
        return sum(1 for _ in takewhile(self.blocks.__contains__, keys))

    def put(self, blocks: Sequence[CachedBlock]) -> Future[int]:
        kv = self.kv
        assert kv is not None
        rows = np.empty((len(blocks), *kv.tensor.shape[1:]), dtype=kv.tensor.dtype)
        kv.copy(kv.tensor, [b.block_id for b in blocks], rows, range(len(blocks)))
        for block, row in zip(blocks, rows):
            self.blocks[block.key] = (row, block_checksum(row))
        return completed(len(blocks))

    def get(self, keys: Sequence[int]) -> Future[StoredBlocks]:
        rows = np.stack([self.blocks[key][0] for key in keys])
        checksums = tuple(self.blocks[key][1] for key in keys)
        return completed(StoredBlocks(rows, tuple(range(len(keys))), tuple(rows), checksums))

    def prefetch(self, keys: Sequence[int]) -> Future[int]:
        return completed(self.contains(keys))  # already where get reads from

    def pin(self, keys: Sequence[int]) -> None:
        pass  # nothing is ever evicted

    def unpin(self, keys: Sequence[int]) -> None:
        pass

    def remove(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.blocks.pop(key, None)

    def stats(self) -> dict[str, int]:
        return {"held": len(self.blocks)}
