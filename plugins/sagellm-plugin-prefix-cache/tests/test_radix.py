from collections import Counter

import hypothesis
import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from prefix_cache_strategies import SERVE, drawn_request, req
from sagellm_plugin_prefix_cache.radix import RadixPrefixCache, RadixSettings

from sagellm_core import PluginContext
from sagellm_core.kit.testing import BlockIds, serve_prompt
from sagellm_core.types import chain_key

BS = 4


def make():
    return RadixPrefixCache(RadixSettings(), PluginContext("radix", block_size=BS, num_blocks=1000))


def serve(cache, blocks, rid, tokens):
    """Acquire, insert the full blocks, return the request."""
    r = req(rid, tokens)
    match = cache.sagellm_acquire_prefix(request=r)
    n_full = len(tokens) // BS
    ids = list(match.block_ids) + blocks.take(n_full - match.num_blocks)
    cache.sagellm_insert_prefix(request=r, token_ids=r.prompt_token_ids[: n_full * BS], block_ids=ids)
    return r


def test_match_reuses_inserted_blocks_and_leaves_one_token():
    cache, blocks = make(), BlockIds()
    a = serve(cache, blocks, "a", list(range(12)))  # 3 blocks
    released = cache.sagellm_release_prefix(request=a)
    assert [b.block_id for b in released] == [0, 1, 2]  # chain order, root first
    assert [b.depth for b in released] == [0, 1, 2] and released[1].parent_id == 0
    # The same 12 tokens: a full hit would leave nothing to compute.
    assert cache.sagellm_lookup_prefix(request=req("b", list(range(12)))).block_ids == (0, 1)
    assert cache.sagellm_lookup_prefix(request=req("c", list(range(13)))).block_ids == (0, 1, 2)
    assert cache.sagellm_lookup_prefix(request=req("d", [0, 1, 2, 3, 9, 9, 9, 9, 9])).block_ids == (0,)
    assert cache.sagellm_lookup_prefix(request=req("e", [9] * 20)).block_ids == ()


def test_divergence_splits_the_edge_and_locks_per_node():
    cache, blocks = make(), BlockIds()
    a = serve(cache, blocks, "a", list(range(16)))  # blocks 0..3, one edge
    b = serve(cache, blocks, "b", list(range(8)) + [99] * 8)  # shares 2 blocks
    assert [cache.refcount(i) for i in range(4)] == [2, 2, 1, 1]
    assert [cache.refcount(i) for i in (4, 5)] == [1, 1]
    assert len(cache.sagellm_evictable_blocks()) == 0
    released = cache.sagellm_release_prefix(request=a)
    assert [x.block_id for x in released] == [2, 3]
    assert set(cache.sagellm_evictable_blocks()) == {2, 3}
    cache.sagellm_release_prefix(request=b)
    assert len(cache.sagellm_evictable_blocks()) == 6


def test_evicting_a_block_drops_its_descendants():
    cache, blocks = make(), BlockIds()
    for rid, tokens in (("a", list(range(16))), ("b", list(range(8)) + [99] * 8)):
        cache.sagellm_release_prefix(request=serve(cache, blocks, rid, tokens))
    removed = cache.sagellm_remove_blocks(block_ids=[1])
    assert sorted(b.block_id for b in removed) == [1, 2, 3, 4, 5]
    assert len(cache) == 1 and len(cache.sagellm_evictable_blocks()) == 1
    assert cache.sagellm_lookup_prefix(request=req("x", list(range(16)) + [0])).block_ids == (0,)


def test_locked_blocks_cannot_be_removed():
    cache, blocks = make(), BlockIds()
    serve(cache, blocks, "a", list(range(8)))
    try:
        cache.sagellm_remove_blocks(block_ids=[0])
    except ValueError as exc:
        assert "block 0 is not an evictable cached block" in str(exc)
    else:
        raise AssertionError("a locked block was removed")
    assert len(cache) == 2


