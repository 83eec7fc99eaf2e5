"""The hint-aware policy, hook by hook: released conversations go first (not
what they share), retention holds until its deadline and then gives way,
pins hold within their budget until unpinned or expired, and wrong advice
is switched off by the shadow caches' judge."""

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from sagellm_plugin_eviction.adaptive import ShadowCache, _Expert
from sagellm_plugin_eviction.hints import HintEviction, HintSettings, ReleaseOutcomes
from sagellm_plugin_eviction.lru import LRUEviction

from sagellm_core import PluginContext
from sagellm_core.types import EMPTY_MATCH, CachedBlock, KVHints, PrefixMatch, Request, RequestOutcome

CTX = PluginContext("p", block_size=4, num_blocks=100)
#: A pool of six blocks: a released block's window closes after six evictions.
SMALL = PluginContext("p", block_size=4, num_blocks=6)


class EveryBlock:
    def __contains__(self, block_id: object) -> bool:
        return True

    def __len__(self) -> int:
        return 1 << 30


EVERY_BLOCK = EveryBlock()


def chain(first, n, start_depth=0, parent=None, key=None):
    blocks = []
    for i in range(n):
        blocks.append(CachedBlock(first + i, start_depth + i, parent, key=(key or first) * 1000 + i))
        parent = first + i
    return tuple(blocks)


def request(rid, session, hints=None, prompt=40, tenant="t"):
    return Request(rid, list(range(prompt)), 1, session_id=session, kv_hints=hints, tenant=tenant)


def finish(policy, req, now=0.0):
    policy.sagellm_request_finished(RequestOutcome(req, 1, 0, req.arrival_s, now, now, 0, None))


def serve(policy, req, blocks, now, match=EMPTY_MATCH, cached=None):
    """A request's life as the runtime reports it: arrival (its match),
    its new blocks cached, its matched ones touched, all released, finished."""
    policy.sagellm_request_arrived(req, match)
    policy.sagellm_blocks_touched(match.blocks, now)
    policy.sagellm_blocks_cached(blocks if cached is None else cached, now)
    policy.sagellm_blocks_released(blocks, now, req)
    finish(policy, req, now)


def victims(policy, k):
    return policy.sagellm_select_victims(k, EVERY_BLOCK).victim_ids


def evict(policy, ids, now=0.0):
    policy.sagellm_blocks_evicted(tuple(CachedBlock(i, 0, None) for i in ids), now)


def test_a_released_conversations_own_blocks_go_first_and_what_it_shares_stays():
    policy = HintEviction(HintSettings(judged=False), CTX)
    system = chain(0, 2)
    a_own, b_own = chain(10, 3, 2, parent=1), chain(20, 3, 2, parent=1)
    serve(policy, request("a1", "A"), system + a_own, 1.0, cached=system + a_own)
    serve(policy, request("b1", "B"), system + b_own, 2.0, match=PrefixMatch(system), cached=b_own)
    serve(
        policy,
        request("a2", "A", KVHints(release=True)),
        system + a_own,
        3.0,
        match=PrefixMatch(system + a_own),
        cached=(),
    )
    # A's own blocks first, leaf first; then LRU's order, B's own leaf first (B
    # released before A's last turn), and the system prompt B used last.
    assert victims(policy, 3) == (12, 11, 10)
    evict(policy, (12, 11, 10))
    assert victims(policy, 3) == (22, 21, 20)


def test_a_release_waits_for_its_request_to_finish():
    policy = HintEviction(HintSettings(judged=False), CTX)
    old, mine = chain(0, 2), chain(10, 2)
    serve(policy, request("x", "X"), old, 1.0)
    ending = request("y", "Y", KVHints(release=True))
    policy.sagellm_request_arrived(ending, EMPTY_MATCH)
    policy.sagellm_blocks_cached(mine, 2.0)
    policy.sagellm_blocks_released(mine, 2.0, ending)  # preempted: it comes back
    assert victims(policy, 2) == (1, 0)
    finish(policy, ending, 3.0)
    assert victims(policy, 2) == (11, 10)


