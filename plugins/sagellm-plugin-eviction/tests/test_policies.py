import inspect
from array import array

import hypothesis.strategies as st
import numpy
import pytest
from hypothesis import given
from sagellm_plugin_eviction.arc import ARCEviction
from sagellm_plugin_eviction.continuation import ContinuationEviction, ContinuationSettings
from sagellm_plugin_eviction.cost import CostAwareEviction, CostSettings
from sagellm_plugin_eviction.fair import FairEviction, FairSettings
from sagellm_plugin_eviction.lfu import LFUEviction
from sagellm_plugin_eviction.lru import LRUEviction
from sagellm_plugin_eviction.predictive import PredictiveEviction, PredictiveSettings
from sagellm_plugin_eviction.s3fifo import S3FIFOEviction, S3FIFOSettings
from sagellm_plugin_eviction.slo import SLOEviction

from sagellm_core import PluginContext
from sagellm_core.types import EMPTY_MATCH, CachedBlock, PrefixMatch, Request, RequestOutcome

CTX = PluginContext("p", block_size=16, num_blocks=100)


class EveryBlock:
    """Candidates that offer every block the policy knows as evictable."""

    def __contains__(self, block_id: object) -> bool:
        return True


EVERY_BLOCK = EveryBlock()


def chain(first, n, start_depth=0, parent=None):
    blocks = []
    for i in range(n):
        blocks.append(CachedBlock(first + i, start_depth + i, parent))
        parent = first + i
    return tuple(blocks)


def test_lru_evicts_least_recently_released_leaf_first():
    lru = LRUEviction(None, CTX)
    a, b = chain(0, 3), chain(10, 2)
    lru.sagellm_blocks_released(blocks=a, now_s=0.0)
    lru.sagellm_blocks_released(blocks=b, now_s=0.0)
    assert lru.sagellm_select_victims(num_blocks=4, candidates=EVERY_BLOCK).victim_ids == (2, 1, 0, 11)
    lru.sagellm_blocks_touched(blocks=a[:2])  # a hit on blocks 0 and 1
    assert lru.sagellm_select_victims(num_blocks=9, candidates=EVERY_BLOCK).victim_ids == (2, 11, 10)
    lru.sagellm_blocks_released(blocks=a[:2], now_s=1.0)
    lru.sagellm_blocks_evicted(blocks=(a[2],))
    assert lru.sagellm_select_victims(num_blocks=9, candidates=EVERY_BLOCK).victim_ids == (11, 10, 1, 0)


def test_selection_does_not_change_the_policy():
    for policy in (LRUEviction(None, CTX), LFUEviction(None, CTX)):
        policy.sagellm_blocks_cached(blocks=chain(0, 3))
        policy.sagellm_blocks_released(blocks=chain(0, 3), now_s=0.0)
        first = policy.sagellm_select_victims(num_blocks=2, candidates=EVERY_BLOCK).victim_ids
        assert policy.sagellm_select_victims(num_blocks=2, candidates=EVERY_BLOCK).victim_ids == first


def test_lfu_keeps_frequently_hit_blocks():
    lfu = LFUEviction(None, CTX)
    hot, cold = chain(0, 2), chain(10, 2)
    lfu.sagellm_blocks_cached(blocks=hot + cold)
    lfu.sagellm_blocks_released(blocks=hot, now_s=0.0)
    lfu.sagellm_blocks_released(blocks=cold, now_s=0.0)
    for _ in range(3):
        lfu.sagellm_blocks_touched(blocks=hot)
        lfu.sagellm_blocks_released(blocks=hot, now_s=0.0)
    # Cold blocks go first, leaf before parent; hot ones last.
    assert lfu.sagellm_select_victims(num_blocks=4, candidates=EVERY_BLOCK).victim_ids == (11, 10, 1, 0)
    lfu.sagellm_blocks_evicted(blocks=cold)
    assert lfu.sagellm_select_victims(num_blocks=4, candidates=EVERY_BLOCK).victim_ids == (1, 0)


def test_lru_and_slo_leave_preemption_to_the_runtime():
    # The runtime's fallback is vLLM's FCFS rule (the last running request),
    # which is what both would answer.
    for policy in (LRUEviction(None, CTX), SLOEviction(None, CTX)):
        assert not hasattr(policy, "sagellm_select_preemption")


def s3fifo(settings, context):
    return S3FIFOEviction(S3FIFOSettings(), context)


def predictive(settings, context):
    return PredictiveEviction(PredictiveSettings(samples=4, refit_every=8), context)


