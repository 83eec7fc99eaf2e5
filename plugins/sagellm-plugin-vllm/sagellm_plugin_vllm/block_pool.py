"""vLLM's block pool with sagellm choosing the victims.

vLLM keeps every free block in one queue, ``FreeKVCacheBlockQueue``: blocks
without a hash at the head (reused first), cached ones behind them in LRU
order, and it evicts whatever the head is. Here the queue stays (its O(1)
``remove``/``append_n``/``prepend_n``), uncached blocks are still reused
first, but when a cached block must go the sagellm eviction policy names it.

The policy keeps its own order from the observation hooks; the pool subclass
reports them: ``cache_full_blocks`` -> ``blocks_cached``, ``touch`` ->
``blocks_touched``, ``free_blocks`` (last reference gone) ->
``blocks_released``, and an eviction -> ``blocks_evicted``. Blocks are
described as the radix prefix cache describes them (:class:`CachedBlock`:
depth, parent, a chained content key, the ``cache_salt`` as namespace), so a
policy behaves the same in vLLM as in ``sagellm replay``. The key is vLLM's
own block hash (64 bits of it): equal keys mean equal prefixes, as with
sagellm's BLAKE2b keys, but the two are not the same numbers, so the Belady
oracle, which computes sagellm keys from the workload, does not run inside
vLLM.

As in sagellm's runtime, evicting a block also evicts its free cached
descendants, which no lookup can reach once it is gone (vLLM would leave them
to age out). And as in the radix cache, a block is cached once: vLLM caches a
second copy when a request recomputes a block that is already cached (a
block-aligned prompt whose last block must be computed again); here the copy
stays private to its request (uncached, and reused first once freed) and the
request holds the cached original instead, until it frees its blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sagellm_core.drivers.blocks import BlockObserver
from sagellm_core.errors import PluginError
from sagellm_core.runtime import Runtime
from sagellm_core.types import CachedBlock
from sagellm_plugin_vllm.compat import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, VllmRequest


class PoolObserver(BlockObserver):
    """What sagellm knows of vLLM's cached blocks (the shared
    :class:`BlockObserver`: one :class:`CachedBlock` per hashed block, the
    links between them, the evictable set: hashed, no reference), and the
    private copies of cached blocks that requests recomputed."""

    def __init__(self, runtime: Runtime):
        super().__init__(runtime)
        #: duplicate block id -> the cached original its request holds instead
        self.original_of: dict[int, int] = {}

    def on_cached(self, request: VllmRequest, blocks: Sequence[KVCacheBlock], start: int, stop: int) -> None:
        namespace = request.cache_salt or ""
        cached, original_of = self.cached, self.original_of
        new: list[CachedBlock] = []
        for depth in range(start, stop):
            block = blocks[depth]
            if (
                block.is_null
                or block.block_hash is None
                or block.block_id in cached
                or block.block_id in original_of  # a private copy
            ):
                continue
            if depth:
                before = blocks[depth - 1].block_id
                parent = cached.get(original_of.get(before, before))  # a copy stands for its original
            else:
                parent = None
            if depth and parent is None:
                continue  # its parent was never reported (cached before sagellm attached)
            new.append(
                self.add(
                    CachedBlock(
                        block.block_id,
                        depth,
                        parent.block_id if parent else None,
                        # vLLM's chained hash (tokens, parent, cache_salt, LoRA) is the
                        # content key; its first 8 bytes as sagellm's 64-bit key.
                        int.from_bytes(block.block_hash[:8], "little"),
                        namespace,
                    )
                )
            )
        if new:
            self.report_cached(new)

    def on_freed(self, ordered_blocks: Sequence[KVCacheBlock]) -> None:
        # vLLM frees a request's blocks tail first; sagellm reports a chain
        # root first, as the radix cache releases it.
        freed = [b.block_id for b in ordered_blocks if b.ref_cnt == 0]
        freed.reverse()
        self.release(freed)

    def choose_victims(self, num_blocks: int) -> list[int]:
        """Up to ``num_blocks`` victims from the policy (checked by the
        runtime), each followed by its free cached descendants."""
        victims = self.select_victims(num_blocks)
        if not victims:
            raise PluginError(
                f"{self.runtime.who('eviction')} sagellm_select_victims chose no victim among"
                f" {len(self.evictable)} evictable blocks while vLLM needs {num_blocks}"
            )
        return self.with_descendants(victims)


class SagellmFreeBlockQueue(FreeKVCacheBlockQueue):
    """``FreeKVCacheBlockQueue`` whose cached victims sagellm picks."""

    def __init__(self, blocks: list[KVCacheBlock], pool: SagellmBlockPool):
        super().__init__(blocks)
        self.pool = pool

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        assert self.num_free_blocks >= n
        observer = self.pool.sagellm
        evictable = observer.evictable
        out: list[KVCacheBlock] = []
        try:
            while len(out) < n:
                head = self.fake_free_list_head.next_free_block
                if head.block_id not in evictable or not evictable:
                    out.extend(super().popleft_n(1))  # uncached: reused first, as in vLLM
                    continue
                blocks = self.pool.blocks
                for block_id in observer.choose_victims(n - len(out)):
                    block = blocks[block_id]
                    self.remove(block)
                    if len(out) < n:
                        out.append(block)
                    else:
                        # A descendant beyond the need: evicted now, kept free.
                        self.pool._maybe_evict_cached_block(block)
                        self.prepend_n([block])
        except BaseException:
            self.prepend_n(out)  # a policy failed: every block taken goes back
            raise
        return out

    def popleft(self) -> KVCacheBlock:
        return self.popleft_n(1)[0]


class SagellmBlockPool(BlockPool):
    """vLLM's ``BlockPool``, reporting to sagellm and letting it choose
    victims. Built directly (the runtime from ``sagellm_runtime`` or
    ``$SAGELLM_CONFIG``), or made from a pool vLLM built (:func:`attach`)."""

    sagellm: PoolObserver

    def __init__(self, *args, sagellm_runtime: Runtime | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if sagellm_runtime is None:
            from sagellm_plugin_vllm.live import load_runtime

            sagellm_runtime = load_runtime(self.num_gpu_blocks - 1, self.hash_block_size)
        self._adopt(sagellm_runtime)

    def _adopt(self, runtime: Runtime) -> None:
        free = self.free_block_queue.get_all_free_blocks()
        if len(free) != self.num_gpu_blocks - 1:
            raise PluginError("sagellm-plugin-vllm: attach before the first allocation (blocks are in use)")
        self.sagellm = PoolObserver(runtime)
        for block in free:
            block.prev_free_block = block.next_free_block = None
        self.free_block_queue = SagellmFreeBlockQueue(free, self)

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs):
        super().cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)
        if not self.enable_caching:
            return
        get_one_block = self.cached_block_hash_to_block.get_one_block
        for block in blocks[num_cached_blocks:num_full_blocks]:
            if block.is_null or block.block_hash is None:
                continue
            original = get_one_block(block.block_hash)
            if original is not None and original is not block and original.block_id in self.sagellm.cached:
                # A recomputed copy of a cached block: sagellm does not cache
                # it, and the request holds the original (as the radix
                # cache's insert does). vLLM keeps the copy's hash while the
                # request runs (lookups find the original first).
                self.sagellm.original_of[block.block_id] = original.block_id
                self.touch([original])
        self.sagellm.on_cached(request, blocks, num_cached_blocks, num_full_blocks)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        super().touch(blocks)
        self.sagellm.touch([b.block_id for b in blocks])

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        ordered = list(ordered_blocks)
        original_of = self.sagellm.original_of
        if original_of:
            # A private copy goes back uncached (reused first); the cached
            # original it stood for is released in its place in the chain.
            with_originals = []
            for block in ordered:
                with_originals.append(block)
                original_id = original_of.pop(block.block_id, None)
                if original_id is not None:
                    self._remove_cached_block_hashes(block)  # so it is reused first
                    with_originals.append(self.blocks[original_id])
            ordered = with_originals
        super().free_blocks(ordered)
        self.sagellm.on_freed(ordered)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        blocks = super().get_new_blocks(num_blocks)
        self.sagellm.flush_evicted()
        return blocks

    def evict_blocks(self, block_ids: set[int]) -> None:
        super().evict_blocks(block_ids)
        self.sagellm.flush_evicted()

    def reset_prefix_cache(self) -> bool:
        reset = super().reset_prefix_cache()
        if reset:  # every hash is gone: every cached block is evicted
            for block_id in list(self.sagellm.cached):
                self.sagellm.evict(block_id)
            self.sagellm.flush_evicted()
        return reset

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        evicted = super()._maybe_evict_cached_block(block)
        if evicted:
            self.sagellm.evict(block.block_id)
        return evicted


def attach(pool: BlockPool, runtime: Runtime) -> SagellmBlockPool:
    """Make the scheduler's freshly built pool a :class:`SagellmBlockPool`
    reporting to ``runtime``. Only before the first allocation."""
    if not isinstance(pool, SagellmBlockPool):
        if type(pool) is not BlockPool:
            raise PluginError(
                f"sagellm-plugin-vllm: cannot attach to a {type(pool).__name__}, only to vLLM's BlockPool"
            )
        pool.__class__ = SagellmBlockPool
    pool._adopt(runtime)
    return pool