def test_retained_blocks_outlast_unhinted_ones_until_their_deadline():
    policy = HintEviction(HintSettings(judged=False), CTX)
    kept, newer = chain(0, 2), chain(10, 2)
    serve(policy, request("k", "K", KVHints(retain_s=5.0)), kept, 1.0)
    serve(policy, request("n", "N"), newer, 2.0)
    assert victims(policy, 2) == (11, 10)  # the older blocks are retained
    policy.sagellm_blocks_touched((), 7.0)  # time passes: the retention has ended at 6
    assert victims(policy, 4) == (11, 10, 1, 0)  # back in LRU's order, as released when it ended


def test_retention_gives_way_last_the_soonest_ending_first():
    policy = HintEviction(HintSettings(judged=False), CTX)
    long, short = chain(0, 2), chain(10, 2)
    serve(policy, request("l", "L", KVHints(retain_s=50.0)), long, 1.0)
    serve(policy, request("s", "S", KVHints(retain_s=5.0)), short, 2.0)
    assert victims(policy, 3) == (11, 10, 1)  # nothing unprotected is left


def test_a_pin_holds_until_unpinned_and_the_budget_refuses_a_pin_whole():
    ctx = PluginContext("p", block_size=4, num_blocks=40)  # a tenant may pin 10 blocks
    policy = HintEviction(HintSettings(judged=False, pin_share=0.25), ctx)
    pinned = request("p", "P", KVHints(pin=8))  # the prompt's first two blocks
    keys = policy._prefix_keys(pinned, (), 8)
    prefix = tuple(CachedBlock(i, i, i - 1 if i else None, key=k) for i, k in enumerate(keys))
    serve(policy, pinned, prefix, 1.0)
    serve(policy, request("o", "O"), chain(10, 2), 2.0)
    assert policy.pinned_keys("t") == frozenset(keys)
    assert victims(policy, 10) == (11, 10)  # never the pinned prefix
    too_long = Request("big", list(range(100, 140)), 1, kv_hints=KVHints(pin=40), tenant="t")
    policy.sagellm_request_arrived(too_long, EMPTY_MATCH)  # 10 more blocks: past the 10 a tenant may pin
    assert policy.pins_refused == 1 and policy.pinned_keys("t") == frozenset(keys)
    policy.sagellm_request_arrived(request("u", "P", KVHints(unpin=8)), EMPTY_MATCH)
    assert policy.pinned_keys() == frozenset() and victims(policy, 10) == (11, 10, 1, 0)


def test_a_pin_expires_its_ttl_after_its_last_request_ended():
    policy = HintEviction(HintSettings(judged=False, pin_ttl_s=10.0), CTX)
    pinned = request("p", "P", KVHints(pin=8))
    keys = policy._prefix_keys(pinned, (), 8)
    prefix = tuple(CachedBlock(i, i, i - 1 if i else None, key=k) for i, k in enumerate(keys))
    serve(policy, pinned, prefix, 1.0)
    policy.sagellm_blocks_touched((), 10.5)
    assert victims(policy, 2) == ()  # 9.5 s after it ended: still pinned
    policy.sagellm_blocks_touched((), 11.5)
    assert victims(policy, 2) == (1, 0) and policy.pinned_keys() == frozenset()


def test_a_pin_of_blocks_already_evictable_takes_them_out_of_the_order():
    policy = HintEviction(HintSettings(judged=False), CTX)
    plain = request("a", "A")
    keys = policy._prefix_keys(plain, (), 8)
    prefix = tuple(CachedBlock(i, i, i - 1 if i else None, key=k) for i, k in enumerate(keys))
    serve(policy, plain, prefix, 1.0)
    policy.sagellm_request_arrived(request("p", "B", KVHints(pin=8)), PrefixMatch(prefix))
    assert victims(policy, 2) == ()