def continuation(settings, context):
    return ContinuationEviction(ContinuationSettings(), context)


def fair(settings, context):
    return FairEviction(FairSettings(), context)


def cost(settings, context):
    return CostAwareEviction(CostSettings(), context)


@pytest.mark.parametrize(
    "policy_cls", [LRUEviction, LFUEviction, s3fifo, ARCEviction, predictive, continuation, fair, cost, SLOEviction]
)
@given(ops=st.lists(st.tuples(st.sampled_from("crte"), st.integers(0, 7)), max_size=60), k=st.integers(1, 6))
def test_victims_are_always_evictable_and_distinct(policy_cls, ops, k):
    """Against a model of the evictable set built from the same observations."""
    policy = policy_cls(None, CTX)
    clock = iter(range(10**6))

    def observe(hook, *blocks):
        if hasattr(policy, hook):  # a policy implements the observations it needs
            method = getattr(policy, hook)
            # as pluggy does, pass only the arguments the implementation takes
            extra = {"now_s": float(next(clock))} if "now_s" in inspect.signature(method).parameters else {}
            method(blocks=blocks, **extra)

    cached, evictable = set(), set()
    for op, i in ops:
        # Content keys and depths that do not fit a prefix tree: a policy
        # must not trust the observations further than they go.
        block = CachedBlock(i, i % 3, None, key=i % 5)
        if op == "c" and i not in cached:
            cached.add(i)
            observe("sagellm_blocks_cached", block)
        elif op == "r" and i in cached and i not in evictable:
            evictable.add(i)
            observe("sagellm_blocks_released", block)
        elif op == "t" and i in evictable:
            evictable.discard(i)
            observe("sagellm_blocks_touched", block)
        elif op == "e" and i in evictable:
            evictable.discard(i)
            cached.discard(i)
            observe("sagellm_blocks_evicted", block)
        victims = policy.sagellm_select_victims(num_blocks=k, candidates=evictable).victim_ids
        assert len(victims) == min(k, len(evictable))
        assert len(set(victims)) == len(victims) and set(victims) <= evictable
        if victims and op == "e":
            # Evict what was chosen, as the runtime does.
            observe("sagellm_blocks_evicted", *(CachedBlock(v, v % 3, None, key=v % 5) for v in victims))
            evictable.difference_update(victims)
            cached.difference_update(victims)


def pages(*ids):
    """The tokens of 4-token pages with these ids."""
    return [t for i in ids for t in range(i * 4, i * 4 + 4)]


def test_belady_evicts_the_block_used_farthest_in_the_future():
    from sagellm_plugin_eviction.belady import BeladyEviction

    from sagellm_core.types import ROOT_KEY, chain_key

    # Pages A (1) and B (1, 2): A is used by every request, B by r0 and r1 only.
    future = [
        Request("r0", pages(1, 2, 3), 1),
        Request("r1", pages(1, 2) + [99], 1),
        Request("r2", pages(1, 8), 1),
        Request("r3", pages(1, 7), 1),
    ]
    oracle = BeladyEviction(None, PluginContext("belady", 4, 10, future_requests=lambda: iter(future)))

    def key(*hashes):
        k = ROOT_KEY
        for h in hashes:
            k = chain_key(k, array("q", range(h * 4, h * 4 + 4)).tobytes())
        return k

    a = CachedBlock(0, 0, None, key(1))
    b = CachedBlock(1, 1, 0, key(1, 2))
    oracle.sagellm_request_arrived(request=future[0])
    oracle.sagellm_blocks_released(blocks=(a, b))
    # After r0: A and B are both next used by r1; the deeper B goes first.
    assert oracle.sagellm_select_victims(num_blocks=1, candidates=EVERY_BLOCK).victim_ids == (1,)
    oracle.sagellm_request_arrived(request=future[1])
    oracle.sagellm_blocks_touched(blocks=(a, b))
    oracle.sagellm_blocks_released(blocks=(a, b))
    # After r1: B is never used again, A is used by r2.
    assert oracle.sagellm_select_victims(num_blocks=2, candidates=EVERY_BLOCK).victim_ids == (1, 0)
    assert oracle.sagellm_select_victims(num_blocks=2, candidates=EVERY_BLOCK).victim_ids == (1, 0)  # no side effects


