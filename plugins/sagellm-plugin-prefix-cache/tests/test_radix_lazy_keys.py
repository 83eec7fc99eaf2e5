"""The radix cache's blocks compute their content keys when first read: the
same keys, equal to (and hashed as) plain CachedBlocks, readable after the
blocks left the tree, on chains longer than the recursion limit."""

import pickle
import sys

import attrs
from prefix_cache_strategies import req
from sagellm_plugin_prefix_cache.radix import RadixPrefixCache, RadixSettings, _Block, _KeyReads

from sagellm_core import PluginContext
from sagellm_core.types import ROOT_KEY, CachedBlock, chain_key

BS = 4


def make(num_blocks=1000):
    return RadixPrefixCache(RadixSettings(), PluginContext("radix", block_size=BS, num_blocks=num_blocks))


def insert(cache, rid, tokens, first_id=0):
    r = req(rid, tokens)
    match = cache.sagellm_acquire_prefix(request=r)
    n_full = len(tokens) // BS
    ids = list(match.block_ids) + list(range(first_id, first_id + n_full - match.num_blocks))
    return r, cache.sagellm_insert_prefix(request=r, token_ids=r.prompt_token_ids[: n_full * BS], block_ids=ids)


def eager_keys(tokens):
    keys, key = [], ROOT_KEY
    raw = req("x", tokens).prompt_token_ids
    for page in range(len(tokens) // BS):
        key = chain_key(key, raw[page * BS : (page + 1) * BS].tobytes())
        keys.append(key)
    return keys


def test_keys_are_the_chained_keys_whatever_order_they_are_read_in():
    cache = make()
    tokens = list(range(40))
    _, result = insert(cache, "a", tokens)
    blocks = result.adopted
    assert all(b._lazy is not None for b in blocks)  # nothing hashed yet
    expected = eager_keys(tokens)
    assert blocks[5].key == expected[5]  # a middle block first: its parents are computed on the way
    assert [b._lazy is None for b in blocks] == [True] * 6 + [False] * 4
    assert [b.key for b in reversed(blocks)] == expected[::-1]
    # Keys are read: from now on the tree computes them as it inserts, chained
    # from the cached blocks' keys.
    _, more = insert(cache, "b", tokens + list(range(100, 108)), first_id=10)
    assert {type(b) for b in more.adopted} == {CachedBlock}
    assert [b.key for b in more.adopted] == eager_keys(tokens + list(range(100, 108)))[10:]


def test_a_lazy_block_is_equal_to_and_hashed_as_its_plain_copy():
    cache = make()
    _, result = insert(cache, "a", list(range(8)))
    block = result.adopted[1]
    plain = CachedBlock(block.block_id, block.depth, block.parent_id, block.key, block.namespace, block.tenant)
    assert block == plain and plain == block and not block != plain
    assert hash(block) == hash(plain) and len({block, plain}) == 1
    assert block != attrs.evolve(plain, depth=7)
    assert attrs.evolve(block, depth=7) == attrs.evolve(plain, depth=7)
    assert pickle.loads(pickle.dumps(block)) == plain
    assert repr(block) == repr(plain)


def test_keys_are_readable_after_the_blocks_were_removed():
    cache = make()
    tokens = list(range(24))
    r, result = insert(cache, "a", tokens)
    cache.sagellm_release_prefix(request=r)
    removed = cache.sagellm_remove_blocks(block_ids=[result.adopted[2].block_id])
    assert [b.key for b in removed] == eager_keys(tokens)[2:]


def test_a_chain_longer_than_the_recursion_limit():
    n = sys.getrecursionlimit() + 500
    cache = make(num_blocks=n + 10)
    tokens = list(range(n * BS))
    _, result = insert(cache, "a", tokens)
    assert result.adopted[-1].key == eager_keys(tokens)[-1]


def test_the_tree_computes_keys_at_insertion_while_its_plugins_read_most_of_them():
    cache = make(num_blocks=100_000)
    served = iter(range(1_000))

    def new_edge() -> tuple[CachedBlock, ...]:  # four blocks sharing nothing with the others
        n = next(served)
        return insert(cache, f"r{n}", [n * 1_000 + t for t in range(4 * BS)], first_id=n * 4)[1].adopted

    def lazy(edge) -> bool:
        return all(type(b) is _Block and b._lazy is not None for b in edge)

    unread = [new_edge() for _ in range(8)]
    assert all(map(lazy, unread))  # nothing read: nothing hashed
    keys = [b.key for edge in unread for b in edge]  # a plugin reads every key (ARC's ghosts, a host tier)
    assert keys == [eager_keys([n * 1_000 + t for t in range(4 * BS)])[i] for n in range(8) for i in range(4)]
    edges = [new_edge() for _ in range(2 * _KeyReads.SAMPLE_EVERY)]
    sampled = [lazy(edge) for edge in edges]
    assert sum(sampled) == 2  # one edge in SAMPLE_EVERY stays lazy, to keep measuring the share read
    assert all(type(b) is CachedBlock for edge, was_lazy in zip(edges, sampled) if not was_lazy for b in edge)
    # The plugins stop reading keys (a host tier bypassed): the samples go
    # unread, and the tree turns lazy again.
    more = [new_edge() for _ in range(20 * _KeyReads.SAMPLE_EVERY)]
    assert all(map(lazy, more[-_KeyReads.SAMPLE_EVERY :]))
