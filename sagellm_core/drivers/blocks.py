"""The cached blocks of an engine that keeps its own (vLLM's block pool,
LMDeploy's trie), as the runtime sees them.

An adapter describes each block the engine caches as a :class:`CachedBlock`
(depth, parent, content key) and tells a :class:`BlockObserver` what the
engine did with it; the observer keeps the records, the parent/child links
and the evictable set (blocks only the cache holds: the candidates handed to
the victim-selection hook), and reports each change through the runtime's
observation API (``blocks_cached`` / ``_touched`` / ``_released`` /
``_evicted``). It knows nothing of any engine: an engine adapter subclasses
it for what only its engine has (vLLM's private copies, LMDeploy's nodes).

Evicting a block evicts its cached descendants too: no lookup reaches them
once their parent is gone (:meth:`with_descendants`, :meth:`subtree`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from sagellm_core.runtime import Runtime
from sagellm_core.types import CachedBlock, EvictionCandidates


class BlockObserver:
    """Records of an engine's cached blocks, by engine block id."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        #: engine block id -> its description
        self.cached: dict[int, CachedBlock] = {}
        #: block id -> its cached children's ids
        self.children: dict[int, set[int]] = {}
        #: cached blocks no request holds: the victim-selection candidates
        self.evictable: set[int] = set()
        self._evicted: list[CachedBlock] = []

    # ------------------------------------------------------------ records --

    def add(self, block: CachedBlock) -> CachedBlock:
        """Record ``block`` (linked under its parent), reporting nothing:
        :meth:`report_cached` reports a batch of them."""
        self.cached[block.block_id] = block
        if block.parent_id is not None:
            self.children.setdefault(block.parent_id, set()).add(block.block_id)
        return block

    def forget(self, block_id: int) -> CachedBlock | None:
        """Drop the record of ``block_id`` (None if there is none)."""
        block = self.cached.pop(block_id, None)
        if block is None:
            return None
        self.evictable.discard(block_id)
        if block.parent_id is not None:
            siblings = self.children.get(block.parent_id)
            if siblings is not None:
                siblings.discard(block_id)
        self.children.pop(block_id, None)
        return block

    # ------------------------------------------------------- observations --

    def report_cached(self, blocks: Iterable[CachedBlock]) -> None:
        """The engine cached these recorded blocks (held by a request)."""
        self.runtime.blocks_cached(tuple(blocks))

    def touch(self, block_ids: Iterable[int]) -> None:
        """A request hit or took these blocks: those cached stop being
        evictable, and are reported touched."""
        cached = self.cached
        hit = tuple(cached[b] for b in block_ids if b in cached)
        if hit:
            self.evictable.difference_update(b.block_id for b in hit)
            self.runtime.blocks_touched(hit)

    def release(self, block_ids: Iterable[int]) -> None:
        """No request holds these blocks any more: those cached and not yet
        evictable become evictable, reported in the order given (a chain's
        root first, as the radix cache releases one)."""
        cached, evictable = self.cached, self.evictable
        released = tuple(cached[b] for b in block_ids if b in cached and b not in evictable)
        if released:
            evictable.update(b.block_id for b in released)
            self.runtime.blocks_released(released)

    def evict(self, block_id: int) -> CachedBlock | None:
        """The engine evicted ``block_id``: forgotten now, reported by
        :meth:`flush_evicted` (once per engine operation, not per block)."""
        block = self.forget(block_id)
        if block is not None:
            self._evicted.append(block)
        return block

    def flush_evicted(self) -> None:
        """Report the blocks evicted since the last flush (counted by the runtime)."""
        if self._evicted:
            evicted, self._evicted = tuple(self._evicted), []
            self.runtime.blocks_evicted(evicted)

    # ---------------------------------------------------------- decisions --

    def select_victims(self, num_blocks: int, candidates: EvictionCandidates | None = None) -> tuple[int, ...]:
        """Up to ``num_blocks`` victims from the eviction policy (checked by
        the runtime) among ``candidates``, by default every evictable block."""
        return self.runtime.select_victims(num_blocks, self.evictable if candidates is None else candidates)

    def with_descendants(self, victims: Iterable[int]) -> list[int]:
        """Each victim still evictable, followed by its evictable cached
        descendants (depth first), each block once."""
        evictable, children = self.evictable, self.children
        chosen: list[int] = []
        seen: set[int] = set()
        for victim in victims:
            stack = [victim]
            while stack:
                block_id = stack.pop()
                if block_id in seen or block_id not in evictable:
                    continue
                seen.add(block_id)
                chosen.append(block_id)
                stack.extend(children.get(block_id, ()))
        return chosen

    def subtree(self, block_id: int, children: Callable[[int], Iterable[int]] | None = None) -> list[int]:
        """``block_id`` and all its cached descendants, each before its own
        descendants (depth first). ``children`` gives a block's children in
        the engine's own order (default: the recorded links)."""
        children = children or (lambda b: self.children.get(b, ()))
        order: list[int] = []
        stack = [block_id]
        while stack:
            current = stack.pop()
            order.append(current)
            stack.extend(children(current))
        return order