def test_belady_knowing_only_whether_a_block_returns_keeps_lru_order_among_the_rest():
    """``knows = "whether"``: the block never used again goes first, as with
    Belady; the two that return go in release order, not by next use."""
    from sagellm_plugin_eviction.belady import BeladyEviction, BeladySettings

    from sagellm_core.types import ROOT_KEY, chain_key

    future = [Request(f"r{i}", pages(page), 1) for i, page in enumerate((1, 2, 3, 1, 3))]

    def block(block_id, page):
        return CachedBlock(block_id, 0, None, chain_key(ROOT_KEY, array("q", range(page * 4, page * 4 + 4)).tobytes()))

    def victims(knows):
        oracle = BeladyEviction(
            BeladySettings(knows=knows), PluginContext("belady", 4, 10, future_requests=lambda: iter(future))
        )
        for i, page in enumerate((1, 2, 3)):  # A, B, C released in turn; A is next used by r3, C by r4, B never
            oracle.sagellm_request_arrived(request=future[i])
            oracle.sagellm_blocks_released(blocks=(block(i, page),))
        return oracle.sagellm_select_victims(num_blocks=3, candidates=EVERY_BLOCK).victim_ids

    assert victims("when") == (1, 2, 0)
    assert victims("whether") == (1, 0, 2)


def test_belady_needs_the_future_and_does_not_import_the_replay():
    import subprocess
    import sys

    from sagellm_plugin_eviction.belady import BeladyEviction

    with pytest.raises(ValueError, match="belady needs the future requests"):
        BeladyEviction(None, CTX)
    # It gets the future through its context, not by importing the replay engine.
    code = "import sys, sagellm_plugin_eviction.belady; print('sagellm_core.replay' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_s3fifo_drops_one_hit_wonders_and_keeps_reused_blocks():
    ctx = PluginContext("s3fifo", 16, 20)  # small queue: 2 blocks
    policy = S3FIFOEviction(S3FIFOSettings(small_share=0.1), ctx)
    hot = CachedBlock(0, 0, None, key=100)
    policy.sagellm_blocks_cached(blocks=(hot,))
    policy.sagellm_blocks_touched(blocks=(hot,))  # hit while in S
    cold = tuple(CachedBlock(i, 0, None, key=100 + i) for i in range(1, 4))
    policy.sagellm_blocks_cached(blocks=cold)
    evictable = {0, 1, 2, 3}
    victims = policy.sagellm_select_victims(num_blocks=2, candidates=evictable).victim_ids
    assert 0 not in victims and len(victims) == 2  # the hit block was promoted to M
    policy.sagellm_blocks_evicted(blocks=tuple(CachedBlock(v, 0, None, key=100 + v) for v in victims))
    # A dropped block that comes back soon (its key is a ghost) starts in M.
    back = CachedBlock(9, 0, None, key=100 + victims[0])
    policy.sagellm_blocks_cached(blocks=(back,))
    assert 9 in policy._main


def test_s3fifo_chooses_block_zero():
    policy = S3FIFOEviction(S3FIFOSettings(), CTX)
    policy.sagellm_blocks_cached(blocks=(CachedBlock(0, 0, None),))
    assert policy.sagellm_select_victims(num_blocks=1, candidates={0}).victim_ids == (0,)


def test_policies_choose_only_among_the_blocks_offered():
    """An engine may offer fewer blocks than a policy tracks (LMDeploy's
    pinned checkpoint blocks): the choice skips the others."""
    for policy in (LRUEviction(None, CTX), LFUEviction(None, CTX), predictive(None, CTX)):
        timed = {"now_s": 0.0} if isinstance(policy, PredictiveEviction) else {}
        policy.sagellm_blocks_cached(blocks=chain(0, 3), **timed)
        policy.sagellm_blocks_released(blocks=chain(0, 3), now_s=0.0)
        if isinstance(policy, PredictiveEviction):
            # it offers leaves only: evict the leaf, then its parent is one
            assert policy.sagellm_select_victims(num_blocks=3, candidates=EVERY_BLOCK).victim_ids == (2,)
            continue
        everything = policy.sagellm_select_victims(num_blocks=3, candidates=EVERY_BLOCK).victim_ids
        assert len(everything) == 3
        offered = set(everything[1:])
        assert policy.sagellm_select_victims(num_blocks=3, candidates=offered).victim_ids == everything[1:]


def keyed(first, n, key0):
    return tuple(CachedBlock(first + i, i, first + i - 1 if i else None, key0 + i) for i in range(n))


