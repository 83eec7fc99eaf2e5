"""First-party plugins made to break their contract, one way each."""

import attrs
from sagellm_plugin_eviction.lru import LRUEviction
from sagellm_plugin_kv_pool.paged import PagedPool
from sagellm_plugin_lifetime.stat import StatLifetime
from sagellm_plugin_prefix_cache.radix import RadixPrefixCache

from sagellm_core import hookimpl
from sagellm_core.kit.testing import OldestFirstPreemption
from sagellm_core.types import BlockAllocation, EvictionDecision, LifetimePrediction, PrefixMatch


class GreedyVictims(LRUEviction):
    """Returns more victims than asked for."""

    @hookimpl
    def sagellm_select_victims(self, num_blocks, candidates):
        return EvictionDecision(tuple(candidates)[: num_blocks + 1])


class NotADecision(LRUEviction):
    @hookimpl
    def sagellm_select_victims(self, num_blocks, candidates):
        return [1, 2, 3]


class GenerousPool(PagedPool):
    """Hands out one block more than asked."""

    @hookimpl
    def sagellm_allocate_blocks(self, num_blocks, request):
        alloc = super().sagellm_allocate_blocks(num_blocks + 1, request)
        return alloc if alloc.block_ids else super().sagellm_allocate_blocks(num_blocks, request)


class MiscountingPool(PagedPool):
    """Answers ``sagellm_reserved_blocks`` with :attr:`answer` (set by the test)."""

    answer: object = -1

    @hookimpl
    def sagellm_reserved_blocks(self, num_blocks, request):
        return MiscountingPool.answer


class ReusingPool(PagedPool):
    """Hands out the same blocks again: blocks that are in use."""

    def __init__(self, settings, context):
        super().__init__(settings, context)
        self.first = None

    @hookimpl
    def sagellm_allocate_blocks(self, num_blocks, request):
        if self.first is None:
            self.first = super().sagellm_allocate_blocks(num_blocks, request)
            return self.first
        return BlockAllocation(self.first.block_ids[:num_blocks])


class OverMatching(RadixPrefixCache):
    """Claims the whole prompt is cached, blocks that are not."""

    @hookimpl
    def sagellm_acquire_prefix(self, request):
        super().sagellm_acquire_prefix(request)
        n = request.num_prompt_tokens // self.block_size
        from sagellm_core.types import CachedBlock

        return PrefixMatch(tuple(CachedBlock(900 + i, i, None) for i in range(n)))


class AdoptingStrangers(RadixPrefixCache):
    """Says it cached a block it was not given."""

    @hookimpl
    def sagellm_insert_prefix(self, request, token_ids, block_ids):
        result = super().sagellm_insert_prefix(request, token_ids, block_ids)
        from sagellm_core.types import CachedBlock

        return attrs.evolve(result, adopted=(*result.adopted, CachedBlock(777, 0, None)))


class CrashingLifetime(StatLifetime):
    @hookimpl
    def sagellm_predict_lifetime(self, request):
        raise ZeroDivisionError("no data")


class MultiLineCrash(StatLifetime):
    @hookimpl
    def sagellm_predict_lifetime(self, request):
        raise RuntimeError("first line\n  second line\n\tthird")


class NegativeLifetime(StatLifetime):
    @hookimpl
    def sagellm_predict_lifetime(self, request):
        return LifetimePrediction(-5.0, 0, 0, 1.0)


class DroppingPass:
    """Drops the last waiting request instead of reordering."""

    def __init__(self, settings, context):
        pass

    @hookimpl
    def sagellm_schedule_pass(self, ir):
        if ir.waiting:
            ir.waiting.pop()


class StallingPass:
    """Caps every running request's chunk at 0 tokens: it would hold its
    blocks and never finish."""

    def __init__(self, settings, context):
        pass

    @hookimpl
    def sagellm_schedule_pass(self, ir):
        for state in ir.running:
            ir.chunk_limits[state.request_id] = 0


class GarbageLifetime(StatLifetime):
    """Answers every other request with something that is not a prediction."""

    def __init__(self, settings, context):
        super().__init__(settings, context)
        self.calls = 0

    @hookimpl
    def sagellm_predict_lifetime(self, request):
        self.calls += 1
        if self.calls % 2:
            return "about 300 tokens"
        return super().sagellm_predict_lifetime(request)


class UnfilteredVictims(OldestFirstPreemption):
    """Keeps the LRU order of the blocks it was told are evictable (the
    observations of :class:`~sagellm_core.kit.testing.OldestFirstPreemption`)
    and names victims from it without filtering by ``candidates``, as the
    plugin template did: correct as long as the runtime tells it every
    change."""

    @hookimpl
    def sagellm_select_victims(self, num_blocks, candidates):
        return EvictionDecision(tuple(self._queue)[:num_blocks])  # the base's LRU order, unfiltered
