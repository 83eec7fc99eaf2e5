"""In-process KV transfer between tiers: the reference for the transport hook.

Tiers are numpy byte buffers in this process, one row of ``bytes_per_block``
bytes per block: ``device`` (``context.num_blocks`` rows) and ``host``
(``host_blocks`` rows). A transfer is a real copy between them, timed with
``perf_counter``, into the rows the caller names: an engine adapter's KV
connector (vLLM's, LMDeploy's) places its blocks in its own host tier and
reports each copy through the transport. (The runtime's own tiers below the
device pool are KV stores, ``sagellm.kv_stores``.) Set ``bytes_per_block``
to the model's KV bytes per block to measure copy bandwidth at full size.
"""

from __future__ import annotations

import time

import numpy as np
from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import TransferPlan, TransferResult


@frozen
class LocalSettings:
    host_blocks: int = field(default=4096, validator=[validators.instance_of(int), validators.ge(0)])
    bytes_per_block: int = field(default=4096, validator=[validators.instance_of(int), validators.gt(0)])


class LocalTransport:
    """``[transport] plugin = "local"``"""

    Settings = LocalSettings

    def __init__(self, settings: LocalSettings, context: PluginContext):
        self.settings = settings
        self._bytes_per_block = settings.bytes_per_block
        self.tiers = {
            "device": np.zeros((context.num_blocks, settings.bytes_per_block), dtype=np.uint8),
            "host": np.zeros((settings.host_blocks, settings.bytes_per_block), dtype=np.uint8),
        }
        # The tiers' bytes, by the tier's id (the rows are C-contiguous).
        self._flat = {id(tier): memoryview(tier.reshape(-1)) for tier in self.tiers.values()}

    def _copy(self, src, dst, src_ids: list[int], dst_ids: list[int]) -> None:
        if src is not dst:
            # Row by row, each row a slice of the tier's bytes: faster than
            # numpy's fancy indexing (which builds index arrays from the
            # lists and gathers into a temporary) and than numpy rows.
            size, flat = self._bytes_per_block, self._flat
            s_rows, d_rows = flat[id(src)], flat[id(dst)]
            for s, d in zip(src_ids, dst_ids):
                d_rows[d * size : (d + 1) * size] = s_rows[s * size : (s + 1) * size]
        else:  # within one tier: gathered first, as rows may be both read and written
            dst[dst_ids] = src[src_ids]

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
        if not plan.dst_block_ids and n:
            return TransferResult(False, 0, 0, 0.0, error=f"a transfer to {plan.dst_tier!r} needs dst_block_ids")
        ids = [*plan.src_block_ids, *plan.dst_block_ids]
        if ids and (min(ids) < 0 or max(plan.src_block_ids) >= len(src) or max(plan.dst_block_ids) >= len(dst)):
            return TransferResult(False, 0, 0, 0.0, error="block id out of the tier's range")
        start = time.perf_counter()
        self._copy(src, dst, list(plan.src_block_ids), list(plan.dst_block_ids))
        seconds = time.perf_counter() - start
        return TransferResult(True, n, n * self._bytes_per_block, seconds, plan.dst_block_ids)