def test_arc_keeps_reused_blocks_through_a_scan():
    """Blocks hit again (T2) survive a stream of blocks used once (T1): the
    scan's blocks go first, as ARC's recency list gives them up."""
    arc = ARCEviction(None, PluginContext("arc", block_size=16, num_blocks=4))
    hot = keyed(0, 2, 100)
    arc.sagellm_blocks_cached(blocks=hot)
    arc.sagellm_blocks_touched(blocks=hot)  # a second use: T2
    arc.sagellm_blocks_released(blocks=hot)
    scan = keyed(10, 2, 200)
    arc.sagellm_blocks_cached(blocks=scan)
    arc.sagellm_blocks_released(blocks=scan)
    assert arc.sagellm_select_victims(num_blocks=2, candidates=EVERY_BLOCK).victim_ids == (11, 10)
    assert arc.sagellm_select_victims(num_blocks=4, candidates=EVERY_BLOCK).victim_ids == (11, 10, 1, 0)


def test_arc_learns_from_its_ghosts():
    """A block cached again soon after T1 gave it up raises T1's target and
    comes back in T2."""
    arc = ARCEviction(None, PluginContext("arc", block_size=16, num_blocks=4))
    once = keyed(0, 1, 100)
    arc.sagellm_blocks_cached(blocks=once)
    arc.sagellm_blocks_released(blocks=once)
    arc.sagellm_blocks_evicted(blocks=once)
    assert arc.target_t1 == 0
    again = (CachedBlock(5, 0, None, 100),)  # the same content, in another block
    arc.sagellm_blocks_cached(blocks=again)
    assert arc.target_t1 == 1 and arc._class[5] == 2


def test_predictive_learns_which_blocks_come_back():
    """Blocks of one kind are hit again 10 s after release, those of another
    never (they are evicted at 30 s). Offered one of each, just as old, the
    policy evicts the kind that does not come back."""
    p = PredictiveEviction(PredictiveSettings(refit_every=50), CTX)
    now = 0.0
    for round_ in range(40):
        reused = CachedBlock(1000 + round_, 0, None, key=7)  # same content each round
        once = CachedBlock(2000 + round_, 0, None, key=10_000 + round_)
        p.sagellm_blocks_cached(blocks=(reused, once), now_s=now)
        p.sagellm_blocks_released(blocks=(reused, once), now_s=now)
        for _ in range(3):  # hit three times, 10 s apart
            now += 10.0
            p.sagellm_blocks_touched(blocks=(reused,), now_s=now)
            p.sagellm_blocks_released(blocks=(reused,), now_s=now)
        now += 30.0
        p.sagellm_blocks_evicted(blocks=(once, reused), now_s=now)
    reused, once = CachedBlock(1, 0, None, key=7), CachedBlock(2, 0, None, key=99_999)
    p.sagellm_blocks_cached(blocks=(reused, once), now_s=now)
    p.sagellm_blocks_released(blocks=(reused, once), now_s=now)
    assert p.sagellm_select_victims(num_blocks=1, candidates=EVERY_BLOCK).victim_ids == (2,)


class Conversations:
    """Drives a policy as the runtime does a request: its cached prefix is
    hit, its new blocks cached, then the whole chain released."""

    def __init__(self, policy):
        self.policy = policy
        self.next_id = 1

    def turn(self, now, previous=(), new_blocks=1):
        parent = previous[-1].block_id if previous else None
        new = []
        for depth in range(len(previous), len(previous) + new_blocks):
            new.append(CachedBlock(self.next_id, depth, parent, key=self.next_id))
            parent, self.next_id = self.next_id, self.next_id + 1
        if previous:
            self.policy.sagellm_blocks_touched(blocks=previous, now_s=now)
        self.policy.sagellm_blocks_cached(blocks=tuple(new), now_s=now)
        chain = tuple(previous) + tuple(new)
        self.policy.sagellm_blocks_released(blocks=chain, now_s=now)
        return chain


def test_continuation_learns_which_conversations_come_back():
    """Short first turns are continued 50 s later, long ones never. Offered
    the leaf of a fresh one of each, released together, the policy evicts
    the long one's: it has learnt that such turns end conversations."""
    p = ContinuationEviction(ContinuationSettings(), CTX)
    talk = Conversations(p)
    for round_ in range(200):
        now = 100.0 * round_
        short = talk.turn(now, new_blocks=2)
        talk.turn(now, new_blocks=8)  # never continued: labelled ended 600 s on
        talk.turn(now + 50.0, previous=short)
    now = 100.0 * 200
    short, long = talk.turn(now, new_blocks=2), talk.turn(now, new_blocks=8)
    talk.turn(now + 10.0, new_blocks=1)  # time moves on
    features = numpy.array([p._meta[c[-1].block_id].value.features for c in (short, long)])
    probability = p.continuation_probability(features)
    assert probability[0] > 0.6 > 0.3 > probability[1]
    offered = {short[-1].block_id, long[-1].block_id}
    assert p.sagellm_select_victims(num_blocks=1, candidates=offered).victim_ids == (long[-1].block_id,)
    # Asked for more, it takes the long chain from its leaf up, then the other's leaf.
    offered = {b.block_id for b in short + long}
    victims = p.sagellm_select_victims(num_blocks=9, candidates=offered).victim_ids
    assert victims == tuple(b.block_id for b in reversed(long)) + (short[-1].block_id,)


