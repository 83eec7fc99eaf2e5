"""Host memory shaped like the device's blocks: ``capacity`` rows, each one
block of every layer, in the device tensor's dtype and per-block layout.

Rows are block-major (row ``i`` is one contiguous block, so its bytes are
checksummed and written without a copy), and seen by the device's block
copy through a view whose block dimension is the device tensor's. On a
CUDA device the rows are pinned, so the copies are asynchronous-capable
and run at full PCIe speed; the copies are the engine's
(``KVCaches.copy_blocks``: on its copy stream, ordered by events).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sagellm_core.types import CachedBlock, KVCaches


class HostRows:
    """``capacity`` block rows in host memory for the device KV ``kv``
    (``pinned``: page-locked where the device is a GPU)."""

    def __init__(self, kv: KVCaches, capacity: int, pinned: bool = True):
        self.kv = kv
        self.capacity = capacity
        device, dim = kv.tensor, kv.block_dim
        per_block = tuple(device.shape[:dim]) + tuple(device.shape[dim + 1 :])
        if isinstance(device, np.ndarray):
            self.rows: Any = np.zeros((capacity, *per_block), dtype=device.dtype)
            #: The rows as the device's block copy reads and writes them.
            self.source: Any = np.moveaxis(self.rows, 0, dim)
            self.bytes = self.rows.reshape(capacity, -1).view(np.uint8)
        else:
            import torch  # an engine with torch KV tensors announced them

            pin = pinned and device.is_cuda and torch.cuda.is_available()
            self.rows = torch.empty((capacity, *per_block), dtype=device.dtype, device="cpu", pin_memory=pin)
            self.source = self.rows.movedim(0, dim)
            self.bytes = self.rows.view(capacity, -1).view(torch.uint8).numpy()
        #: Each row's bytes: a C-contiguous numpy view.
        self.bytes_per_block = int(self.bytes.shape[1]) if capacity else kv.bytes_per_block

    def copy_in(self, block_ids: Sequence[int], rows: Sequence[int]) -> None:
        """Copy device blocks ``block_ids`` into ``rows``."""
        self.kv.copy(self.kv.tensor, block_ids, self.source, rows)

    def view(self, row: int) -> Any:
        return self.bytes[row]


def stage_new(kv: KVCaches | None, new: Sequence[CachedBlock]) -> tuple[list[int], HostRows] | None:
    """The keys of ``new`` (the blocks a store does not hold yet) and their
    bytes copied off the device into host rows, for a writer thread to write
    out at its own pace; ``None`` when there are none."""
    if not new:
        return None
    assert kv is not None, "the runtime announces the device KV before the first put"
    staged = HostRows(kv, len(new), pinned=False)
    staged.copy_in([b.block_id for b in new], range(len(new)))
    return [b.key for b in new], staged
