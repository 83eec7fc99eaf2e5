"""Walks the radix tree does not make twice: an insert follows the path its
request holds (checked node by node, not looked up again), after other
requests split that path, and not when the tokens inserted are not the ones
the path holds; an acquire right after its request's lookup, the tree
unchanged, takes the lookup's walk."""

from prefix_cache_strategies import req
from sagellm_plugin_prefix_cache.radix import RadixPrefixCache, RadixSettings

from sagellm_core import PluginContext

BS = 4


def make():
    return RadixPrefixCache(RadixSettings(), PluginContext("radix", block_size=BS, num_blocks=1000))


def test_an_insert_follows_its_held_path_after_another_request_split_it():
    cache = make()
    a = req("a", list(range(24)))  # 6 blocks, one edge
    cache.sagellm_acquire_prefix(request=a)
    cache.sagellm_insert_prefix(request=a, token_ids=a.prompt_token_ids, block_ids=list(range(6)))
    cache.sagellm_release_prefix(request=a)
    b = req("b", list(range(24)) + list(range(100, 108)))  # holds all 6 (its lock ends the edge)
    assert cache.sagellm_acquire_prefix(request=b).block_ids == (0, 1, 2, 3, 4, 5)
    c = req("c", list(range(8)) + [77] * 8)  # splits the edge after 2 blocks
    assert cache.sagellm_acquire_prefix(request=c).block_ids == (0, 1)
    result = cache.sagellm_insert_prefix(request=b, token_ids=b.prompt_token_ids, block_ids=[0, 1, 2, 3, 4, 5, 6, 7])
    assert [x.block_id for x in result.adopted] == [6, 7] and result.replaced == () and result.locked == ()
    assert [cache.refcount(i) for i in range(8)] == [2, 2, 1, 1, 1, 1, 1, 1]
    assert [x.block_id for x in cache.sagellm_release_prefix(request=b)] == [2, 3, 4, 5, 6, 7]


def test_tokens_that_leave_the_held_path_are_walked_from_the_root():
    cache = make()
    a = req("a", list(range(16)))
    cache.sagellm_acquire_prefix(request=a)
    cache.sagellm_insert_prefix(request=a, token_ids=a.prompt_token_ids, block_ids=[0, 1, 2, 3])
    cache.sagellm_release_prefix(request=a)
    b = req("b", list(range(16)) + [5])
    assert cache.sagellm_acquire_prefix(request=b).block_ids == (0, 1, 2, 3)
    # The engine inserts other tokens than the held path's (its own business):
    # they are matched from the root, so the held blocks are not taken as theirs.
    other = req("x", [9] * 16).prompt_token_ids
    result = cache.sagellm_insert_prefix(request=b, token_ids=other, block_ids=[10, 11, 12, 13])
    assert [x.block_id for x in result.adopted] == [10, 11, 12, 13] and result.replaced == ()
    assert cache.sagellm_lookup_prefix(request=req("y", [9] * 17)).block_ids == (10, 11, 12, 13)


def test_an_acquire_right_after_its_lookup_takes_the_lookups_walk():
    cache = make()
    a = req("a", list(range(24)))
    cache.sagellm_acquire_prefix(request=a)
    cache.sagellm_insert_prefix(request=a, token_ids=a.prompt_token_ids, block_ids=list(range(6)))
    cache.sagellm_release_prefix(request=a)
    b = req("b", list(range(12)) + [99] * 8)  # 3 blocks in, inside the edge
    assert cache.sagellm_lookup_prefix(request=b).block_ids == (0, 1, 2)
    walks = []
    real_walk = cache._walk
    cache._walk = lambda *args, **kwargs: walks.append(args) or real_walk(*args, **kwargs)
    assert cache.sagellm_acquire_prefix(request=b).block_ids == (0, 1, 2)
    assert walks == []  # the lookup's walk, split where it ended
    assert [cache.refcount(i) for i in range(6)] == [1, 1, 1, 0, 0, 0]
    assert {len(n.blocks) for n in cache._where.values()} == {3}  # the edge split in two
    # The tree changed between a lookup and its acquire: walked again.
    c = req("c", list(range(8)) + [5] * 8)
    assert cache.sagellm_lookup_prefix(request=c).block_ids == (0, 1)
    d = req("d", list(range(4)) + [6] * 8)
    cache.sagellm_acquire_prefix(request=d)  # splits the edge after block 0
    assert cache.sagellm_acquire_prefix(request=c).block_ids == (0, 1)
    assert len(walks) == 3  # c's lookup, d's acquire, and c's acquire, walked again
    assert [cache.refcount(i) for i in range(3)] == [3, 2, 1]
