"""The router's index: which instance holds which blocks, in which tier,
kept from the instances' KV events (:mod:`.events`).

It knows whether it is exact. Each instance's batches are numbered; a
batch whose number skips one (a lost batch), or any batch before the
index has heard from an instance since it (re)started, makes that
instance's entry *degraded*, and the batch is not applied: the entry is
exact again once the missing batches are replayed (:meth:`KVIndex.replay`,
from the publisher's buffer). While any entry is degraded the index
reports no cached block on any instance (:meth:`KVIndex.lookup`), so the
router routes by load alone: an index that misses removals would send
requests to caches that no longer hold their prefix (SGLang's router
after a restart), one that misses some instances would favour the others.

A replay that cannot cover the gap (the publisher no longer keeps the
batches) resets the entry to empty and exact from the next batch on: it
can then miss blocks stored before the gap (it under-credits an
instance), never credit a block that is gone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .events import DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, decode


class KVIndex:
    """Blocks by instance and tier, from numbered event batches.
    ``known=False`` (a router that restarted): every instance is degraded
    until its batches from 0 are replayed."""

    def __init__(self, instance_ids: Iterable[str], known: bool = True):
        ids = list(instance_ids)
        #: instance -> content key -> the tiers ("GPU", "CPU", ...) holding it.
        self._blocks: dict[str, dict[int | bytes, set[str]]] = {i: {} for i in ids}
        #: instance -> the number of the batch expected next (``None``: any, after a reset).
        self._next: dict[str, int | None] = dict.fromkeys(ids, 0)
        self._degraded: set[str] = set() if known else set(ids)
        #: Batches applied; gaps seen; entries reset for want of a replay.
        self.applied = 0
        self.gaps = 0
        self.resets = 0

    @property
    def exact(self) -> bool:
        return not self._degraded

    def degraded(self) -> dict[str, int]:
        """The degraded instances, each with the first batch it needs."""
        return {i: self._next[i] or 0 for i in sorted(self._degraded)}

    def receive(self, instance_id: str, seq: int, payload: bytes) -> bool:
        """Apply batch ``seq`` of ``instance_id``; False if it was not
        applied: a repeat (already applied), or past a gap (the entry is
        degraded until :meth:`replay`). A payload that is not a batch
        raises :class:`~.events.EventFormatError`, nothing applied."""
        if instance_id not in self._next:
            raise KeyError(f"KV events from unknown instance {instance_id!r}")
        expected = self._next[instance_id]
        if expected is not None and seq < expected:
            return False  # delivered again (at least once): already applied
        if (expected is not None and seq > expected) or instance_id in self._degraded:
            if instance_id not in self._degraded:
                self.gaps += 1
                self._degraded.add(instance_id)
            return False
        self._apply(instance_id, decode(payload).events)
        self._next[instance_id] = seq + 1
        return True

    def replay(self, instance_id: str, batches: Sequence[tuple[int, bytes]] | None) -> None:
        """Apply the publisher's batches from the first one the entry needs,
        in order, and make it exact again. ``None``, or batches that start
        later (the publisher no longer keeps the first ones), reset it:
        empty, exact from the next batch on, whatever its number."""
        self._degraded.discard(instance_id)
        expected = self._next[instance_id]
        if batches is None or (batches and expected is not None and batches[0][0] > expected):
            self._blocks[instance_id].clear()
            self._next[instance_id] = None
            self.resets += 1
        for seq, payload in batches or ():
            self.receive(instance_id, seq, payload)

    def _apply(self, instance_id: str, events) -> None:  # type: ignore[no-untyped-def]
        blocks = self._blocks[instance_id]
        for event in events:
            if isinstance(event, BlockStored):
                medium = event.medium or DEVICE
                for key in event.block_hashes:
                    blocks.setdefault(key, set()).add(medium)
            elif isinstance(event, BlockRemoved):
                medium = event.medium or DEVICE
                for key in event.block_hashes:
                    tiers = blocks.get(key)
                    if tiers is not None:
                        tiers.discard(medium)
                        if not tiers:
                            del blocks[key]
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()
        self.applied += 1

    def lookup(self, instance_id: str, keys: Sequence[int]) -> tuple[int, int]:
        """How many of ``keys`` (a prompt's block keys, in order) the
        instance holds: the leading run in its device cache, then the run
        after it in lower tiers. ``(0, 0)`` while the index is degraded."""
        if self._degraded:
            return 0, 0
        blocks = self._blocks[instance_id]
        device = 0
        for key in keys:
            tiers = blocks.get(key)
            if tiers is None or DEVICE not in tiers:
                break
            device += 1
        lower = 0
        for key in keys[device:]:
            if key not in blocks:
                break
            lower += 1
        return device, lower

    def num_blocks(self, instance_id: str) -> int:
        return len(self._blocks[instance_id])
