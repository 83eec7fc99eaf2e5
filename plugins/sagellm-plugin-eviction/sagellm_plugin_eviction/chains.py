"""Bookkeeping shared by the policies that evict only the leaves of prefix
chains and remember use counts by content key (``cost``, ``predictive``).

Evicting an inner block would drop its descendants with it, more blocks than
asked for; a chain instead shrinks from its leaf, and its parent becomes a
leaf in turn. A content key evicted and cached again keeps its use count, as
ARC's ghost lists remember evicted keys (the last ``num_blocks`` of them).
"""

from __future__ import annotations

from collections import OrderedDict

from sagellm_core import PluginContext
from sagellm_core.types import CachedBlock

# The fields of a cached block's record; a policy keeps its own in VALUE and
# after DEPTH.
VALUE, USES, KEY, PARENT, CHILDREN, HELD, DEPTH = range(7)


class LeafChains:
    """Per cached block a record ``[value, uses, content key, parent, cached
    children, held, depth, ...]``. A block is an evictable leaf when it is
    not held and has no cached child; the policy is told when one may have
    become a leaf (:meth:`_leaf`) and when one stops being one
    (:meth:`_not_leaf`)."""

    def __init__(self, context: PluginContext):
        self.ghost_limit = context.num_blocks
        self._meta: dict[int, list] = {}
        self._ghost: OrderedDict[int, int] = OrderedDict()  # content key -> uses

    def _leaf(self, block_id: int) -> None:
        """``block_id`` may be an evictable leaf now (check the record)."""
        raise NotImplementedError

    def _not_leaf(self, block_id: int) -> None:
        """``block_id`` is not an evictable leaf (any more), or is gone."""
        raise NotImplementedError

    def _cache(self, block: CachedBlock, value) -> list:
        """Record a block the cache took (held by its request)."""
        uses = self._ghost.pop(block.key, 0) + 1
        meta = self._meta[block.block_id] = [value, uses, block.key, block.parent_id, 0, True, block.depth]
        parent = self._meta.get(block.parent_id) if block.parent_id is not None else None
        if parent is not None:
            parent[CHILDREN] += 1
            self._not_leaf(block.parent_id)
        return meta

    def _release(self, blocks, value) -> None:
        """Blocks lost their last reference: each record takes
        ``value(record)`` and the block is offered as a leaf."""
        for block in blocks:
            meta = self._meta.get(block.block_id)
            if meta is not None:
                meta[VALUE] = value(meta)
                meta[HELD] = False
                self._leaf(block.block_id)

    def _forget(self, block_id: int) -> list | None:
        """Drop an evicted block's record, remember its use count, and offer
        its parent as a leaf; return the record (``None`` if unknown)."""
        meta = self._meta.pop(block_id, None)
        self._not_leaf(block_id)
        if meta is None:
            return None
        self._ghost[meta[KEY]] = meta[USES]
        if len(self._ghost) > self.ghost_limit:
            self._ghost.popitem(last=False)
        parent = self._meta.get(meta[PARENT]) if meta[PARENT] is not None else None
        if parent is not None:
            parent[CHILDREN] -= 1
            self._leaf(meta[PARENT])  # a leaf again, if unheld
        return meta
