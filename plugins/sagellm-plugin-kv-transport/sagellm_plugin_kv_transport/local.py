"""In-process KV transfer between tiers: the reference for the transport hook.

Tiers are byte buffers in this process, one row per block: ``device`` (the
engine's blocks, ``context.num_blocks`` rows) and ``host`` (``host_blocks``
rows, reused oldest first when full). A transfer is a real copy between them
(numpy fancy indexing), timed with ``perf_counter``. The replay engine has no
KV tensors, so a row holds ``bytes_per_block`` bytes: set it to the model's
KV bytes per block to measure real copy bandwidth at full size.
"""

from __future__ import annotations

import time
from collections import OrderedDict

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
        self.tiers = {
            "device": np.zeros((context.num_blocks, settings.bytes_per_block), dtype=np.uint8),
            "host": np.zeros((settings.host_blocks, settings.bytes_per_block), dtype=np.uint8),
        }
        # host slot -> content key (or None): the order of reuse, oldest first.
        self._host_slots: OrderedDict[int, bytes | None] = OrderedDict()
        self._host_free = list(range(settings.host_blocks - 1, -1, -1))

    def _host_slots_for(self, n: int, keys: tuple[bytes, ...]) -> list[int]:
        slots = []
        for i in range(n):
            if self._host_free:
                slot = self._host_free.pop()
            else:
                slot, _ = self._host_slots.popitem(last=False)
            self._host_slots[slot] = keys[i] if i < len(keys) else None
            slots.append(slot)
        return slots

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
        if n > len(dst):
            return TransferResult(False, 0, 0, 0.0, error=f"{n} blocks do not fit tier {plan.dst_tier!r} ({len(dst)} blocks)")
        if max(plan.src_block_ids, default=0) >= len(src) or max(plan.dst_block_ids, default=0) >= len(dst):
            return TransferResult(False, 0, 0, 0.0, error="block id out of the tier's range")
        start = time.perf_counter()
        slots = list(plan.dst_block_ids) or self._host_slots_for(n, plan.block_keys)
        dst[slots] = src[list(plan.src_block_ids)]
        seconds = time.perf_counter() - start
        return TransferResult(True, n, n * src.shape[1], seconds, tuple(slots))
