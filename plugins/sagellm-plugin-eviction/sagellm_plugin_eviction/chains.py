"""Bookkeeping shared by the policies that evict only the leaves of prefix
chains and remember use counts by content key (``cost``, ``predictive``,
``continuation``).

Evicting an inner block would drop its descendants with it, more blocks than
asked for; a chain instead shrinks from its leaf, and its parent becomes a
leaf in turn. A content key evicted and cached again keeps its use count, as
ARC's ghost lists remember evicted keys (the last ``num_blocks`` of them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from attrs import define

from sagellm_core import PluginContext
from sagellm_core.types import CachedBlock


@define(slots=True, eq=False)
class ChainRecord:
    """What :class:`LeafChains` knows of a cached block."""

    #: The policy's own: a priority, a release time, a turn.
    value: Any
    #: Uses of the block's content: 1 when cached, +1 per hit, remembered
    #: across an eviction by content key.
    uses: int
    key: int
    parent: int | None
    depth: int
    #: Cached children.
    children: int = 0
    #: Referenced by a request (so not evictable).
    held: bool = True


class LeafChains:
    """A :class:`ChainRecord` (or a subclass's ``Record``) per cached block,
    in ``self._meta``. A block is an evictable leaf when it is not held and
    has no cached child; the policy is told when one may have become a leaf
    (:meth:`_leaf`) and when one stops being one (:meth:`_not_leaf`)."""

    Record: type[ChainRecord] = ChainRecord

    def __init__(self, context: PluginContext):
        self.ghost_limit = context.num_blocks
        self._meta: dict[int, ChainRecord] = {}
        self._ghost: OrderedDict[int, int] = OrderedDict()  # content key -> uses

    def _leaf(self, block_id: int) -> None:
        """``block_id`` may be an evictable leaf now (check the record)."""
        raise NotImplementedError

    def _not_leaf(self, block_id: int) -> None:
        """``block_id`` is not an evictable leaf (any more), or is gone."""
        raise NotImplementedError

    def _cache(self, block: CachedBlock, value: Any) -> ChainRecord:
        """Record a block the cache took (held by its request)."""
        uses = self._ghost.pop(block.key, 0) + 1
        meta = self._meta[block.block_id] = self.Record(value, uses, block.key, block.parent_id, block.depth)
        parent = self._meta.get(block.parent_id) if block.parent_id is not None else None
        if parent is not None:
            parent.children += 1
            self._not_leaf(block.parent_id)
        return meta

    def _release(self, blocks: tuple[CachedBlock, ...], value: Callable[[ChainRecord], Any]) -> None:
        """Blocks lost their last reference: each record takes
        ``value(record)`` and the block is offered as a leaf."""
        for block in blocks:
            meta = self._meta.get(block.block_id)
            if meta is not None:
                meta.value = value(meta)
                meta.held = False
                self._leaf(block.block_id)

    def _forget(self, block_id: int) -> ChainRecord | None:
        """Drop an evicted block's record, remember its use count, and offer
        its parent as a leaf; return the record (``None`` if unknown)."""
        meta = self._meta.pop(block_id, None)
        self._not_leaf(block_id)
        if meta is None:
            return None
        self._ghost[meta.key] = meta.uses
        if len(self._ghost) > self.ghost_limit:
            self._ghost.popitem(last=False)
        parent = self._meta.get(meta.parent) if meta.parent is not None else None
        if parent is not None:
            parent.children -= 1
            self._leaf(meta.parent)  # a leaf again, if unheld
        return meta
