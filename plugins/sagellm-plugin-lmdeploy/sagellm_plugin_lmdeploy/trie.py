"""LMDeploy's prefix-cache trie with sagellm choosing what to evict, and,
with a ``[prefix_cache] plugin`` in the config, what matches.

``SagellmBlockTrie`` is LMDeploy's ``BlockTrie``. Without a prefix-cache
plugin its matching, block identity, de-duplication and reference counts
stay. What changes:

* the observation hooks see what the trie does: a match touches the blocks
  it reuses, ``allocate`` caches new full blocks (or touches the cached one
  a duplicate was folded into), and a free that leaves a block referenced by
  the cache alone releases it;
* ``evict`` frees the blocks sagellm's eviction policy names (with their
  cached descendants, which no lookup reaches once their parent is gone)
  instead of LMDeploy's least-recently-accessed leaves;
* with a ``[kv_pool] plugin`` in the config, that plugin chooses the physical
  GPU blocks LMDeploy's allocator hands out, and a block's logical id (what
  sequences, the trie and the plugins see) is the id the plugin chose;
* with a ``[prefix_cache] plugin``, that plugin matches and caches in place
  of LMDeploy's trie walk (:mod:`sagellm_plugin_lmdeploy.matching`), and its
  pinned blocks are never offered to the policy.

Blocks are described as the radix prefix cache describes them
(:class:`CachedBlock`: depth, parent, the chained SHA-256 content key over
the block's token ids, the adapter as namespace), so a policy sees the same
stream in LMDeploy as in ``sagellm replay``, and the Belady oracle's keys
match.
"""

from __future__ import annotations

from sagellm_core.drivers.blocks import BlockObserver
from sagellm_core.errors import ConfigError, PluginError
from sagellm_core.runtime import Runtime
from sagellm_core.types import ROOT_KEY, CachedBlock, PrefixMatch, chain_key
from sagellm_plugin_lmdeploy.compat import BlockTrie, LogicalAllocator, numpy
from sagellm_plugin_lmdeploy.matching import PluginMatcher


class TrieObserver(BlockObserver):
    """What sagellm knows of the trie (the shared :class:`BlockObserver`: a
    :class:`CachedBlock` per cached block, the evictable set: referenced by
    the trie alone), and the trie node and content key of each."""

    def __init__(self, runtime: Runtime, block_size: int):
        super().__init__(runtime)
        self.block_size = block_size
        self.by_key: dict[int, CachedBlock] = {}  # content key -> cached block (the trie holds one per key)
        self.nodes: dict[int, object] = {}

    def _describe(self, node) -> CachedBlock:
        parent = node.parent
        if parent is not None and parent.parent is not None:
            up = self.cached[parent.block_id]
            parent_id, parent_key = up.block_id, up.key
        else:
            namespace = node.adapter_name or ""
            parent_id = None
            parent_key = chain_key(ROOT_KEY, namespace.encode()) if namespace else ROOT_KEY
        tokens = numpy.asarray(node.token_ids, dtype=numpy.int64)
        return CachedBlock(
            node.block_id,
            node.prefix_len // self.block_size - 1,
            parent_id,
            chain_key(parent_key, tokens.tobytes()),
            node.adapter_name or "",
        )

    def path(self, node, stop) -> list:
        """Nodes from ``stop`` (exclusive) down to ``node``, root side first."""
        out = []
        while node is not None and node is not stop and node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def on_matched(self, blocks: list[CachedBlock], ref_counts) -> None:
        self.touch(b.block_id for b, refs in zip(blocks, ref_counts) if refs > 1)

    def on_trie_extended(self, nodes: list, ref_counts) -> None:
        """LMDeploy's trie walked ``nodes`` to attach a sequence's blocks."""
        new, new_refs, folded = [], [], []
        for node, refs in zip(nodes, ref_counts):
            known = self.cached.get(node.block_id)
            if known is None:
                self.nodes[node.block_id] = node
                # Recorded now: the next node's description reads its parent's key.
                known = self.add(self._describe(node))
                new.append(known)
                new_refs.append(refs)
            elif refs > 1 and node.block_id in self.evictable:
                folded.append(known)  # a duplicate folded into this cached block
        self.on_inserted(new, new_refs, folded)

    def on_inserted(self, new: list[CachedBlock], ref_counts, folded: list[CachedBlock]) -> None:
        """``new`` blocks were cached; sequences' duplicates were folded into
        the cached ``folded`` ones."""
        for block, refs in zip(new, ref_counts):
            self.add(block)
            self.by_key[block.key] = block
            if refs == 1:  # traversed, not taken (LMDeploy's recompute overlap)
                self.evictable.add(block.block_id)
        self.touch(b.block_id for b in folded if b.block_id in self.evictable)
        self.report_cached(new)

    def on_freed(self, block_ids, ref_counts) -> None:
        self.release(b for b, refs in zip(block_ids.tolist(), ref_counts.tolist()) if refs == 1)

    def forget(self, block_id: int) -> CachedBlock | None:
        block = super().forget(block_id)
        self.nodes.pop(block_id, None)
        if block is not None and self.by_key.get(block.key) is block:
            del self.by_key[block.key]
        return block

    def cached_prefix(self, token_ids, adapter_name: str | None, num_blocks: int) -> PrefixMatch:
        """The cached blocks holding the first ``num_blocks`` full blocks of
        ``token_ids``, found by content key as :meth:`_describe` makes it."""
        key = chain_key(ROOT_KEY, adapter_name.encode()) if adapter_name else ROOT_KEY
        tokens = numpy.asarray(token_ids, dtype=numpy.int64)
        blocks = []
        for start in range(0, num_blocks * self.block_size, self.block_size):
            key = chain_key(key, tokens[start : start + self.block_size].tobytes())
            block = self.by_key.get(key)
            if block is None:
                break
            blocks.append(block)
        return PrefixMatch(tuple(blocks))