def test_insert_of_cached_pages_reports_replacements_and_locks():
    cache, blocks = make(), BlockIds()
    cache.sagellm_release_prefix(request=serve(cache, blocks, "a", list(range(8))))
    # "b" computed the same two pages into its own blocks 50, 51 (it was
    # admitted before "a" cached them), then one more page.
    b = req("b", list(range(12)))
    result = cache.sagellm_insert_prefix(request=b, token_ids=b.prompt_token_ids, block_ids=[50, 51, 52])
    assert [(g, c.block_id) for g, c in result.replaced] == [(50, 0), (51, 1)]
    assert [x.block_id for x in result.adopted] == [52]
    assert [x.block_id for x in result.locked] == [0, 1]
    assert [cache.refcount(i) for i in (0, 1, 52)] == [1, 1, 1]


class TreeMachine(RuleBasedStateMachine):
    """Random serve / release / evict against a plain model: which requests
    hold which blocks, and which tokens each block holds. Prefixes matched
    twice are pinned, up to 20 blocks."""

    def __init__(self):
        super().__init__()
        settings = RadixSettings(isolate="tenant", pin_after_hits=2, max_pinned_share=0.02)
        self.cache = RadixPrefixCache(settings, PluginContext("radix", BS, 1000))
        self.blocks = BlockIds()
        self.holding: dict[str, set[int]] = {}
        self.content: dict[int, bytes] = {}
        self.serial = 0

    @rule(**SERVE)
    def serve(self, **draw):
        self.serial += 1
        r = drawn_request(self.serial, **draw)
        if r is None:
            return
        rid = r.request_id
        namespace = self.cache._namespace(r)
        match = self.cache.sagellm_acquire_prefix(request=r)
        assert all(b.namespace == namespace for b in match.blocks)  # namespaces never cross
        for i, block in enumerate(match.blocks):  # a match is the prompt's own pages
            assert self.content[block.block_id] == r.prompt_token_ids[i * BS : (i + 1) * BS].tobytes()
        n_full = r.num_prompt_tokens // BS
        ids = list(match.block_ids) + self.blocks.take(n_full - match.num_blocks)
        result = self.cache.sagellm_insert_prefix(request=r, token_ids=r.prompt_token_ids[: n_full * BS], block_ids=ids)
        for given, cached in result.replaced:
            ids[ids.index(given)] = cached.block_id
        for i, block_id in enumerate(ids):
            self.content.setdefault(block_id, r.prompt_token_ids[i * BS : (i + 1) * BS].tobytes())
        self.holding[rid] = set(ids)

    @precondition(lambda self: self.holding)
    @rule(index=st.integers(0, 50))
    def release(self, index):
        rid = sorted(self.holding)[index % len(self.holding)]
        del self.holding[rid]
        for block in self.cache.sagellm_release_prefix(request=req(rid, [0])):
            assert self.cache.refcount(block.block_id) == 0

    @rule(count=st.integers(1, 4), data=st.data())
    def evict(self, count, data):
        evictable = sorted(self.cache.sagellm_evictable_blocks())
        if not evictable:
            return
        victims = data.draw(st.lists(st.sampled_from(evictable), min_size=1, max_size=count, unique=True))
        removed = self.cache.sagellm_remove_blocks(block_ids=victims)
        assert set(victims) <= {b.block_id for b in removed}
        for block in removed:
            del self.content[block.block_id]

    @invariant()
    def refcounts_equal_holders(self):
        holders = Counter(b for held in self.holding.values() for b in held)
        for block_id in self.content:
            assert self.cache.refcount(block_id) == holders[block_id]

    @invariant()
    def pinned_share_is_capped_and_pinned_blocks_stay(self):
        pinned = set(self.cache.sagellm_pinned_blocks())
        assert len(pinned) == self.cache.num_pinned <= 20
        assert not pinned & set(self.cache.sagellm_evictable_blocks())
        assert pinned <= set(self.content)
        for block_id in pinned:  # a pinned block's ancestors are pinned
            parent = self.cache._info[block_id].parent_id
            assert parent is None or parent in pinned

    @invariant()
    def edges_are_their_pages(self):
        for node in set(self.cache._where.values()):
            pages = [self.content[b.block_id] for b in node.blocks]
            assert node.edge == b"".join(pages) and node.first == pages[0]
            assert node.parent.children[node.first] is node

    @invariant()
    def no_orphans_and_evictable_is_exact(self):
        evictable = set(self.cache.sagellm_evictable_blocks())
        assert len(evictable) == len(self.cache.sagellm_evictable_blocks())
        pinned = set(self.cache.sagellm_pinned_blocks())
        assert evictable == {b for b in self.content if self.cache.refcount(b) == 0} - pinned
        for block_id in self.content:
            info = self.cache._info[block_id]
            parent = info.parent_id
            assert parent is None or parent in self.content  # a block never outlives its parent
            parent_key = self.cache._info[parent].key if parent is not None else self.cache._root_key(info.namespace)
            assert info.key == chain_key(parent_key, self.content[block_id])  # content-chained key