def test_continuation_keeps_a_turn_whose_next_one_is_due():
    """Every conversation's next turn comes 50 s after the last one. Of two
    first turns alike, one released 46 s ago and one 1 s ago, the policy
    evicts the fresh one, whose next turn is not due within its 20 s
    window; LRU would evict the older one, just before its reuse."""
    p = ContinuationEviction(ContinuationSettings(reuse_window_s=20.0), CTX)
    talk = Conversations(p)
    for round_ in range(200):
        now = 100.0 * round_
        talk.turn(now + 50.0, previous=talk.turn(now, new_blocks=3))
    now = 100.0 * 200
    due, fresh = talk.turn(now, new_blocks=3), talk.turn(now + 45.0, new_blocks=3)
    talk.turn(now + 46.0, new_blocks=1)
    offered = {due[-1].block_id, fresh[-1].block_id}
    assert p.sagellm_select_victims(num_blocks=1, candidates=offered).victim_ids == (fresh[-1].block_id,)
    lru = LRUEviction(None, CTX)
    lru.sagellm_blocks_released(blocks=due, now_s=now)
    lru.sagellm_blocks_released(blocks=fresh, now_s=now + 45.0)
    assert lru.sagellm_select_victims(num_blocks=1, candidates=offered).victim_ids == (due[-1].block_id,)


def test_continuation_does_not_take_a_shared_prefix_for_a_conversation():
    """Once a system prompt has been extended two ways, a prompt that
    extends it is a first turn, not its next one, and a prompt that is the
    system prompt alone is no turn to label: every prompt reuses it."""
    p = ContinuationEviction(ContinuationSettings(), CTX)
    talk = Conversations(p)

    def turns(chain):
        return p._meta[chain[-1].block_id].value.turns

    system = talk.turn(0.0, new_blocks=1)
    # The first prompt to extend it cannot be told from a next turn.
    assert turns(talk.turn(1.0, previous=system, new_blocks=2)) == 2
    assert turns(talk.turn(2.0, previous=system, new_blocks=2)) == 1  # a branch
    talk.turn(3.0, previous=system, new_blocks=0)
    assert system[-1].key not in p._pending
    assert turns(talk.turn(4.0, previous=system, new_blocks=2)) == 1


def test_continuation_finds_a_next_turn_that_leaves_the_chain_before_its_output():
    """Where an engine caches a turn's output too, the next prompt hits the
    previous turn's prompt and leaves its chain before the end: a next turn
    when it covers half of that chain or more, a first turn when less."""
    p = ContinuationEviction(ContinuationSettings(), CTX)
    talk = Conversations(p)
    earlier = talk.turn(0.0, new_blocks=4)  # 3 prompt blocks and 1 of output

    def turns(chain):
        return p._meta[chain[-1].block_id].value.turns

    assert turns(talk.turn(1.0, previous=earlier[:1], new_blocks=3)) == 1
    assert earlier[-1].key in p._pending
    gaps = p.gaps.sum()
    assert turns(talk.turn(50.0, previous=earlier[:3], new_blocks=2)) == 2
    assert earlier[-1].key not in p._pending and p.gaps.sum() == gaps + 1  # labelled continued, its gap seen


def test_continuation_takes_observations_that_do_not_fit_a_tree():
    """A chain released after a pending turn with its content key but deeper
    (keys that do not fit a prefix tree, as a benchmark's made-up blocks) is
    a next turn that added nothing, not an error."""
    p = ContinuationEviction(ContinuationSettings(), CTX)
    deep, shallow = CachedBlock(1, 5, None, key=7), CachedBlock(2, 0, None, key=7)
    for now, block in enumerate((deep, shallow)):
        p.sagellm_blocks_cached(blocks=(block,), now_s=float(now))
        p.sagellm_blocks_released(blocks=(block,), now_s=float(now))
    assert p._meta[2].value.turns == 2
    assert set(p.sagellm_select_victims(num_blocks=2, candidates=EVERY_BLOCK).victim_ids) == {1, 2}


