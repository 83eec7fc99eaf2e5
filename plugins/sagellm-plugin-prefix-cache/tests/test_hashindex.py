"""The block-hash index against the radix tree: the same calls give the same
answers, block for block, and its reference counts follow the requests."""

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from prefix_cache_strategies import SERVE, drawn_request, req
from sagellm_plugin_prefix_cache.hashindex import HashPrefixCache, HashSettings, block_hashes, none_hash, sha256
from sagellm_plugin_prefix_cache.radix import RadixPrefixCache, RadixSettings

from sagellm_core import PluginContext
from sagellm_core.kit.testing import BlockIds

BS = 4


def test_hashes_are_vllms_chain(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    NONE_HASH = sha256("vllm-none-hash")
    assert none_hash() == NONE_HASH
    monkeypatch.setenv("PYTHONHASHSEED", "7")  # vLLM takes its seed from it when set
    assert none_hash() == sha256("7")
    monkeypatch.delenv("PYTHONHASHSEED")
    tokens = list(range(10))
    first, second = block_hashes(tokens, BS)
    assert first == sha256((NONE_HASH, (0, 1, 2, 3), None))
    assert second == sha256((first, (4, 5, 6, 7), None))
    salted = block_hashes(tokens, BS, (("cache_salt", "s"),))
    assert salted[0] == sha256((NONE_HASH, (0, 1, 2, 3), (("cache_salt", "s"),)))
    assert salted[1] == sha256((salted[0], (4, 5, 6, 7), None))  # the salt keys the first block only


def test_descendants_go_with_an_evicted_block():
    cache = HashPrefixCache(HashSettings(), PluginContext("hash", BS, 100))
    r = req("a", list(range(13)))
    cache.sagellm_acquire_prefix(request=r)
    cache.sagellm_insert_prefix(request=r, token_ids=r.prompt_token_ids[:12], block_ids=[5, 6, 7])
    assert [b.block_id for b in cache.sagellm_release_prefix(request=r)] == [5, 6, 7]
    assert {b.block_id for b in cache.sagellm_remove_blocks(block_ids=[6])} == {6, 7}
    assert cache.sagellm_lookup_prefix(request=req("b", list(range(13)))).block_ids == (5,)
    with pytest.raises(ValueError, match="not an evictable cached block"):
        cache.sagellm_remove_blocks(block_ids=[7])


class SideBySide(RuleBasedStateMachine):
    """Random serve / release / evict, the same calls to both indexes."""

    def __init__(self):
        super().__init__()
        ctx = PluginContext("p", BS, 1000)
        self.radix = RadixPrefixCache(RadixSettings(isolate="tenant"), ctx)
        self.hash = HashPrefixCache(HashSettings(isolate="tenant"), ctx)
        self.blocks = BlockIds()
        self.holding: dict[str, set[int]] = {}
        self.serial = 0

    def both(self, hook, **kwargs):
        a = getattr(self.radix, hook)(**kwargs)
        b = getattr(self.hash, hook)(**kwargs)
        return a, b

    @rule(**SERVE)
    def serve(self, **draw):
        self.serial += 1
        r = drawn_request(self.serial, **draw)
        if r is None:
            return
        looked = self.both("sagellm_lookup_prefix", request=r)
        assert looked[0].block_ids == looked[1].block_ids
        m_radix, m_hash = self.both("sagellm_acquire_prefix", request=r)
        assert m_radix.block_ids == m_hash.block_ids
        assert [b.depth for b in m_radix.blocks] == [b.depth for b in m_hash.blocks]
        assert [b.parent_id for b in m_radix.blocks] == [b.parent_id for b in m_hash.blocks]
        n_full = r.num_prompt_tokens // BS
        ids = list(m_radix.block_ids) + self.blocks.take(n_full - m_radix.num_blocks)
        i_radix, i_hash = self.both(
            "sagellm_insert_prefix", request=r, token_ids=r.prompt_token_ids[: n_full * BS], block_ids=ids
        )
        for field in ("adopted", "locked"):
            assert [b.block_id for b in getattr(i_radix, field)] == [b.block_id for b in getattr(i_hash, field)]
        assert [(g, b.block_id) for g, b in i_radix.replaced] == [(g, b.block_id) for g, b in i_hash.replaced]
        for given, cached in i_radix.replaced:
            ids[ids.index(given)] = cached.block_id
        self.holding[r.request_id] = set(ids)
        # Block keys: the whole chain names the path just cached, block for
        # block; asked from any start (the runtime asks from the end of the
        # match), the same keys.
        for cache in (self.radix, self.hash):
            probe = req(f"probe-{r.request_id}", list(r.prompt_token_ids) + [-1], r.tenant, r.cache_salt)
            path = cache.sagellm_lookup_prefix(request=probe)
            chain = cache.sagellm_block_keys(request=r, start=0, num_blocks=n_full)
            assert chain == tuple(b.key for b in path.blocks) and len(chain) == n_full
            for start in {m_radix.num_blocks, n_full // 2, n_full}:
                assert cache.sagellm_block_keys(request=r, start=start, num_blocks=n_full) == chain[start:]

    @precondition(lambda self: self.holding)
    @rule(index=st.integers(0, 50))
    def release(self, index):
        rid = sorted(self.holding)[index % len(self.holding)]
        del self.holding[rid]
        f_radix, f_hash = self.both("sagellm_release_prefix", request=req(rid, [0]))
        assert [b.block_id for b in f_radix] == [b.block_id for b in f_hash]

    @rule(count=st.integers(1, 4), data=st.data())
    def evict(self, count, data):
        evictable = sorted(self.radix.sagellm_evictable_blocks())
        if not evictable:
            return
        victims = data.draw(st.lists(st.sampled_from(evictable), min_size=1, max_size=count, unique=True))
        r_radix, r_hash = self.both("sagellm_remove_blocks", block_ids=victims)
        assert sorted(b.block_id for b in r_radix) == sorted(b.block_id for b in r_hash)

    @invariant()
    def same_evictable_blocks_and_refcounts_equal_holders(self):
        assert set(self.radix.sagellm_evictable_blocks()) == set(self.hash.sagellm_evictable_blocks())
        assert len(self.hash.sagellm_evictable_blocks()) == len(set(self.hash.sagellm_evictable_blocks()))
        holders = Counter(b for held in self.holding.values() for b in held)
        for block_id in self.hash._hash_of:
            assert self.hash.refcount(block_id) == holders[block_id]
        assert len(self.hash) == len(self.radix)


SideBySide.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSideBySide = SideBySide.TestCase
