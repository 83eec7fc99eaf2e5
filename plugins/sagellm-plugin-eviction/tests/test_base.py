"""The eviction base (sagellm_core.kit.eviction.PriorityEviction), against a
brute-force model of what it promises, and the policies written on it."""

import re
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given

from sagellm_core import PluginContext
from sagellm_core.kit.eviction import PriorityEviction
from sagellm_core.types import CachedBlock

CTX = PluginContext("p", block_size=16, num_blocks=100)


class TablePriority(PriorityEviction):
    """Priorities from a table by block id (few values, so many ties)."""

    def __init__(self, table, monotone=False):
        super().__init__(None, CTX)
        self.table = table
        self.monotone = monotone

    def priority(self, block, now_s):
        return 0 if self.monotone else self.table[block.block_id]


ops = st.lists(
    st.tuples(
        st.sampled_from("crtek"),  # cache a chain, release one, touch, evict, choose
        st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True),
    ),
    max_size=60,
)


@pytest.mark.parametrize("monotone", [False, True])
@given(
    ops=ops,
    table=st.lists(st.integers(0, 3), min_size=12, max_size=12),
    k=st.integers(1, 8),
    offered=st.sets(st.integers(0, 11)),
)
def test_victims_are_the_lowest_priority_candidates(monotone, ops, table, k, offered):
    """Victims are candidates, distinct, never a block touched or evicted
    since its release, and exactly the k lowest (priority at release, then
    release order, deepest first within a release) of a brute-force model."""
    policy = TablePriority(table, monotone)
    cached: set[int] = set()
    evictable: dict[int, tuple[int, int]] = {}  # block -> (priority at release, release number)
    released = 0
    now = 0.0
    for op, ids in ops:
        now += 1.0
        blocks = tuple(CachedBlock(b, depth, None) for depth, b in enumerate(ids))
        if op == "c":
            fresh = tuple(b for b in blocks if b.block_id not in cached)
            cached.update(b.block_id for b in fresh)
            policy.sagellm_blocks_cached(blocks=fresh)
        elif op == "r":  # the cache releases only what is cached and held
            chain = tuple(b for b in blocks if b.block_id in cached and b.block_id not in evictable)
            for block in reversed(chain):
                released += 1
                evictable[block.block_id] = (0 if monotone else table[block.block_id], released)
            policy.sagellm_blocks_released(blocks=chain, now_s=now)
        elif op == "t":
            hit = tuple(b for b in blocks if b.block_id in evictable)
            for block in hit:
                del evictable[block.block_id]
            policy.sagellm_blocks_touched(blocks=hit)
        elif op == "e":
            gone = tuple(b for b in blocks if b.block_id in evictable)
            for block in gone:
                del evictable[block.block_id]
                cached.discard(block.block_id)
            policy.sagellm_blocks_evicted(blocks=gone)
        # offered may name blocks that are not evictable (held, evicted,
        # never cached): the policy still names only evictable ones
        victims = policy.sagellm_select_victims(num_blocks=k, candidates=offered).victim_ids
        assert len(set(victims)) == len(victims)
        assert set(victims) <= offered and set(victims) <= evictable.keys()
        expected = sorted((b for b in evictable if b in offered), key=evictable.__getitem__)[:k]
        assert list(victims) == expected
        assert policy.sagellm_select_victims(num_blocks=k, candidates=offered).victim_ids == victims  # no side effects


def test_the_heap_drops_stale_entries_and_keeps_its_order():
    """Many hits leave stale heap entries behind: the heap is compacted, and
    the order stays that of the live blocks."""
    policy = TablePriority({b: -b for b in range(100)})
    blocks = [CachedBlock(b, 0, None) for b in range(100)]
    policy.sagellm_blocks_cached(blocks=tuple(blocks))
    for _ in range(30):
        policy.sagellm_blocks_released(blocks=tuple(blocks), now_s=0.0)
        policy.sagellm_blocks_touched(blocks=tuple(blocks[:90]))
    assert len(policy._heap) <= 2 * 100 + 1024  # 3,000 pushed
    assert policy.sagellm_select_victims(num_blocks=20, candidates=set(range(100))).victim_ids == tuple(
        range(99, 89, -1)
    )
    assert policy.uses[0] == 31 and policy.uses[95] == 1


def test_a_policy_on_the_base_ignores_blocks_not_offered():
    """An engine may offer fewer blocks than are evictable (LMDeploy leaves
    pinned ones out): the best blocks not offered are passed over, not named,
    and stay in the order for the next choice."""
    from sagellm_plugin_eviction.lfu import LFUEviction
    from sagellm_plugin_eviction.lru import LRUEviction

    for policy in (LRUEviction(None, CTX), LFUEviction(None, CTX)):
        chain = tuple(CachedBlock(b, b, b - 1 if b else None) for b in range(6))
        policy.sagellm_blocks_cached(blocks=chain)
        policy.sagellm_blocks_released(blocks=chain, now_s=0.0)
        assert policy.sagellm_select_victims(num_blocks=2, candidates={0, 1, 2, 3}).victim_ids == (3, 2)
        assert policy.sagellm_select_victims(num_blocks=9, candidates={5, 0}).victim_ids == (5, 0)
        assert policy.sagellm_select_victims(num_blocks=9, candidates=set()).victim_ids == ()
        assert policy.sagellm_select_victims(num_blocks=2, candidates=set(range(6))).victim_ids == (5, 4)


GUIDE = Path(__file__).resolve().parents[3] / "docs" / "plugin-guide.md"


@pytest.mark.skipif(not GUIDE.exists(), reason="not in the sagellm source tree")
def test_the_plugin_guide_policy_is_complete_short_and_right():
    """docs/plugin-guide.md's policy on the base runs as printed, in under 30 lines."""
    text = GUIDE.read_text()
    source = re.search(r"## An eviction policy on the base.*?```python\n(.*?)```", text, re.S).group(1)
    assert len(source.splitlines()) < 30
    namespace: dict = {}
    exec(compile(source, str(GUIDE), "exec"), namespace)
    policy_cls = next(
        v
        for v in namespace.values()
        if isinstance(v, type) and issubclass(v, PriorityEviction) and v is not PriorityEviction
    )
    policy = policy_cls(policy_cls.Settings(), CTX)
    # A shared system prompt (blocks 0-1) under two conversations.
    system = (CachedBlock(0, 0, None), CachedBlock(1, 1, 0))
    one = system + (CachedBlock(2, 2, 1), CachedBlock(3, 3, 2))
    two = system + (CachedBlock(4, 2, 1),)
    policy.sagellm_blocks_cached(blocks=one)
    policy.sagellm_blocks_cached(blocks=two[2:])
    policy.sagellm_blocks_released(blocks=one[2:], now_s=1.0)
    policy.sagellm_blocks_released(blocks=two, now_s=2.0)
    victims = policy.sagellm_select_victims(num_blocks=5, candidates=set(range(5))).victim_ids
    assert sorted(victims) == [0, 1, 2, 3, 4]
    assert victims.index(1) < victims.index(0)  # a chain from its leaf up
