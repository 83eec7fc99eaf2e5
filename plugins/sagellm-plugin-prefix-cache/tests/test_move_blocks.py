"""``sagellm_move_blocks``: a compacting pool moved evictable cached blocks;
both caches relabel them, and match, evict and chain as before."""

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from prefix_cache_strategies import req
from sagellm_plugin_prefix_cache.hashindex import HashPrefixCache, HashSettings
from sagellm_plugin_prefix_cache.radix import RadixPrefixCache, RadixSettings

from sagellm_core import PluginContext
from sagellm_core.kit.testing import BlockIds

BS = 4
CACHES = {"radix": (RadixPrefixCache, RadixSettings), "hash": (HashPrefixCache, HashSettings)}


def make(kind):
    cls, settings_cls = CACHES[kind]
    return cls(settings_cls(), PluginContext(kind, block_size=BS, num_blocks=1000))


def serve(cache, blocks, rid, tokens, release=True):
    r = req(rid, tokens)
    match = cache.sagellm_acquire_prefix(request=r)
    n_full = len(tokens) // BS
    ids = list(match.block_ids) + blocks.take(n_full - match.num_blocks)
    cache.sagellm_insert_prefix(request=r, token_ids=r.prompt_token_ids[: n_full * BS], block_ids=ids)
    if release:
        cache.sagellm_release_prefix(request=r)
    return r


def records(cache):
    found = cache._info.values() if isinstance(cache, RadixPrefixCache) else cache._by_hash.values()
    return {b.block_id: b for b in found}


@pytest.mark.parametrize("kind", CACHES)
def test_moved_blocks_match_under_their_new_ids_and_their_children_follow(kind):
    cache, blocks = make(kind), BlockIds()
    serve(cache, blocks, "a", list(range(16)))  # blocks 0-3
    serve(cache, blocks, "b", [*range(8), *range(100, 108)])  # shares 0-1, then 4-5
    before = {b.key: b for b in records(cache).values()}
    changed = cache.sagellm_move_blocks(moves=((1, 50), (2, 60)))
    after = records(cache)
    assert {b.block_id for b in changed} == {50, 60, 3, 4}  # moved, and the children of moved blocks
    assert set(after) == {0, 50, 60, 3, 4, 5}
    for block in after.values():  # the same content at the same depth, chained through the new ids
        old = before[block.key]
        assert block.depth == old.depth and block.parent_id == {1: 50, 2: 60}.get(old.parent_id, old.parent_id)
    assert cache.sagellm_lookup_prefix(request=req("c", list(range(17)))).block_ids == (0, 50, 60, 3)
    assert cache.sagellm_lookup_prefix(request=req("d", [*range(8), *range(100, 109)])).block_ids == (0, 50, 4, 5)
    assert set(cache.sagellm_evictable_blocks()) == set(after)
    removed = cache.sagellm_remove_blocks(block_ids=(50,))  # its descendants go with it, as before
    assert {b.block_id for b in removed} == {50, 60, 3, 4, 5}


@pytest.mark.parametrize("kind", CACHES)
def test_a_held_block_or_a_taken_destination_is_refused(kind):
    cache, blocks = make(kind), BlockIds()
    serve(cache, blocks, "a", list(range(8)))  # 0-1, evictable
    serve(cache, blocks, "b", list(range(100, 108)), release=False)  # 2-3, held
    for moves in (((2, 50),), ((0, 3),)):
        with pytest.raises(ValueError, match="not an evictable cached block"):
            cache.sagellm_move_blocks(moves=moves)


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=24), min_size=1, max_size=8), data=st.data())
def test_radix_and_hash_relabel_alike(prompts, data):
    caches = [make("radix"), make("hash")]
    for cache in caches:
        blocks = BlockIds()
        for i, prompt in enumerate(prompts):
            serve(cache, blocks, f"r{i}", prompt)
    ids = sorted(records(caches[0]))
    assert ids == sorted(records(caches[1]))
    moved = data.draw(st.lists(st.sampled_from(ids), unique=True)) if ids else []
    moves = tuple(zip(moved, range(500, 500 + len(moved))))
    answers = [sorted(c.sagellm_move_blocks(moves=moves), key=lambda b: b.block_id) for c in caches]
    shape = [[(b.block_id, b.depth, b.parent_id) for b in a] for a in answers]
    assert shape[0] == shape[1]
    assert {(b.block_id, b.depth, b.parent_id) for b in records(caches[0]).values()} == {
        (b.block_id, b.depth, b.parent_id) for b in records(caches[1]).values()
    }