def tenant_chain(first, n, tenant):
    return tuple(CachedBlock(first + i, i, first + i - 1 if i else None, first + i, tenant=tenant) for i in range(n))


def test_fair_takes_from_the_tenant_furthest_over_its_share():
    p = FairEviction(FairSettings(), CTX)
    big, small = tenant_chain(0, 6, "big"), tenant_chain(100, 2, "small")
    for blocks in (big, small):
        p.sagellm_blocks_cached(blocks=blocks)
    p.sagellm_blocks_released(blocks=small)  # released first: LRU would take these
    p.sagellm_blocks_released(blocks=big)
    # big holds 6, small 2: the four victims come from big, leaf first.
    assert p.sagellm_select_victims(num_blocks=4, candidates=EVERY_BLOCK).victim_ids == (5, 4, 3, 2)
    # Weighted 3:1, big's share is three times small's: 6/3 = 2 = small's 2/1;
    # ties go to the tenant named last, and then they alternate.
    weighted = FairEviction(FairSettings(weights={"big": 3}), CTX)
    for blocks in (big, small):
        weighted.sagellm_blocks_cached(blocks=blocks)
        weighted.sagellm_blocks_released(blocks=blocks)
    assert weighted.sagellm_select_victims(num_blocks=2, candidates=EVERY_BLOCK).victim_ids == (101, 5)


def test_fair_forgets_evicted_blocks_and_skips_what_is_not_offered():
    p = FairEviction(FairSettings(), CTX)
    big, small = tenant_chain(0, 4, "big"), tenant_chain(100, 1, "small")
    for blocks in (big, small):
        p.sagellm_blocks_cached(blocks=blocks)
        p.sagellm_blocks_released(blocks=blocks)
    p.sagellm_blocks_evicted(blocks=big[2:])
    assert p.usage() == {"big": 2, "small": 1}
    assert p.sagellm_select_victims(num_blocks=1, candidates={0, 100}).victim_ids == (0,)


def test_cost_keeps_the_block_used_more_and_then_the_deeper_one():
    p = CostAwareEviction(CostSettings(context_cost=1e-3), CTX)
    shallow, deep, hot = CachedBlock(1, 0, None, 1), CachedBlock(2, 40, None, 2), CachedBlock(3, 0, None, 3)
    p.sagellm_blocks_cached(blocks=(shallow, deep, hot))
    p.sagellm_blocks_released(blocks=(shallow, deep, hot))
    for _ in range(2):
        p.sagellm_blocks_touched(blocks=(hot,))
        p.sagellm_blocks_released(blocks=(hot,))
    # One use each, but the block at depth 40 costs 1.65x as much to recompute.
    assert p.cost(40) == pytest.approx(1 + 1e-3 * 16 * 40.5)
    assert p.sagellm_select_victims(num_blocks=3, candidates=EVERY_BLOCK).victim_ids == (1, 2, 3)
    # Evicting raises the clock to the victim's priority: a block released
    # afterwards outranks one used as often before.
    p.sagellm_blocks_evicted(blocks=(shallow,))
    assert p.clock == pytest.approx(1.0 + 1e-3 * 16 * 0.5)
    again = CachedBlock(4, 0, None, 1)  # the evicted content, cached again: its use is remembered
    p.sagellm_blocks_cached(blocks=(again,))
    p.sagellm_blocks_released(blocks=(again,))
    assert p._meta[4].uses == 2
    assert p.sagellm_select_victims(num_blocks=1, candidates=EVERY_BLOCK).victim_ids == (2,)


def test_cost_evicts_leaves_only_and_choosing_changes_nothing():
    p = CostAwareEviction(CostSettings(), CTX)
    a = chain(0, 3)
    p.sagellm_blocks_cached(blocks=a)
    p.sagellm_blocks_released(blocks=a)
    assert p.sagellm_select_victims(num_blocks=3, candidates=EVERY_BLOCK).victim_ids == (2,)
    assert p.sagellm_select_victims(num_blocks=3, candidates=EVERY_BLOCK).victim_ids == (2,)
    assert p.sagellm_select_victims(num_blocks=3, candidates={0, 1}).victim_ids == ()
    p.sagellm_blocks_evicted(blocks=(a[2],))
    assert p.sagellm_select_victims(num_blocks=3, candidates=EVERY_BLOCK).victim_ids == (1,)


