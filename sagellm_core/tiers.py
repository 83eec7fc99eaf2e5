"""Where offloaded KV blocks are: the host tier's index, shared by the
runtime (replay's host tier) and the engine adapters' KV connectors."""

from __future__ import annotations

from typing import Hashable, Sequence


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
        beyond = [s for s in slots if not 0 <= s < self.capacity]
        if beyond:
            raise RuntimeError(
                f"sagellm transport placed blocks in host slots {beyond[:4]}, beyond the connector's host tier of"
                f" {self.capacity} blocks (kv_connector_extra_config host_blocks)"
            )
        for key, slot in zip(keys, slots):
            old = self._key.pop(slot, None)  # the slot's previous content
            if old is not None and self._slot.get(old) == slot:
                del self._slot[old]
            previous_slot = self._slot.get(key)  # the same content saved before
            if previous_slot is not None:
                del self._key[previous_slot]
            self._key[slot] = key
            self._slot[key] = slot
