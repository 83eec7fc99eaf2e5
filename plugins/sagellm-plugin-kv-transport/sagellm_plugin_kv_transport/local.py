"""In-process KV transfer between tiers: the reference for the transport hook.

Tiers are buffers in this process, one row per block: ``device`` (the
engine's blocks, ``context.num_blocks`` rows) and ``host`` (``host_blocks``
rows, reused oldest first when full). A transfer is a real copy between them,
timed with ``perf_counter``.

* Engines with real KV tensors (the torch engine) announce them through
  ``sagellm_kv_caches_allocated``: ``device`` is then the engine's own KV
  tensor and ``host`` a CPU tensor of the same per-block shape, so an
  evicted block's K/V bytes of every layer go to host memory and come back
  in one copy (the engine's device copies, on its copy stream, when it says
  how; else ``index_select`` / ``index_copy_`` along the block dimension).
* The replay engine has no KV tensors: a row is a numpy byte row of
  ``bytes_per_block`` bytes (set it to the model's KV bytes per block to
  measure copy bandwidth at full size).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import KVCaches, TransferPlan, TransferResult


@frozen
class LocalSettings:
    host_blocks: int = field(default=4096, validator=[validators.instance_of(int), validators.ge(0)])
    bytes_per_block: int = field(default=4096, validator=[validators.instance_of(int), validators.gt(0)])


class LocalTransport:
    """``[transport] plugin = "local"``"""

    Settings = LocalSettings

    def __init__(self, settings: LocalSettings, context: PluginContext):
        self.settings = settings
        #: The block dimension of the tiers when they are an engine's KV
        #: tensors (torch), ``None`` for numpy byte rows (dimension 0).
        self._block_dim: int | None = None
        self._copy_blocks = None
        self._bytes_per_block = settings.bytes_per_block
        self.tiers = {
            "device": np.zeros((context.num_blocks, settings.bytes_per_block), dtype=np.uint8),
            "host": np.zeros((settings.host_blocks, settings.bytes_per_block), dtype=np.uint8),
        }
        # The numpy tiers' bytes, by the tier's id (the rows are C-contiguous).
        self._flat = {id(tier): memoryview(tier.reshape(-1)) for tier in self.tiers.values()}
        # Host slots holding a block, in the order they were written: the
        # oldest is reused first once no slot is free.
        self._host_used: deque[int] = deque()
        self._host_free = list(range(settings.host_blocks - 1, -1, -1))  # popped from the end: lowest first

    def _host_slots_for(self, n: int) -> list[int]:
        """``n`` host slots: free ones first (lowest first), then the oldest
        written. ``n`` is at most the tier's size, so the reused ones were
        all written before this call."""
        free = self._host_free
        take = min(n, len(free))
        slots = free[len(free) - take :][::-1]
        del free[len(free) - take :]
        used = self._host_used
        slots += [used.popleft() for _ in range(n - take)]
        used.extend(slots)
        return slots

    @hookimpl
    def sagellm_kv_caches_allocated(self, kv_caches: KVCaches) -> None:
        import torch  # only an engine with torch KV tensors calls this

        device = kv_caches.tensor
        shape = list(device.shape)
        shape[kv_caches.block_dim] = self.settings.host_blocks
        # Pinned host memory makes device-to-host copies asynchronous-capable
        # and faster on CUDA; pages are only touched when a block is written.
        pin = device.is_cuda and torch.cuda.is_available()
        host = torch.empty(shape, dtype=device.dtype, device="cpu", pin_memory=pin)
        self.tiers = {"device": device, "host": host}
        self._flat = {}  # (the numpy tiers' memory goes with them)
        self._block_dim = kv_caches.block_dim
        self._copy_blocks = kv_caches.copy_blocks
        self._bytes_per_block = kv_caches.bytes_per_block

    def _num_rows(self, tier) -> int:
        return int(tier.shape[self._block_dim or 0])

    def _copy(self, src, dst, src_ids: list[int], dst_ids: list[int]) -> None:
        if self._block_dim is None:
            if src is not dst:
                # Row by row, each row a slice of the tier's bytes: faster
                # than numpy's fancy indexing (which builds index arrays from
                # the lists and gathers into a temporary) and than numpy rows.
                size, flat = self._bytes_per_block, self._flat
                s_rows, d_rows = flat[id(src)], flat[id(dst)]
                for s, d in zip(src_ids, dst_ids):
                    d_rows[d * size : (d + 1) * size] = s_rows[s * size : (s + 1) * size]
            else:  # within one tier: gathered first, as rows may be both read and written
                dst[dst_ids] = src[src_ids]
            return
        if self._copy_blocks is not None:  # the engine's device copies, on its stream
            self._copy_blocks(src, src_ids, dst, dst_ids)
            return
        import torch

        dim = self._block_dim
        rows = src.index_select(dim, torch.tensor(src_ids, dtype=torch.long, device=src.device))
        dst.index_copy_(dim, torch.tensor(dst_ids, dtype=torch.long, device=dst.device), rows.to(dst.device))

    @hookimpl
    def sagellm_transfer_blocks(self, plan: TransferPlan) -> TransferResult:
        src = self.tiers.get(plan.src_tier)
        dst = self.tiers.get(plan.dst_tier)
        n = len(plan.src_block_ids)
        if src is None or dst is None:
            unknown = plan.src_tier if src is None else plan.dst_tier
            return TransferResult(False, 0, 0, 0.0, error=f"unknown tier {unknown!r}; tiers: device, host")
        if plan.dst_block_ids and len(plan.dst_block_ids) != n:
            return TransferResult(False, 0, 0, 0.0, error="dst_block_ids and src_block_ids differ in length")
        if not plan.dst_block_ids and plan.dst_tier != "host":
            return TransferResult(False, 0, 0, 0.0, error=f"a transfer to {plan.dst_tier!r} needs dst_block_ids")
        if n > self._num_rows(dst):
            return TransferResult(
                False, 0, 0, 0.0, error=f"{n} blocks do not fit tier {plan.dst_tier!r} ({self._num_rows(dst)} blocks)"
            )
        if max(plan.src_block_ids, default=0) >= self._num_rows(src) or max(
            plan.dst_block_ids, default=0
        ) >= self._num_rows(dst):
            return TransferResult(False, 0, 0, 0.0, error="block id out of the tier's range")
        start = time.perf_counter()
        slots = list(plan.dst_block_ids) or self._host_slots_for(n)
        self._copy(src, dst, list(plan.src_block_ids), slots)
        seconds = time.perf_counter() - start
        return TransferResult(True, n, n * self._bytes_per_block, seconds, tuple(slots))