def test_slo_holds_back_waiting_prefixes_and_gives_up_those_without_a_chance_first():
    p = SLOEviction(None, CTX)
    old, waited_for = chain(0, 2), chain(10, 2)
    p.sagellm_blocks_released(blocks=waited_for, now_s=0.0)  # least recent: LRU's first victims
    p.sagellm_blocks_released(blocks=old, now_s=1.0)
    request = Request("r", list(range(40)), 1, arrival_s=2.0, deadline_s=7.0)
    p.sagellm_request_arrived(request=request, prediction=None, match=PrefixMatch(waited_for))
    assert p.deadline(10) == 7.0 and p.deadline(0) is None
    assert p.sagellm_select_victims(num_blocks=2, candidates=EVERY_BLOCK).victim_ids == (1, 0)
    # Only held-back blocks left: they go, leaf first, rather than nothing.
    assert p.sagellm_select_victims(num_blocks=4, candidates=EVERY_BLOCK).victim_ids == (1, 0, 11, 10)
    # A waiting request without a deadline holds its prefix back too, but
    # gives it up before one that can still meet its deadline.
    p.sagellm_request_arrived(request=Request("n", [1] * 40, 1, arrival_s=2.0), prediction=None, match=PrefixMatch(old))
    assert p.sagellm_select_victims(num_blocks=2, candidates=EVERY_BLOCK).victim_ids == (1, 0)
    # Past its deadline, r's prefix is worth no more than n's: LRU order among them.
    p.sagellm_blocks_touched(blocks=(), now_s=7.5)
    assert p.deadline(10) is None
    assert p.sagellm_select_victims(num_blocks=2, candidates=EVERY_BLOCK).victim_ids == (11, 10)


def test_slo_gives_up_the_most_slack_first_and_forgets_finished_requests():
    p = SLOEviction(None, CTX)
    urgent, relaxed, free = chain(0, 1), chain(10, 1), chain(20, 1)
    p.sagellm_blocks_released(blocks=urgent + relaxed, now_s=0.0)
    for rid, blocks, deadline in (("u", urgent, 3.0), ("r", relaxed, 30.0)):
        p.sagellm_request_arrived(
            request=Request(rid, [1] * 40, 1, deadline_s=deadline), prediction=None, match=PrefixMatch(blocks)
        )
    assert p.sagellm_select_victims(num_blocks=1, candidates=EVERY_BLOCK).victim_ids == (10,)
    p.sagellm_blocks_released(blocks=free, now_s=1.0)
    assert p.sagellm_select_victims(num_blocks=1, candidates=EVERY_BLOCK).victim_ids == (20,)
    outcome = RequestOutcome(Request("r", [1] * 40, 1, deadline_s=30.0), 1, 0, 0.0, 1.0, 1.0, 0, None)
    p.sagellm_request_finished(outcome=outcome)  # its prefix is LRU's again, just released
    assert p.deadline(10) is None and p._guarded.keys() == {"u"}
    assert p.sagellm_select_victims(num_blocks=3, candidates=EVERY_BLOCK).victim_ids == (20, 10, 0)
    assert (
        p.sagellm_request_arrived(request=Request("x", [1], 1, deadline_s=1.0), prediction=None, match=EMPTY_MATCH)
        is None
    )
    p.sagellm_blocks_evicted(blocks=urgent)
    assert p.deadline(0) is None and 0 not in p._guards


def test_fair_reads_the_tenant_field_and_shares_out_shared_blocks_as_one():
    p = FairEviction(FairSettings(), CTX)
    # The namespace does not matter; a shared block (tenant None) counts under "".
    a = tuple(CachedBlock(i, i, i - 1 if i else None, i, "tenant=zzz", tenant="a") for i in range(3))
    shared = (CachedBlock(10, 0, None, 10, "tenant=a"),)
    for blocks in (a, shared):
        p.sagellm_blocks_cached(blocks=blocks)
        p.sagellm_blocks_released(blocks=blocks)
    assert p.usage() == {"a": 3, "": 1}
    assert p.sagellm_select_victims(num_blocks=4, candidates=EVERY_BLOCK).victim_ids == (2, 1, 0, 10)