class SagellmPhysicalAllocator:
    """LMDeploy's physical GPU-block allocator, with sagellm's kv-pool plugin
    choosing the blocks (``sagellm_allocate_blocks`` / ``free_blocks``,
    checked by the runtime). Same interface: ``allocate``, ``free``,
    ``get_num_free_blocks``; ids start at LMDeploy's reserved-block offset."""

    def __init__(self, runtime: Runtime, offset: int):
        self.runtime = runtime
        self.offset = offset

    def allocate(self, num_blocks: int):
        if self.get_num_free_blocks() < num_blocks:
            raise MemoryError("No enough free memory blocks.")  # as LMDeploy's allocator says it
        return numpy.asarray(self.runtime.host.allocate_blocks(num_blocks, None), dtype=numpy.int64) + self.offset

    def free(self, blocks):
        blocks = numpy.asarray(blocks, dtype=numpy.int64)
        self.runtime.host.free_blocks((blocks - self.offset).tolist())
        return blocks

    def get_num_free_blocks(self) -> int:
        return self.runtime.pool_usage().num_free_blocks


class SagellmLogicalAllocator(LogicalAllocator):
    """LMDeploy's logical allocator over a :class:`SagellmPhysicalAllocator`,
    naming each block by the id sagellm's pool chose: logical block ``i`` is
    physical block ``i + offset``. LMDeploy's own keeps a second free list of
    logical ids, handed out in its own stack order; once the pool's choices
    differ from that order, the logical ids that sequences, the trie and the
    prefix-cache plugin report stop being the ids the pool counts (two of
    3,000 blocks after 300 Mooncake requests: a cached block the pool held
    free, a freed one it held in use). No CPU swap (``num_cpu_blocks = 0``):
    swapping remaps a logical block to another physical one."""

    def allocate(self, num_blocks: int, device: str = "gpu"):
        if device != "gpu":
            raise MemoryError("sagellm-plugin-lmdeploy: no CPU blocks with a sagellm kv-pool plugin")
        if num_blocks == 0:
            return numpy.empty((0,), dtype=numpy.int64)
        physical = self._gpu_allocator
        if self.get_num_free_blocks() < num_blocks or physical.get_num_free_blocks() < num_blocks:
            raise MemoryError("No enough free memory blocks.")  # as LMDeploy's allocator says it
        phy_blocks = physical.allocate(num_blocks)
        blocks = phy_blocks - physical.offset
        self._log_mem.phy_map.put(blocks, phy_blocks)
        self._log_mem.ref_count.put(blocks, 1)
        self.update_access_time(blocks)
        self._free_count -= num_blocks
        return blocks

    def free(self, blocks) -> None:
        self.add_ref_count(blocks, -1)
        self.update_access_time(blocks)
        freed = blocks[self.get_ref_count(blocks) == 0]
        if len(freed):
            self._free_count += len(freed)
            self._gpu_allocator.free(self.get_physical_blocks(freed))


class Unpinned:
    """The evictable blocks less the pinned ones: the candidates a policy
    may name (a live view; O(1) membership, O(pinned) size)."""

    def __init__(self, evictable: set[int], pinned: set[int]):
        self.evictable = evictable
        self.pinned = pinned

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.evictable and block_id not in self.pinned

    def __len__(self) -> int:
        return len(self.evictable) - sum(1 for b in self.pinned if b in self.evictable)

    def __iter__(self):
        return (b for b in self.evictable if b not in self.pinned)


