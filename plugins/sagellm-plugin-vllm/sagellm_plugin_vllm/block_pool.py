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
sagellm's chained SHA-256 keys, but the two are not the same numbers, so the Belady
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

from collections import deque
from collections.abc import Iterable, Sequence
from functools import partial
from itertools import repeat, takewhile
from operator import attrgetter, is_not

from sagellm_core.drivers.blocks import BlockObserver
from sagellm_core.errors import PluginError
from sagellm_core.runtime import Runtime
from sagellm_core.types import EMPTY_MATCH, CachedBlock, PrefixMatch
from sagellm_plugin_vllm.compat import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, VllmRequest

_is_block = partial(is_not, None)
_parent_id = attrgetter("parent_id")
#: Runs an iterator of C calls to its end, keeping nothing.
_consume = partial(deque, maxlen=0)


class PoolObserver(BlockObserver):
    """What sagellm knows of vLLM's cached blocks (the shared
    :class:`BlockObserver`: one :class:`CachedBlock` per hashed block, the
    links between them, the evictable set: hashed, no reference), and the
    private copies of cached blocks that requests recomputed."""

    def __init__(self, runtime: Runtime):
        super().__init__(runtime)
        #: duplicate block id -> the cached original its request holds instead
        self.original_of: dict[int, int] = {}
        #: vLLM's block hash (as ``Request.block_hashes`` holds it, without
        #: the group id) -> the cached block: a request's match is a walk
        #: down its own hashes, no second ``get_computed_blocks``.
        self.by_hash: dict[bytes, CachedBlock] = {}
        self._hash_of: dict[int, bytes] = {}
        #: Cached blocks whose parent was forgotten before them (vLLM
        #: evicting one block of a chain itself): while there are any,
        #: chains have gaps (``gapped``). A block is cached only under a
        #: cached parent, so these are the only ones.
        self._orphans: set[int] = set()

    @property
    def gapped(self) -> bool:
        return bool(self._orphans)

    def match(self, block_hashes: Sequence[bytes], max_blocks: int) -> PrefixMatch:
        """The cached prefix of a request whose block hashes are
        ``block_hashes``, at most ``max_blocks`` long: what vLLM's
        ``find_longest_cache_hit`` finds, as sagellm records those blocks."""
        found = self._search(block_hashes, max_blocks)
        if not found:
            return EMPTY_MATCH
        by_hash = self.by_hash
        try:
            return PrefixMatch(tuple(map(by_hash.__getitem__, block_hashes[:found])))
        except KeyError:  # a gap before the block the search found
            return PrefixMatch(tuple(takewhile(_is_block, map(by_hash.get, block_hashes[:found]))))

    def match_length(self, block_hashes: Sequence[bytes], max_blocks: int) -> int:
        """How many blocks :meth:`match` would give, without collecting
        them: for a runtime whose plugins do not observe arrivals (a hundred
        blocks cost a few µs to collect, twice vLLM's whole add_request)."""
        found = self._search(block_hashes, max_blocks)
        return self.match(block_hashes, found).num_blocks if found and self.gapped else found

    def _search(self, block_hashes: Sequence[bytes], max_blocks: int) -> int:
        # The cached set is prefix-closed (evicting a block evicts its
        # descendants), so a binary search finds the hit's length in a few
        # probes. Only vLLM evicting one block of a chain itself (a KV
        # connector's evict_blocks) leaves a gap (``gapped``): then the
        # search may overshoot into it, and a walk must stop at it.
        by_hash = self.by_hash
        low, high = 0, min(max_blocks, len(block_hashes))  # block_hashes[:low] cached (so far)
        while low < high:
            middle = (low + high + 1) // 2
            if block_hashes[middle - 1] in by_hash:
                low = middle
            else:
                high = middle - 1
        return low

    def forget(self, block_id: int) -> CachedBlock | None:
        children = self.children.get(block_id)
        if children:
            self._orphans.update(children)  # they stay: their chains have a gap now
        self._orphans.discard(block_id)
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            self.by_hash.pop(block_hash, None)
        return super().forget(block_id)

    def on_cached(self, request: VllmRequest, blocks: Sequence[KVCacheBlock], start: int, stop: int) -> None:
        namespace = request.cache_salt or ""
        cached, original_of = self.cached, self.original_of
        by_hash, hash_of = self.by_hash, self._hash_of
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
            block_hash = block.block_hash
            described = self.add(
                CachedBlock(
                    block.block_id,
                    depth,
                    parent.block_id if parent else None,
                    # vLLM's chained hash (tokens, parent, cache_salt, LoRA) is the
                    # content key; its first 8 bytes as sagellm's 64-bit key.
                    int.from_bytes(block_hash[:8], "little"),
                    namespace,
                )
            )
            new.append(described)
            request_hash = block_hash[:-4]  # without the group id (one KV-cache group)
            if request_hash not in by_hash:
                by_hash[request_hash] = described
                hash_of[block.block_id] = request_hash
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
                f"{self.runtime.host.who('eviction')} sagellm_select_victims chose no victim among"
                f" {len(self.evictable)} evictable blocks while vLLM needs {num_blocks}"
            )
        return self.with_descendants(victims)

    def with_descendants(self, victims: Sequence[int]) -> list[int]:
        """As :meth:`BlockObserver.with_descendants` (the runtime checked
        that the victims are distinct evictable blocks), with a shortcut,
        in C-speed calls, for what the policies mostly hand out: leaves, or
        whole chains, every cached descendant of a victim a victim itself.
        Then the victims are the answer as they are (in their order: every
        block handed out is evicted, so the order only says which vLLM
        takes first)."""
        child_sets = list(filter(None, map(self.children.get, victims)))
        if not child_sets:
            return list(victims)  # leaves only
        # Each victim's children are all victims exactly when the children
        # counted under the victims are as many as the victims whose parent
        # is a victim (every such victim is one of those children).
        chosen = set(victims)
        parents = map(_parent_id, map(self.cached.__getitem__, victims))
        if sum(map(len, child_sets)) == sum(map(chosen.__contains__, parents)):
            return list(victims)
        return super().with_descendants(victims)

    def evict_all(self, block_ids: Sequence[int]) -> None:
        """vLLM evicted these cached blocks (leaves, or whole chains): all
        forgotten at once, in C-speed calls rather than a Python step per
        block (as :meth:`forget` does one), reported by the next
        :meth:`flush_evicted`."""
        children = self.children
        removed = list(map(self.cached.pop, block_ids))
        self.evictable.difference_update(block_ids)
        if self._orphans:  # (victims come with their descendants: no new orphan)
            self._orphans.difference_update(block_ids)
        _consume(map(children.pop, block_ids, repeat(None)))
        _consume(map(self.by_hash.pop, map(self._hash_of.pop, block_ids, repeat(None)), repeat(None)))
        # The parents still cached (a chain's root's parent) lose children.
        parents = set(map(_parent_id, removed))
        parents.difference_update(block_ids)
        for parent_id in parents:
            siblings = children.get(parent_id)
            if siblings:
                siblings.difference_update(block_ids)
        self._evicted.extend(removed)