def continuation_with_history():
    """A continuation policy after conversations of many shapes: first turns
    of 1 to 6 blocks, some continued after 5 to 400 s, some released at
    once (ties), some older than the label window; every fifth round, the
    first turn of five rounds before evicted, so that a later turn takes
    its row and rows are not in release order."""
    p = ContinuationEviction(ContinuationSettings(), PluginContext("p", block_size=16, num_blocks=10_000))
    talk = Conversations(p)
    rng = numpy.random.default_rng(7)
    firsts = {}
    for round_ in range(120):
        now = 30.0 * round_
        first = firsts[round_] = talk.turn(now, new_blocks=int(rng.integers(1, 7)))
        talk.turn(now, new_blocks=2)  # released at the same time as the first
        talk.turn(now, new_blocks=2)  # and alike: equal values
        if rng.random() < 0.6:
            talk.turn(now + float(rng.uniform(5.0, 400.0)), previous=first, new_blocks=int(rng.integers(0, 4)))
        if round_ % 5 == 0 and round_ >= 5:
            p.sagellm_blocks_evicted(blocks=tuple(reversed(firsts[round_ - 5])), now_s=now)
    return p


def reference_values(p):
    """The module docstring's formula, as written, with numpy.interp."""
    from sagellm_plugin_eviction.ages import AGE_BINS, AGE_UNIT_S

    n = len(p._with_leaves)
    ages = numpy.maximum(p._now - p._released_at[:n], 0.0)
    prob = 1.0 / (1.0 + numpy.exp(-(p._features[:n] @ p.weights)))
    tail = numpy.append(numpy.cumsum(p.gaps[::-1])[::-1], 0.0) / p.gaps.sum()

    def survival(a):
        position = 2.0 * numpy.log2(1.0 + a / AGE_UNIT_S)
        return numpy.maximum(numpy.interp(position, numpy.arange(AGE_BINS + 1, dtype=float), tail), 1e-9)

    still, later = survival(ages), survival(ages + p.settings.reuse_window_s)
    alive = prob * still / (1.0 - prob + prob * still)
    return alive * (1.0 - later / still)


@pytest.mark.parametrize("now", [3600.0, 3610.0, 4000.0, 100.0])  # the last: a clock gone back
def test_continuation_values_are_the_formulas_to_the_bit(now):
    """values() works in place and interpolates S by index; its figures
    must be the formula's exactly, or victims (and hit rates) could move."""
    p = continuation_with_history()
    at_the_end = p.values()
    assert (at_the_end == 0.0).any() and (at_the_end > 0.0).any()  # turns past S's reach, and live ones
    p._now = now
    assert numpy.array_equal(p.values(), reference_values(p))


@pytest.mark.parametrize("wanted", [1, 2, 5, 40, 10_000])
@pytest.mark.parametrize("now, least", [(100.0, 1), (500.0, 2), (3620.0, 292)])
def test_continuation_orders_turns_by_value_then_age_whatever_it_is_asked_for(wanted, now, least):
    """The rows come least value first, then oldest release, then first
    opened, however many victims are asked for (a partial sort or a full
    one), whether the least value is one turn's (found alone) or shared."""
    p = continuation_with_history()
    p._now = now
    n = len(p._with_leaves)
    values = reference_values(p)
    assert numpy.count_nonzero(values == values.min()) == least
    expected = numpy.lexsort((p._opened[:n], p._released_at[:n], values)).tolist()
    assert list(p._by_value(n, wanted)) == expected


@pytest.mark.parametrize(
    "make", [lambda: LRUEviction(None, CTX), lambda: LFUEviction(None, CTX), lambda: FairEviction(FairSettings(), CTX)]
)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(1, 4)), min_size=1, max_size=8),
    st.lists(st.integers(0, 40), unique=True, max_size=12),
)
def test_a_policy_that_follows_moves_keeps_its_order_under_the_new_ids(make, releases, moved):
    """After a compacting pool moves evictable blocks, the victims are the
    same blocks in the same order, under their new ids."""
    order, plain = make(), make()
    block_id = 0
    for tenant, length in releases:
        chain = tuple(CachedBlock(block_id + i, i, None, block_id + i, "", f"t{tenant}") for i in range(length))
        block_id += length
        for policy in (order, plain):
            policy.sagellm_blocks_cached(blocks=chain)
            released = policy.sagellm_blocks_released  # with the arguments it names, as pluggy passes them
            kwargs = {"blocks": chain, "now_s": float(block_id)}
            released(**{k: v for k, v in kwargs.items() if k in inspect.signature(released).parameters})
    moves = tuple((b, 1000 + b) for b in moved if b < block_id)
    order.sagellm_blocks_moved(moves=moves)
    renamed = dict(moves)
    everything = set(range(block_id)) | {1000 + b for b in range(block_id)}
    before = plain.sagellm_select_victims(num_blocks=block_id, candidates=everything).victim_ids
    after = order.sagellm_select_victims(num_blocks=block_id, candidates=everything).victim_ids
    assert after == tuple(renamed.get(b, b) for b in before)
