"""A KV store's eviction order from any ``sagellm.eviction`` policy
(``[kv_stores.NAME] eviction = "lfu"``): a fresh instance of the named
policy, found by entry point as the config finds one (so a store never
imports an eviction plugin), told what the store writes, reads and drops,
and asked which of its unpinned blocks make room.

The policy sees the store's blocks as it sees the device's: each content
key held gets a block id of its own, cached and released when it is
written, touched and released again when it is read, evicted when it
goes. A stored block is a chain of its own (depth 0): a store drops blocks
one by one, not a prefix's tail first. The policy's clock counts the
store's events, so its order is the same on any machine; a policy that
reads the future (``belady``) has none here and says so when it starts.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from typing import Any

import pluggy

from sagellm_core import hookspecs
from sagellm_core.errors import PluginError
from sagellm_core.registry import PluginContext, build_settings, load_class
from sagellm_core.types import CachedBlock, EvictionDecision


class _Unpinned:
    """The ids of held blocks no read holds (``EvictionCandidates``)."""

    def __init__(self, ids: dict[int, int], keys: dict[int, int], pinned: Collection[int]):
        self.ids, self.keys, self.pinned = ids, keys, pinned

    def __contains__(self, block_id: object) -> bool:
        key = self.keys.get(block_id, None) if isinstance(block_id, int) else None
        return key is not None and key not in self.pinned

    def __len__(self) -> int:
        return len(self.keys) - sum(1 for key in self.pinned if key in self.ids)

    def __iter__(self) -> Iterator[int]:
        return (i for i, key in self.keys.items() if key not in self.pinned)


class StoreEviction:
    """The eviction policy ``name`` over the content keys a store of
    ``capacity`` blocks holds; ``where`` names the store in errors."""

    def __init__(self, name: str, capacity: int, where: str):
        self.name, self.where = name, where
        cls, _ = load_class("eviction", name, where)
        policy = cls(build_settings(cls, {}, where), PluginContext(name, 1, max(capacity, 1)))
        manager = pluggy.PluginManager(hookspecs.PROJECT)
        manager.add_hookspecs(hookspecs)
        manager.register(policy, name=f"eviction:{name}")
        self.hook = manager.hook
        self._id: dict[int, int] = {}  # content key -> block id
        self._key: dict[int, int] = {}  # block id -> content key
        self._free: list[int] = []  # ids given back
        self._clock = 0

    def __contains__(self, key: int) -> bool:
        return key in self._id

    def __len__(self) -> int:
        return len(self._id)

    def _blocks(self, keys: Sequence[int]) -> tuple[CachedBlock, ...]:
        return tuple(CachedBlock(self._id[key], 0, None, key) for key in keys)

    def _tick(self) -> float:
        self._clock += 1
        return float(self._clock)

    def written(self, keys: Sequence[int]) -> None:
        """The store wrote ``keys`` (one held already counts as read)."""
        self.read(keys)
        new = [key for key in dict.fromkeys(keys) if key not in self._id]
        for key in new:
            block_id = self._free.pop() if self._free else len(self._id)
            self._id[key], self._key[block_id] = block_id, key
        if new:
            blocks, now_s = self._blocks(new), self._tick()
            self.hook.sagellm_blocks_cached(blocks=blocks, now_s=now_s)
            self._released(blocks, now_s)

    def read(self, keys: Sequence[int]) -> None:
        """The store read ``keys`` back: a hit (those not held are ignored)."""
        keys = [key for key in keys if key in self._id]
        if keys:
            blocks, now_s = self._blocks(keys), self._tick()
            self.hook.sagellm_blocks_touched(blocks=blocks, now_s=now_s)
            self._released(blocks, now_s)

    def _released(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        # A policy takes a release's blocks deepest (last) first: reversed,
        # the first key written or read is the first in its order.
        self.hook.sagellm_blocks_released(blocks=blocks[::-1], now_s=now_s, request=None)

    def dropped(self, keys: Sequence[int]) -> None:
        """``keys`` left the store (made room, removed); those not held are ignored."""
        gone = [key for key in dict.fromkeys(keys) if key in self._id]
        if gone:
            self.hook.sagellm_blocks_evicted(blocks=self._blocks(gone), now_s=self._tick())
        for key in gone:
            block_id = self._id.pop(key)
            del self._key[block_id]
            self._free.append(block_id)

    def make_room(self, num_blocks: int, pinned: Collection[int] = ()) -> list[int]:
        """The keys of up to ``num_blocks`` held blocks, none of them
        ``pinned``, that the policy evicts first, dropped from it: the store
        deletes them. A policy that names a block the store cannot drop is a
        one-line error naming it."""
        candidates = _Unpinned(self._id, self._key, pinned)
        decision: Any = self.hook.sagellm_select_victims(num_blocks=num_blocks, candidates=candidates)
        victims = decision.victim_ids if isinstance(decision, EvictionDecision) else ()
        wrong = decision is not None and not isinstance(decision, EvictionDecision)
        if wrong or not (len(set(victims)) == len(victims) <= num_blocks and all(v in candidates for v in victims)):
            raise PluginError(
                f"{self.where}: eviction policy {self.name!r} chose {decision!r} for {num_blocks} of the"
                f" {len(candidates)} blocks it may evict"
            )
        keys = [self._key[v] for v in victims]
        self.dropped(keys)
        return keys