def test_without_hints_it_chooses_as_lru():
    policy = _Expert("hints", HintEviction(HintSettings(fallback="lru"), CTX))
    lru = _Expert("lru", LRUEviction(None, CTX))
    for t, first in enumerate((0, 10, 20)):
        blocks = chain(first, 3)
        for p in (policy, lru):
            p.tell("sagellm_blocks_cached", blocks, float(t))
            p.tell("sagellm_blocks_released", blocks, float(t), request(f"r{t}", "s"))
    assert policy.select(5, EVERY_BLOCK).victim_ids == lru.select(5, EVERY_BLOCK).victim_ids == (2, 1, 0, 12, 11)


@pytest.mark.parametrize("release_window", [1.0, 0.0])
def test_releases_of_a_tenant_whose_released_blocks_come_back_are_not_followed(release_window):
    """The tenant ``liar`` releases conversation L, whose blocks are evicted
    first, and L comes back for them while the fallback's victims so far
    did not: once the window of L's released blocks has closed (six
    evictions, the pool's size), liar's next release is not followed (LRU's
    order stands: L's first turn, cached again, and U go first), while
    ``honest``'s is, none of its released blocks having come back
    (``release_window = 0``: every release is followed)."""
    policy = HintEviction(HintSettings(judged=False, release_window=release_window), SMALL)
    first_turn = chain(0, 2)
    serve(policy, request("l0", "L", KVHints(release=True), tenant="liar"), first_turn, 0.0)
    assert victims(policy, 2) == (1, 0)
    evict(policy, (1, 0))
    serve(policy, request("l1", "L", tenant="liar"), first_turn, 1.0)  # cached again: it came back
    assert policy.outcomes.share_back("liar") == 0.0  # counted when its window closes, as a victim's return
    evict(policy, (90, 91, 92))
    assert policy.outcomes.share_back("liar") == 0.0  # five evictions: still open
    evict(policy, (93,))
    serve(policy, request("u", "U", tenant="honest"), chain(50, 2), 2.5)
    serve(policy, request("l2", "L", KVHints(release=True), tenant="liar"), chain(60, 2), 3.0)
    assert victims(policy, 2) == ((1, 0) if release_window else (61, 60))
    serve(policy, request("h", "H", KVHints(release=True), tenant="honest"), chain(70, 2), 4.0)
    first = (71, 70) if release_window else (61, 60, 71, 70)  # honest's release is followed either way
    assert victims(policy, len(first)) == first
    if release_window:
        assert policy.outcomes.follows("honest") and not policy.outcomes.follows("liar")
        # two back, counted at six evictions; the one right release assumed at 0 has decayed by half a half-life
        assert policy.outcomes.share_back("liar") == pytest.approx(2 / (2 + 0.5**0.5))


def test_a_released_block_used_again_before_following_would_have_evicted_it_costs_nothing():
    """B's blocks stand behind A's in the released order; B comes back after
    one eviction, before following B's release would have reached them: no
    outcome is counted, and liar's releases are still followed."""
    policy = HintEviction(HintSettings(judged=False), CTX)
    serve(policy, request("a", "A", KVHints(release=True), tenant="liar"), chain(10, 2), 1.0)
    serve(policy, request("b", "B", KVHints(release=True), tenant="liar"), chain(20, 2), 2.0)
    evict(policy, (11,))
    b_turn = chain(20, 2)
    serve(policy, request("b2", "B", tenant="liar"), b_turn, 3.0, match=PrefixMatch(b_turn), cached=())
    assert policy.outcomes.share_back("liar") == 0.0 and policy.outcomes.follows("liar")


