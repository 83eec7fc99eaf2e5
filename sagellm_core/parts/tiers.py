"""The host tier: where offloaded KV blocks are (the index, shared by the
runtime's host tier and the engine adapters' KV connectors), and the
runtime's offload and load-back around it."""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence
from itertools import takewhile
from typing import Protocol

from sagellm_core.types import CachedBlock, PrefixMatch, Request, TransferPlan, TransferResult


class TierRuntime(Protocol):
    """What the host tier uses of the runtime: its block size, the checked
    transfer and the prefix cache's content keys."""

    block_size: int

    def transfer(self, plan: TransferPlan) -> TransferResult | None: ...

    def block_keys(self, request: Request, start: int, num_blocks: int) -> tuple[Hashable, ...]: ...


class HostTierIndex:
    """Which blocks the host tier holds, by content key, and in which slot.
    The transport chooses the slots (and reuses them when the tier is
    full): recording a slot forgets the key it held."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._slot: dict[Hashable, int] = {}
        self._key: dict[int, Hashable] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def slots(self, keys: Sequence[Hashable]) -> list[int]:
        return [self._slot[k] for k in keys]

    def record(self, keys: Sequence[Hashable], slots: Sequence[int]) -> None:
        """The transport put ``keys`` in ``slots``; a RuntimeError if a slot
        is beyond the tier's capacity (an engine's connector and the
        transport were sized apart)."""
        if slots and not (0 <= min(slots) and max(slots) < self.capacity):
            beyond = [s for s in slots if not 0 <= s < self.capacity]
            raise RuntimeError(
                f"sagellm transport placed blocks in host slots {beyond[:4]}, beyond the connector's host tier of"
                f" {self.capacity} blocks (kv_connector_extra_config host_blocks)"
            )
        slot_of, key_of = self._slot, self._key
        for key, slot in zip(keys, slots):
            old = key_of.pop(slot, None)  # the slot's previous content
            if old is not None and slot_of.get(old) == slot:
                del slot_of[old]
            previous_slot = slot_of.get(key)  # the same content saved before
            if previous_slot is not None:
                del key_of[previous_slot]
            key_of[slot] = key
            slot_of[key] = slot


#: While the host tier is bypassed, one eviction round in this many is
#: still offloaded: the probe that notices when blocks start to return.
PROBE_EVERY = 64


class HostTier:
    """The runtime's host tier (``[transport] offload_evicted``): evicted
    blocks are copied to host memory by the transport plugin, found again by
    content key when a later prompt needs them, and copied back instead of
    recomputed. The transport sizes the tier and reuses its slots.

    Admission: a copy to the tier pays for itself only if the block comes
    back. Once the tier's whole content has turned over with none read
    back (twice the blocks it holds offloaded since the last load), the
    tier is bypassed: one eviction round in ``PROBE_EVERY`` is still
    offloaded, and as the tier is then written more slowly those blocks
    stay longer to be found; any load back opens it to every round again.
    On a trace without reuse this saves every copy but the probes' (and
    their content keys). A block can only return within one turnover (then
    it is overwritten), so a tier is bypassed only where returns are rarer
    than one in two turnovers."""

    def __init__(self, rt: TierRuntime):
        self.rt = rt
        self.index = HostTierIndex(sys.maxsize)
        #: Blocks offloaded since a load back; eviction rounds while bypassed.
        self.offloaded_since_load = 0
        self._bypassed_rounds = 0

    @property
    def bypassed(self) -> bool:
        return bool(self.index) and self.offloaded_since_load >= 2 * len(self.index)

    def offload(self, removed: Sequence[CachedBlock]) -> bool:
        """Copy blocks leaving the device cache to the host tier; False
        (nothing copied) while it is bypassed, but for a probe round."""
        if self.bypassed:
            self._bypassed_rounds += 1
            if self._bypassed_rounds % PROBE_EVERY:
                return False
        keys = tuple([b.key for b in removed])
        ids = tuple([b.block_id for b in removed])
        plan = TransferPlan("device", "host", ids, self.rt.block_size, block_keys=keys)
        result = self.rt.transfer(plan)
        if result is not None and result.ok and len(result.dst_block_ids) == len(keys):
            self.index.record(keys, result.dst_block_ids)
            self.offloaded_since_load += len(keys)
        return True

    def keys_after(self, request: Request, match: PrefixMatch) -> tuple[Hashable, ...]:
        """Content keys of the prompt's blocks after the device match that the
        tier holds (a run from the first one), leaving one token to compute.
        Empty without keys from the prefix cache (``sagellm_block_keys`` is
        optional)."""
        if not self.index:  # nothing on the tier yet: no keys to compute
            return ()
        start, limit = match.num_blocks, (request.num_prompt_tokens - 1) // self.rt.block_size
        if limit <= start:
            return ()
        first = self.rt.block_keys(request, start, start + 1)  # most admissions stop at the first key
        if not first or first[0] not in self.index:
            return ()
        run = self.rt.block_keys(request, start, limit) if limit > start + 1 else first
        return self.still_held(run[: limit - start])

    def still_held(self, keys: Sequence[Hashable]) -> tuple[Hashable, ...]:
        """The leading run of ``keys`` the tier still holds (making room on
        the device may have pushed some off a full tier)."""
        return tuple(takewhile(self.index.__contains__, keys))

    def load(self, keys: tuple[Hashable, ...], block_ids: Sequence[int]) -> bool:
        """Copy blocks back from the tier into ``block_ids``."""
        slots = tuple(self.index.slots(keys))
        plan = TransferPlan(
            "host", "device", slots, self.rt.block_size, dst_block_ids=tuple(block_ids), block_keys=keys
        )
        result = self.rt.transfer(plan)
        if result is not None and result.ok:
            self.offloaded_since_load = 0
            return True
        return False