class SagellmBlockTrie(BlockTrie):
    """``BlockTrie`` reporting to sagellm; sagellm's policy picks victims,
    and with a ``[prefix_cache] plugin`` that plugin decides the matches."""

    #: Set by :func:`sagellm_plugin_lmdeploy.install.installed` (a harness's
    #: runtime), else built from ``$SAGELLM_CONFIG`` for each trie.
    runtime: Runtime | None = None
    #: Whether LMDeploy's arrivals and finishes are observed
    #: (:mod:`sagellm_plugin_lmdeploy.lifecycle`); off for a harness that
    #: counts its own requests.
    observe_requests: bool = True

    def __init__(self, *, allocator, block_size: int, enabled: bool, checkpoint_state_manager=None, **kwargs):
        runtime = type(self).runtime
        if runtime is None:
            from sagellm_plugin_lmdeploy.live import load_runtime

            runtime = load_runtime(allocator._gpu_allocator.get_num_free_blocks(), block_size)
        #: The prefix-cache plugin deciding matches (None: LMDeploy's trie walk).
        self.matcher: PluginMatcher | None = None
        if "prefix_cache" not in runtime.engine_owns:
            if checkpoint_state_manager is not None:
                raise ConfigError(
                    f"sagellm-plugin-lmdeploy: {runtime.host.who('prefix_cache')} matches token blocks, and this model"
                    " reuses SSM state checkpoints, which only LMDeploy's trie matches: leave out"
                    " [prefix_cache] plugin"
                )
            if runtime.block_size != block_size:  # its pages would not be LMDeploy's blocks
                raise ConfigError(
                    f"sagellm-plugin-lmdeploy: [prefix_cache] block_size is {runtime.block_size} and LMDeploy's"
                    f" block size is {block_size}: {runtime.host.who('prefix_cache')} must page prompts"
                    " as LMDeploy does"
                )
            self.matcher = PluginMatcher(runtime, block_size)
        super().__init__(
            allocator=allocator,
            block_size=block_size,
            enabled=enabled,
            checkpoint_state_manager=checkpoint_state_manager,
            **kwargs,
        )
        self.sagellm = TrieObserver(runtime, block_size)
        if "kv_pool" not in runtime.engine_owns:
            # The config names a kv-pool plugin: it chooses LMDeploy's
            # physical GPU blocks (all free now: the trie is built with the
            # scheduler, before any allocation).
            gpu = allocator._gpu_allocator
            if gpu.get_num_free_blocks() != runtime.num_blocks:
                raise ConfigError(
                    f"sagellm-plugin-lmdeploy: the kv-pool has {runtime.num_blocks} blocks,"
                    f" LMDeploy's GPU pool {gpu.get_num_free_blocks()}"
                )
            if type(allocator) is not LogicalAllocator or allocator._cpu_allocator.get_num_free_blocks():
                raise ConfigError(
                    "sagellm-plugin-lmdeploy: a [kv_pool] plugin chooses LMDeploy's GPU blocks by id, which"
                    " LMDeploy's CPU swap (num_cpu_blocks > 0) remaps: set num_cpu_blocks = 0, or leave out"
                    " [kv_pool] plugin"
                )
            allocator._gpu_allocator = SagellmPhysicalAllocator(runtime, gpu._offset)
            allocator.__class__ = SagellmLogicalAllocator
        # Every free goes through the allocator LMDeploy shares between the
        # block manager and the trie: watch it for blocks left to the trie.
        self._allocator_free = allocator.free
        allocator.free = self._free
        allocator.sagellm_trie = self  # how the sequence lifecycle finds it

    def _free(self, blocks) -> None:
        blocks = numpy.asarray(blocks)
        self._allocator_free(blocks)
        if len(blocks):
            self.sagellm.on_freed(blocks, self.allocator.get_ref_count(blocks))

    def _refs(self, block_ids: list[int]) -> list[int]:
        if not block_ids:
            return []
        return self.allocator.get_ref_count(numpy.array(block_ids, dtype=numpy.int64)).tolist()

    def arrival_match(self, seq) -> PrefixMatch:
        """The cached prefix ``seq`` would reuse now, changing nothing."""
        if self.matcher is not None:
            return self.matcher.lookup(seq)
        # LMDeploy's lookup gives the matched length; the blocks are found
        # by content key.
        step = self._find_deepest_block_match_step(seq, self._get_or_create_root(seq.adapter_name))
        return self.sagellm.cached_prefix(seq.all_ids, seq.adapter_name, step // self.block_size)

    def _match_block_prefix(self, seq) -> None:
        if self.matcher is None:
            start = seq.prefix_cache.trie_cursor
            super()._match_block_prefix(seq)
            nodes = self.sagellm.path(seq.prefix_cache.trie_cursor, start)
            blocks = [self.sagellm.cached[n.block_id] for n in nodes if n.block_id in self.sagellm.cached]
            self.sagellm.on_matched(blocks, self._refs([b.block_id for b in blocks]))
            return
        # What LMDeploy's walk does with the blocks it matched, with the
        # plugin's blocks: the sequence takes a reference to each and starts
        # after them.
        start = seq.num_history_ids
        blocks = self.matcher.match(seq)
        ids = [b.block_id for b in blocks]
        if ids:
            array = numpy.array(ids, dtype=numpy.int64)
            self.allocator.update_access_time(array)
            self.allocator.add_ref_count(array, 1)
            seq.logical_blocks.append(array)
            seq.set_step(start + len(ids) * self.block_size)
        self._record_match_stats(seq, query_tokens=seq.num_all_ids - start, hit_tokens=len(ids) * self.block_size)
        self.sagellm.on_matched(blocks, self._refs(ids))

    def allocate(self, seq) -> None:
        if not self.enabled:
            return
        if self.matcher is None:
            start = seq.prefix_cache.trie_cursor
            super().allocate(seq)
            nodes = self.sagellm.path(seq.prefix_cache.trie_cursor, start)
            self.sagellm.on_trie_extended(nodes, self._refs([n.block_id for n in nodes]))
            return
        inserted = self.matcher.insert(seq)
        if inserted is None:
            return
        result, positions = inserted
        # As LMDeploy's trie: a new cached block takes one reference for the
        # cache; a duplicate of a cached page is swapped for the cached block
        # (the sequence's reference moves to it) and freed.
        refs = [b.block_id for b in result.adopted]
        for given, held in result.replaced:
            seq.logical_blocks[positions[given]] = held.block_id
            refs.append(held.block_id)
        if refs:
            self.allocator.add_ref_count(numpy.array(refs, dtype=numpy.int64), 1)
        if result.replaced:
            self.allocator.free(numpy.array([given for given, _ in result.replaced], dtype=numpy.int64))
        self.sagellm.on_inserted(
            list(result.adopted),
            self._refs([b.block_id for b in result.adopted]),
            [held for _, held in result.replaced],
        )

    def evict(self, max_num_blocks: int) -> int:
        if not self.enabled:
            return 0
        evicted = self._state_checkpoints.evict_frozen_checkpoints(max_num_blocks)
        observer = self.sagellm
        pinned = set(observer.runtime.pinned_blocks()) if self.matcher is not None else set()
        removed: list[CachedBlock] = []
        while evicted + len(removed) < max_num_blocks:
            # The plain set while nothing is pinned: the policy probes it often.
            candidates = Unpinned(observer.evictable, pinned) if pinned else observer.evictable
            if not len(candidates):
                break
            victims = observer.select_victims(max_num_blocks - evicted - len(removed), candidates)
            if not victims:
                break  # the policy keeps the rest; the caller makes do with fewer
            gone = (
                self._remove_from_plugin(victims)
                if self.matcher is not None
                else self._remove_from_trie(victims, pinned)
            )
            if not gone:
                break  # every victim is pinned by an SSM checkpoint copy
            removed.extend(gone)
        if removed:
            self._allocator_free(numpy.array([b.block_id for b in removed]))
            observer.flush_evicted()
        return evicted + len(removed)

    def _remove_from_plugin(self, victims) -> list[CachedBlock]:
        gone = self.sagellm.runtime.host.remove_cached(victims)
        held = [b.block_id for b, refs in zip(gone, self._refs([b.block_id for b in gone])) if refs != 1]
        if held:
            # Checked before any is freed: LMDeploy's sequences would read freed KV.
            raise PluginError(
                f"{self.sagellm.runtime.host.who('prefix_cache')} removed blocks that sequences hold: {held[:8]}"
            )
        return [self.sagellm.evict(b.block_id) for b in gone]

    def _remove_from_trie(self, victims, pinned: set[int]) -> list[CachedBlock]:
        """Detach each victim's subtree from LMDeploy's trie (its cached
        descendants go with it: no lookup reaches them once it is gone)."""
        observer, leaves = self.sagellm, self._kv_lifecycle.leaves
        nodes = observer.nodes

        def children(block_id: int) -> list[int]:  # in the trie's order
            return [child.block_id for child in nodes[block_id].children.values()]

        removed: list[CachedBlock] = []
        for victim in victims:
            if victim not in observer.evictable:
                continue  # went with an ancestor chosen before it
            node = nodes[victim]
            subtree = [nodes[b] for b in reversed(observer.subtree(victim, children))]  # leaves first
            if any(self._state_checkpoints.is_pinned(n) for n in subtree):
                pinned.add(victim)  # an SSM checkpoint copy is reading it: not now
                continue
            parent = node.parent
            for gone in subtree:
                self._state_checkpoints.release_checkpoint(gone)
                gone.detach_leaf()
                leaves.discard(gone)
                removed.append(observer.evict(gone.block_id))
            if parent is not None and parent.parent is not None and not parent.children:
                leaves.add(parent)
        return removed