TestTree = TreeMachine.TestCase
TestTree.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_tenants_are_isolated_only_when_asked():
    shared = RadixPrefixCache(RadixSettings(), PluginContext("radix", BS, 100))
    isolated = RadixPrefixCache(RadixSettings(isolate="tenant"), PluginContext("radix", BS, 100))
    for cache in (shared, isolated):
        a = req("a", list(range(12)), tenant="t1")
        cache.sagellm_acquire_prefix(request=a)
        cache.sagellm_insert_prefix(request=a, token_ids=a.prompt_token_ids, block_ids=[0, 1, 2])
        cache.sagellm_release_prefix(request=a)
    other_tenant = req("b", list(range(13)), tenant="t2")
    assert shared.sagellm_lookup_prefix(request=other_tenant).block_ids == (0, 1, 2)
    assert isolated.sagellm_lookup_prefix(request=other_tenant).block_ids == ()
    salted = req("c", list(range(13)), tenant="t1", salt="user-9")
    assert shared.sagellm_lookup_prefix(request=salted).block_ids == ()  # a salt always separates
    same = req("d", list(range(13)), tenant="t1")
    assert isolated.sagellm_lookup_prefix(request=same).block_ids == (0, 1, 2)


def test_kv_events_let_a_router_track_the_cache(tmp_path):
    import json

    events = tmp_path / "events.jsonl"
    cache = RadixPrefixCache(RadixSettings(events=str(events)), PluginContext("radix", BS, 100))
    blocks = BlockIds()
    cache.sagellm_release_prefix(request=serve(cache, blocks, "a", list(range(12))))
    cache.sagellm_release_prefix(request=serve(cache, blocks, "b", list(range(8)) + [7] * 8))
    key_of_block_1 = cache._info[1].key  # "b" shares blocks 0 and 1 with "a"
    cache.sagellm_remove_blocks(block_ids=[1])
    # A router replaying the events knows exactly which keys are cached.
    held = set()
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["type"] for e in lines] == ["stored", "stored", "removed"]
    for e in lines:
        (held.update if e["type"] == "stored" else held.difference_update)(e["keys"])
    assert held == {cache._info[b].key for b in cache._where}
    assert lines[0]["parent"] is None and lines[1]["parent"] == key_of_block_1
    assert len(lines[2]["keys"]) == 4  # block 1, the rest of a's chain, and b's two new blocks


def test_a_prefix_matched_often_is_pinned_within_the_cap():
    cache = RadixPrefixCache(RadixSettings(pin_after_hits=2, max_pinned_share=0.003), PluginContext("radix", BS, 1000))
    blocks = BlockIds()
    system = list(range(8))  # two blocks every request shares
    first = serve(cache, blocks, "a", system + [50, 51, 52, 53, 54])
    cache.sagellm_release_prefix(request=first)
    for rid in ("b", "c"):  # two matches of the system prompt: pinned
        r = serve(cache, blocks, rid, system + [60 + len(rid), 1, 2, 3, 4])
        cache.sagellm_release_prefix(request=r)
    assert sorted(cache.sagellm_pinned_blocks()) == [0, 1]
    evictable = set(cache.sagellm_evictable_blocks())
    assert not {0, 1} & evictable and evictable  # the rest can go
    assert cache.refcount(0) == 0  # no request holds it
    # Requests sharing four blocks: the cap (3) lets the third be pinned, not the fourth.
    for rid in ("d", "e", "f"):
        r = serve(cache, blocks, rid, system + [50, 51, 52, 53, 70, 71, 72, 73, 99])
        cache.sagellm_release_prefix(request=r)
    assert cache.sagellm_lookup_prefix(request=req("g", system + [50, 51, 52, 53, 70, 71, 72, 73, 99])).num_blocks == 4
    assert sorted(cache.sagellm_pinned_blocks()) == [0, 1, 2]


