"""Which content is in which slot of a fixed-size tier of block slots, and
where the next blocks go: the host memory of the ``host`` KV store and of
the engine adapters' KV connectors (vLLM's, LMDeploy's), each a tensor of
``capacity`` block rows indexed by slot.

A block takes a free slot (lowest first) or, once none is free, the slot
written longest ago (FIFO): a tier's content turns over oldest first; or,
given ``victims`` (a store's eviction policy), the slots of the keys it
picks. Pinned slots (a read in flight) are passed over until unpinned.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Collection, Hashable, Sequence
from itertools import takewhile


class SlotIndex:
    """Content keys to slots of a tier of ``capacity`` slots. Placing a key
    forgets whatever its slot held, and a key placed again (the same
    content saved twice) moves to its new slot."""

    def __init__(self, capacity: int, victims: Callable[[int, Collection[Hashable]], Sequence[Hashable]] | None = None):
        self.capacity = capacity
        #: ``victims(n, pinned keys)``: the held keys that make room for n
        #: more once no slot is free (they are forgotten); ``None``: FIFO.
        self.victims = victims
        self._slot: dict[Hashable, int] = {}
        self._key: dict[int, Hashable] = {}
        # Slots written, oldest first (a slot whose key was forgotten stays
        # until its turn comes); free slots, popped from the end: lowest first.
        self._written: deque[int] = deque()
        self._free = list(range(capacity - 1, -1, -1))
        self._pins: Counter[Hashable] = Counter()  # keys a read holds

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slot

    def __len__(self) -> int:
        """The keys held."""
        return len(self._slot)

    def slots(self, keys: Sequence[Hashable]) -> list[int]:
        return [self._slot[k] for k in keys]

    def leading(self, keys: Sequence[Hashable]) -> int:
        """How many of ``keys``, from the first, are held."""
        held = self._slot.__contains__
        if all(map(held, keys)):  # (the common answer, at C speed)
            return len(keys)
        return sum(1 for _ in takewhile(held, keys))

    def place(self, keys: Sequence[Hashable]) -> list[int] | None:
        """Slots for ``keys`` (free ones first, then the oldest written whose
        content no read holds pinned), recorded; ``None`` (nothing changed)
        when more keys than that are asked."""
        n = len(keys)
        free, written, pins, key_of = self._free, self._written, self._pins, self._key
        pinned = sum(1 for key in pins if key in self._slot) if pins else 0
        if self.victims is not None:
            if n > len(free) + len(self._slot) - pinned:
                return None
            if n > len(free):
                self.forget(self.victims(n - len(free), pins))
            if n > len(free):  # the policy picked fewer
                return None
            slots = free[len(free) - n :][::-1]
            del free[len(free) - n :]
            self.record(keys, slots)
            return slots
        if n > len(free) + len(written) - pinned:
            return None
        take = min(n, len(free))
        slots = free[len(free) - take :][::-1]
        del free[len(free) - take :]
        passed = []
        while len(slots) < n:
            slot = written.popleft()
            (passed if pins and key_of.get(slot) in pins else slots).append(slot)
        written.extendleft(reversed(passed))  # still the oldest
        written.extend(slots)
        self.record(keys, slots)
        return slots

    def record(self, keys: Sequence[Hashable], slots: Sequence[int]) -> None:
        slot_of, key_of = self._slot, self._key
        for key, slot in zip(keys, slots):
            old = key_of.pop(slot, None)  # the slot's previous content
            if old is not None and slot_of.get(old) == slot:
                del slot_of[old]
            previous_slot = slot_of.get(key)  # the same content saved before
            if previous_slot is not None:
                del key_of[previous_slot]
                if self.victims is not None:
                    self._free.append(previous_slot)
            key_of[slot] = key
            slot_of[key] = slot

    def forget(self, keys: Sequence[Hashable]) -> None:
        """Drop ``keys`` (their slots are reused in their turn, or at once
        with ``victims``)."""
        for key in keys:
            slot = self._slot.pop(key, None)
            if slot is not None:
                del self._key[slot]
                if self.victims is not None:
                    self._free.append(slot)

    def pin(self, keys: Sequence[Hashable]) -> None:
        """Keep the slots of ``keys`` from reuse until they are unpinned."""
        self._pins.update(keys)

    def unpin(self, keys: Sequence[Hashable]) -> None:
        self._pins.subtract(keys)
        self._pins = +self._pins
