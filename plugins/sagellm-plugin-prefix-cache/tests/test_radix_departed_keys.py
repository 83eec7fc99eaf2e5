"""The radix cache remembers the content keys of blocks it removed, so that
``sagellm_block_keys`` reads a returning prompt's keys instead of hashing
them again: whatever was inserted, read, removed and forgotten, the keys it
answers are the chained keys computed from scratch, and a prompt whose
removed blocks' keys were read is answered without hashing."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefix_cache_strategies import req
from sagellm_plugin_prefix_cache import radix
from sagellm_plugin_prefix_cache.radix import RadixPrefixCache, RadixSettings

from sagellm_core import PluginContext
from sagellm_core.errors import ConfigError
from sagellm_core.kit.testing import BlockIds, serve_prompt
from sagellm_core.registry import build_settings
from sagellm_core.types import ROOT_KEY, chain_key

BS = 4


def make(num_blocks=64, departed_keys=4.0):
    return RadixPrefixCache(
        RadixSettings(departed_keys=departed_keys), PluginContext("radix", block_size=BS, num_blocks=num_blocks)
    )


def scratch_keys(request, start, num_blocks):
    """The chained keys of ``request``'s full blocks ``start .. num_blocks - 1``, hashed from the root."""
    raw, key, out = request.prompt_token_ids, ROOT_KEY, []
    if request.cache_salt is not None:
        key = chain_key(ROOT_KEY, f"salt={request.cache_salt}".encode())
    for page in range(min(num_blocks, request.num_prompt_tokens // BS)):
        key = chain_key(key, raw[page * BS : (page + 1) * BS].tobytes())
        if page >= start:
            out.append(key)
    return tuple(out)


def evict_all(cache, read_keys=True):
    """Remove every evictable block, leaf first; read their keys as a store offered them would."""
    removed = cache.sagellm_remove_blocks(block_ids=list(cache.sagellm_evictable_blocks()))
    if read_keys:
        for block in removed:
            block.key  # noqa: B018 (the read computes a lazy key)
    return removed


def count_hashes(monkeypatch):
    calls = []
    real = radix.chain_key

    def counted(parent_key, page):
        calls.append(1)
        return real(parent_key, page)

    monkeypatch.setattr(radix, "chain_key", counted)
    return calls


def test_a_prompt_whose_blocks_left_the_tree_is_answered_without_hashing(monkeypatch):
    cache, ids = make(), BlockIds()
    prompt = req("a", list(range(40)))
    cache.sagellm_block_keys(request=prompt, start=0, num_blocks=1)  # a runtime with stores asks keys
    serve_prompt(cache, prompt, BS, ids)
    assert len(evict_all(cache)) == 10 and len(cache) == 0
    hashes = count_hashes(monkeypatch)
    back = req("b", list(range(40)) + [7, 7])
    assert cache.sagellm_block_keys(request=back, start=0, num_blocks=10) == scratch_keys(back, 0, 10)
    assert cache.sagellm_block_keys(request=back, start=3, num_blocks=10) == scratch_keys(back, 3, 10)
    assert hashes == []


def test_a_prompt_that_leaves_the_removed_run_hashes_only_its_own_pages(monkeypatch):
    cache, ids = make(), BlockIds()
    cache.sagellm_block_keys(request=req("x", [1] * 8), start=0, num_blocks=1)
    serve_prompt(cache, req("a", list(range(40))), BS, ids)
    evict_all(cache)
    hashes = count_hashes(monkeypatch)
    other = req("b", list(range(22)) + [99] * 18)  # leaves the run inside its sixth page
    assert cache.sagellm_block_keys(request=other, start=0, num_blocks=10) == scratch_keys(other, 0, 10)
    assert len(hashes) == 5  # pages 5 to 9


def test_keys_nobody_read_are_not_remembered_nor_hashed_at_removal(monkeypatch):
    cache, ids = make(), BlockIds()
    cache.sagellm_block_keys(request=req("x", [1] * 8), start=0, num_blocks=1)
    serve_prompt(cache, req("a", list(range(40))), BS, ids)
    hashes = count_hashes(monkeypatch)
    evict_all(cache, read_keys=False)
    back = req("b", list(range(40)))
    assert cache.sagellm_block_keys(request=back, start=0, num_blocks=10) == scratch_keys(back, 0, 10)
    assert len(hashes) == 10  # hashed when asked, as without the memory


def test_nothing_is_remembered_until_keys_are_asked_or_with_the_memory_off():
    for cache, ask in ((make(), False), (make(departed_keys=0.0), True)):
        ids = BlockIds()
        if ask:
            cache.sagellm_block_keys(request=req("x", [1] * 8), start=0, num_blocks=1)
        serve_prompt(cache, req("a", list(range(40))), BS, ids)
        evict_all(cache)
        assert cache._departed is None or cache._departed.pending == [] and not cache._departed.index


def test_the_memory_is_bounded_by_its_capacity():
    cache, ids = make(num_blocks=16, departed_keys=2.0), BlockIds()  # 32 pages: generations of 16
    cache.sagellm_block_keys(request=req("x", [1] * 8), start=0, num_blocks=1)
    for i in range(50):
        serve_prompt(cache, req(f"r{i}", [i] * 4 + list(range(12))), BS, ids)
        evict_all(cache)
    departed = cache._departed
    departed.index_pending(cache._root_key)
    assert departed.pages <= 16 and len(departed.index) + len(departed.older) <= 32 // 4


prompt_tokens = st.lists(st.integers(0, 5), min_size=0, max_size=30)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["serve", "evict", "evict unread", "ask"]),
            prompt_tokens,
            st.sampled_from([None, "s"]),
            st.integers(0, 8),
        ),
        max_size=25,
    ),
    capacity=st.sampled_from([0.0, 0.25, 1.0, 4.0]),
)
def test_keys_are_the_chained_keys_whatever_was_served_removed_and_forgotten(ops, capacity):
    cache, ids = make(num_blocks=16, departed_keys=capacity), BlockIds()
    for n, (op, tokens, salt, start) in enumerate(ops):
        request = req(f"r{n}", tokens, salt=salt)
        if op == "serve" and len(tokens) // BS + len(cache) <= 16:
            serve_prompt(cache, request, BS, ids)
        elif op.startswith("evict"):
            evict_all(cache, read_keys=op == "evict")
        elif op == "ask":
            full = len(tokens) // BS
            assert cache.sagellm_block_keys(request=request, start=start, num_blocks=full) == scratch_keys(
                request, start, full
            )


@pytest.mark.parametrize(("value", "said"), [(-1, "must be >= 0"), ("many", "must be <class 'float'>")])
def test_a_bad_capacity_is_a_one_line_config_error(value, said):
    with pytest.raises(ConfigError) as error:
        build_settings(RadixPrefixCache, {"departed_keys": value}, "[prefix_cache] plugin 'radix'")
    assert f"'departed_keys' {said}" in str(error.value) and "\n" not in str(error.value)