class CountingEdge(bytes):
    """An edge that counts the bytes its slices copy."""

    copied = 0

    def __getitem__(self, index):
        part = bytes.__getitem__(self, index)
        if isinstance(index, slice):
            CountingEdge.copied += len(part)
        return part


def test_trimming_a_chain_from_its_leaf_copies_its_edge_once():
    """Removal is linear in the blocks removed: victims trimmed leaf first
    from one long edge cut it once per call, not once per victim (which
    copied the edge again for each, quadratic in the chain's length)."""
    copied = {}
    for pages in (64, 640):
        cache = RadixPrefixCache(RadixSettings(), PluginContext("radix", block_size=BS, num_blocks=4 * pages))
        blocks = serve_prompt(cache, req("long", list(range(pages * BS + 1))), BS, BlockIds())
        (node,) = {cache._where[b.block_id] for b in blocks}  # one edge holds the whole chain
        node.edge = CountingEdge(node.edge)
        CountingEdge.copied = 0
        leaf_first = [b.block_id for b in reversed(blocks)][: pages // 2]
        removed = cache.sagellm_remove_blocks(block_ids=leaf_first)
        assert len(removed) == pages // 2 and len(cache) == pages - pages // 2
        copied[pages] = CountingEdge.copied
    # the kept half of the edge, once: ten times the blocks, ten times the bytes
    assert copied[640] == 10 * copied[64] == 10 * (64 // 2) * len(node.first)


def test_token_ids_that_are_not_contiguous_are_cached_and_matched_by_their_values():
    """The cache reads token bytes in place where they are contiguous; a
    strided buffer (an engine's numpy view) is read through a copy, to the
    same pages, keys and matches."""
    np = pytest.importorskip("numpy")
    strided = np.repeat(np.arange(12, dtype=np.int64), 2)[::2]  # 0..11, every other element of a buffer
    assert not strided.flags.c_contiguous
    for given in (strided, np.arange(12, dtype=np.int64)):
        cache = make()
        a = req("a", list(range(12)))
        cache.sagellm_acquire_prefix(request=a)
        cache.sagellm_insert_prefix(request=a, token_ids=given, block_ids=[0, 1, 2])
        cache.sagellm_release_prefix(request=a)
        assert cache.sagellm_lookup_prefix(request=req("b", list(range(13)))).block_ids == (0, 1, 2)
        assert cache.sagellm_block_keys(request=req("c", list(range(13))), start=0, num_blocks=3) == tuple(
            cache._info[b].key for b in (0, 1, 2)
        )
        assert cache.sagellm_lookup_prefix(request=req("d", list(range(8)) + [5] * 5)).block_ids == (0, 1)


@settings(max_examples=60, deadline=None)
@hypothesis.given(
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=4, max_size=40), min_size=1, max_size=6), data=st.data()
)
def test_one_removal_call_removes_what_one_call_per_victim_would_in_that_order(prompts, data):
    """Victims trimming an edge leaf first are taken in one pass: the blocks
    removed, and their order, are those of removing the victims one by one."""

    def build():
        cache, blocks = make(), BlockIds()
        for i, tokens in enumerate(prompts):
            cache.sagellm_release_prefix(request=serve(cache, blocks, f"r{i}", tokens))
        return cache

    together, one_by_one = build(), build()
    evictable = sorted(together.sagellm_evictable_blocks())
    if not evictable:
        return
    # Leaf-first runs (as LRU names them) and arbitrary picks.
    leaf_first = sorted(evictable, key=lambda b: -together._info[b].depth)
    victims = data.draw(st.sampled_from([leaf_first, evictable, data.draw(st.permutations(evictable))]))
    victims = victims[: data.draw(st.integers(1, len(victims)))]
    removed = [b.block_id for b in together.sagellm_remove_blocks(block_ids=victims)]
    expected = []
    for victim in victims:
        if victim in one_by_one._where:
            expected += [b.block_id for b in one_by_one.sagellm_remove_blocks(block_ids=[victim])]
    assert removed == expected
    assert set(together._where) == set(one_by_one._where) and len(together) == len(one_by_one)
    for block_id, node in together._where.items():
        other = one_by_one._where[block_id]
        assert node.edge == other.edge and [b.block_id for b in node.blocks] == [b.block_id for b in other.blocks]