class SagellmFreeBlockQueue(FreeKVCacheBlockQueue):
    """``FreeKVCacheBlockQueue`` whose cached victims sagellm picks."""

    def __init__(self, blocks: list[KVCacheBlock], pool: SagellmBlockPool):
        super().__init__(blocks)
        self.pool = pool

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The ``n`` blocks vLLM takes: uncached ones from the head first, as
        vLLM reuses them, then the policy's victims, a whole batch of them
        (chains included) per policy call. The victims taken are forgotten
        by the observer in one pass; vLLM drops their hashes as it hands
        them out (``get_new_blocks``)."""
        assert self.num_free_blocks >= n
        pool = self.pool
        observer = pool.sagellm
        evictable = observer.evictable
        head_sentinel = self.fake_free_list_head
        out: list[KVCacheBlock] = []
        taken_victims: list[int] = []
        try:
            while len(out) < n:
                need = n - len(out)
                # The uncached run at the head, up to the need: one pop.
                uncached = 0
                block = head_sentinel.next_free_block
                while uncached < need and (block.block_id not in evictable):
                    uncached += 1
                    block = block.next_free_block
                if uncached:
                    out.extend(super().popleft_n(uncached))
                    continue
                ids = observer.choose_victims(need)
                chosen = [pool.blocks[block_id] for block_id in ids]
                for block in chosen:  # FreeKVCacheBlockQueue.remove, without a call per block
                    before, after = block.prev_free_block, block.next_free_block
                    before.next_free_block, after.prev_free_block = after, before
                    block.prev_free_block = block.next_free_block = None
                self.num_free_blocks -= len(chosen)
                out.extend(chosen[:need])
                taken_victims.extend(ids[:need])
                beyond = chosen[need:]
                if beyond:
                    # Descendants beyond the need: evicted now, kept free
                    # (uncached, so reused first).
                    for block in beyond:
                        BlockPool._maybe_evict_cached_block(pool, block)
                    observer.evict_all(ids[need:])
                    self.prepend_n(beyond)
        except BaseException:
            self.prepend_n(out)  # a policy failed: every block taken goes back, still cached
            raise
        if taken_victims:
            observer.evict_all(taken_victims)
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
        #: vLLM's own eviction of one block, for get_new_blocks.
        self._drop_hash = partial(BlockPool._maybe_evict_cached_block, self)
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
        # The queue's popleft_n told the observer of every victim at once:
        # vLLM's per-block eviction runs here without this class's per-block
        # hook (an instance attribute shadows the method for this call).
        self._maybe_evict_cached_block = self._drop_hash
        try:
            blocks = super().get_new_blocks(num_blocks)
        finally:
            del self._maybe_evict_cached_block
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