def test_a_tenant_no_longer_followed_has_its_released_blocks_put_back_in_the_fallbacks_order():
    """A release followed while the tenant was trusted is withdrawn once its
    releases prove wrong: the blocks go back to LRU's order, not first."""
    policy = HintEviction(HintSettings(judged=False), SMALL)
    serve(policy, request("old", "O"), chain(0, 2), 0.0)
    for t, (session, first) in enumerate((("A", 10), ("B", 20), ("C", 40))):
        serve(policy, request(session.lower(), session, KVHints(release=True), tenant="liar"), chain(first, 2), 1.0 + t)
    assert victims(policy, 4) == (11, 10, 21, 20)  # followed: nothing of liar's has come back yet
    evict(policy, (11, 10, 21, 20))
    serve(policy, request("b2", "B", tenant="liar"), chain(20, 2), 4.0)  # B cached again: it came back
    assert victims(policy, 2) == (41, 40)  # still followed while B's window is open
    evict(policy, (90, 91))  # six evictions: B's return counts
    assert victims(policy, 4) == (1, 0, 41, 40)  # C's release is withdrawn too


def test_the_fallbacks_victims_that_come_back_make_releases_pay():
    """A victim of the fallback cached again within the window counts as a
    hit the fallback lost, once its window closes; one that is not, as a
    right eviction: the fallback's share is what a release is held to."""
    outcomes = ReleaseOutcomes(window=4, half_life=1e9)
    outcomes.released("t", list(chain(0, 1)), 0)  # watching from the first release on
    evicted = chain(10, 4)
    outcomes.evicted(evicted, {b.block_id for b in evicted})
    outcomes.cached(evicted[:1])  # the first victim needed again
    assert outcomes.share_back(None) == 0.0  # not judged before its window closes
    outcomes.evicted(chain(20, 4), set())  # four more evictions, by releases: the window closes
    assert outcomes.share_back(None) == 1 / 4
    assert outcomes.share_back("t") == 0.0 and outcomes.follows("t")  # t's released block did not come back


def test_settings_name_a_bad_release_window():
    with pytest.raises(ValueError, match="release_window"):
        HintSettings(release_window=-1)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"fallback": "nope"}, "fallback = 'nope': one of lru"),
        ({"pin_share": 0.8}, "pin_share"),
        ({"pin_ttl_s": 0}, "pin_ttl_s"),
        ({"release_window": -0.5}, "release_window"),
    ],
)
def test_settings_are_checked(settings, message):
    with pytest.raises((ValueError, TypeError), match=message):
        HintSettings(**settings)


def test_the_fallback_may_be_adaptive_with_settings():
    policy = HintEviction(HintSettings(fallback='adaptive:experts=["lru","s3fifo"]'), CTX)
    assert [e.name for e in policy.fallback.policy.experts] == ["lru", "s3fifo"]


def wrongly_released(rounds=20, hot=10, scans=5):
    """``hot`` conversations that come back every round (a block longer each
    time) though every turn says it is the last, among one-shot scans of
    10 blocks that say nothing."""
    unique = 1 << 40
    for r in range(rounds):
        for c in range(hot):
            keys = [c * 10_000 + i for i in range(6 + r)]
            yield keys, Request(f"c{c}-{r}", [1], 1, session_id=f"c{c}", kv_hints=KVHints(release=True))
            if c % (hot // scans) == 0:
                yield [unique + i for i in range(10)], Request(f"scan{unique}", [1], 1)
                unique += 1000


def hits(policy, trace, capacity):
    cache = ShadowCache(_Expert("under test", policy), capacity)
    total = 0
    for t, (keys, req) in enumerate(trace):
        total += cache.play(keys, float(t), req)
        if isinstance(policy, HintEviction):
            policy.sagellm_request_finished(RequestOutcome(req, 1, 0, 0.0, float(t), float(t), 0, None))
    return total


def test_the_judge_switches_wrong_advice_off():
    """The advice says every hot conversation is over, and each comes back:
    followed blindly it costs most of LRU's hits; the judge's shadow caches
    see it losing and the policy drops it, within 1% of LRU."""
    capacity = 300
    ctx = PluginContext("p", block_size=4, num_blocks=capacity)
    lru = hits(LRUEviction(None, ctx), wrongly_released(), capacity)
    blind = hits(HintEviction(HintSettings(judged=False, release_window=0), ctx), wrongly_released(), capacity)
    judged_policy = HintEviction(HintSettings(release_window=0), ctx)  # the shadow caches' judge alone
    judged = hits(judged_policy, wrongly_released(), capacity)
    assert blind < 0.7 * lru
    assert judged >= 0.99 * lru and not judged_policy.advice and judged_policy.switches


def released_by_two_tenants(rounds: int, hot: int, one_shots: int, scan_every: int, length: int):
    """``liar`` keeps ``hot`` conversations going though every turn says it
    is the last; ``honest`` sends one-shot conversations that say so
    truthfully; and scans of ``length`` blocks say nothing and never recur."""
    unique = 1 << 40
    for r in range(rounds):
        for c in range(hot):
            keys = [c * 10_000 + i for i in range(length + r)]
            yield keys, Request(f"c{c}-{r}", [1], 1, session_id=f"c{c}", kv_hints=KVHints(release=True), tenant="liar")
            if c % scan_every == 0:
                yield [unique + i for i in range(length)], Request(f"scan{unique}", [1], 1, tenant="other")
                unique += 1000
        for o in range(one_shots):
            keys = [(1 << 30) + (r * one_shots + o) * 1000 + i for i in range(length)]
            yield (
                keys,
                Request(f"o{r}-{o}", [1], 1, session_id=f"o{r}-{o}", kv_hints=KVHints(release=True), tenant="honest"),
            )


@settings(max_examples=25, deadline=None)
@given(
    rounds=st.integers(6, 16),
    hot=st.integers(2, 10),
    one_shots=st.integers(0, 3),
    scan_every=st.integers(1, 3),
    length=st.integers(3, 10),
    capacity=st.integers(60, 300),
)
def test_wrong_releases_stop_being_followed_and_right_ones_do_not(rounds, hot, one_shots, scan_every, length, capacity):
    """Whatever the mix and the capacity: the tenant whose released blocks
    come back stops being followed, so the policy (the shadow caches' judge
    off: this judge alone) keeps LRU's hits less at most what its first two
    rounds of wrong releases can cost; the tenant whose releases prove right
    is still followed."""
    ctx = PluginContext("p", block_size=4, num_blocks=capacity)
    trace = lambda: released_by_two_tenants(rounds, hot, one_shots, scan_every, length)  # noqa: E731
    lru = hits(LRUEviction(None, ctx), trace(), capacity)
    policy = HintEviction(HintSettings(judged=False), ctx)
    judged = hits(policy, trace(), capacity)
    assert judged >= lru - 2 * hot * (length + 2)
    outcomes = policy.outcomes
    if outcomes.evictions:
        assert not outcomes.follows("liar") or outcomes.share_back("liar") <= outcomes.share_back(None)
    if one_shots:
        assert outcomes.follows("honest") and outcomes.share_back("honest") == 0.0


def test_without_the_release_judge_the_wrong_releases_cost_most_of_lrus_hits():
    """The property above is not vacuous: on one of its traces, following
    every release (``release_window = 0``) loses most of LRU's hits, and the
    judge keeps them, the liar's releases off, the honest tenant's on."""
    capacity = 150
    ctx = PluginContext("p", block_size=4, num_blocks=capacity)
    trace = lambda: released_by_two_tenants(12, 8, 2, 2, 6)  # noqa: E731
    lru = hits(LRUEviction(None, ctx), trace(), capacity)
    blind = hits(HintEviction(HintSettings(judged=False, release_window=0), ctx), trace(), capacity)
    policy = HintEviction(HintSettings(judged=False), ctx)
    judged = hits(policy, trace(), capacity)
    assert blind < 0.7 * lru and judged >= 0.95 * lru
    assert not policy.outcomes.follows("liar") and policy.outcomes.follows("honest")
