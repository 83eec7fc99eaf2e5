"""The request-aware dead-block predictor learns, from the requests that
released blocks, which sessions' blocks never come back, and demotes them
in LRU's order; it reads no future request."""

import random

import hypothesis.strategies as st
from hypothesis import given, settings
from sagellm_plugin_eviction import revisit
from sagellm_plugin_eviction.adaptive import AdaptiveEviction, AdaptiveSettings, ShadowCache, _Expert
from sagellm_plugin_eviction.revisit import RevisitEviction, RevisitSettings

from sagellm_core import PluginContext
from sagellm_core.types import CachedBlock, Request

CAPACITY = 150


def no_future():
    raise AssertionError("an online policy read the future requests")


def context(capacity=CAPACITY):
    # the future is there to be read, and reading it fails the test
    return PluginContext("p", block_size=16, num_blocks=capacity, future_requests=no_future)


def sessions_trace(seed=0, sessions=400, one_shot_share=0.6, batch_sessions=True):
    """Chat sessions of 6 turns (tenant "chat": each turn's prompt extends
    the last by 2 blocks), 8 of them live at a time, interleaved with
    single-turn sessions of 10 unique blocks (tenant "batch": never back).
    Returns (keys, request) per request, in arrival order."""
    rng = random.Random(seed)
    trace, live, next_chat, unique = [], [], 0, 10_000_000
    while next_chat < sessions or live:
        if rng.random() < one_shot_share:
            keys = [unique + i for i in range(10)]
            unique += 100
            session = f"batch{unique}" if batch_sessions else None
            trace.append((keys, request(f"b{unique}", session, "batch", len(keys))))
            continue
        while len(live) < 8 and next_chat < sessions:
            live.append([next_chat, 0])
            next_chat += 1
        if not live:
            continue
        chat = rng.choice(live)
        chat[1] += 1
        keys = [1_000_000 + chat[0] * 100 + i for i in range(2 + 2 * chat[1])]
        trace.append((keys, request(f"c{chat[0]}-{chat[1]}", f"chat{chat[0]}", "chat", len(keys))))
        if chat[1] == 6:
            live.remove(chat)
    return trace


def request(request_id, session_id, tenant, blocks):
    return Request(request_id, [0] * (16 * blocks), 32, tenant=tenant, session_id=session_id)


def replay(policy, trace, capacity=CAPACITY, with_requests=True):
    driver = _Expert.named(policy, context(capacity)) if isinstance(policy, str) else _Expert("under test", policy)
    cache = ShadowCache(driver, capacity)
    return sum(cache.play(keys, float(t), req if with_requests else None) for t, (keys, req) in enumerate(trace))


def test_learns_that_a_finished_single_turn_sessions_blocks_are_dead():
    policy = RevisitEviction(RevisitSettings(), context())
    replay(policy, sessions_trace())
    assert policy.trained[0] > 0 and policy.trained[1] > 0
    # released by a single-turn session, just finished: dead
    one_shot = tuple(CachedBlock(50_000 + i, i, 50_000 + i - 1 if i else None, key=99_000_000 + i) for i in range(10))
    policy.sagellm_blocks_cached(blocks=one_shot)
    policy.sagellm_blocks_released(blocks=one_shot, now_s=1e6, request=request("b-new", "batch-new", "batch", 10))
    assert all(block.block_id in policy._dead for block in one_shot)
    # a chat session's first turn, which its next turn will extend: live
    chat = tuple(CachedBlock(60_000 + i, i, 60_000 + i - 1 if i else None, key=98_000_000 + i) for i in range(4))
    policy.sagellm_blocks_cached(blocks=chat)
    policy.sagellm_blocks_released(blocks=chat, now_s=1e6, request=request("c-new-1", "chat-new", "chat", 4))
    assert all(block.block_id in policy._live for block in chat)


def test_the_turn_count_tells_a_session_that_has_ended():
    """Chat sessions always end after their 6th turn: the same tenant's
    blocks are live after turn 1 and dead after turn 6."""
    policy = RevisitEviction(RevisitSettings(), context())
    replay(policy, sessions_trace(seed=3, one_shot_share=0.3))
    released = {}
    for turn in (1, 6):
        chat = tuple(
            CachedBlock(70_000 + 100 * turn + i, i, 70_000 + 100 * turn + i - 1 if i else None, key=97_000_000 + i)
            for i in range(2 + 2 * turn)
        )
        for earlier in range(1, turn):  # the session's earlier turns, counted as they came
            policy.conversation(chat[:1], request(f"t-{earlier}", "chat-t", "chat", 4))
        policy.sagellm_blocks_cached(blocks=chat)
        policy.sagellm_blocks_released(
            blocks=chat, now_s=1e6, request=request(f"t-{turn}", "chat-t", "chat", len(chat))
        )
        released[turn] = [block.block_id in policy._dead for block in chat]
    assert not any(released[1])
    assert all(released[6])


def test_it_remembers_the_most_recent_sessions_not_every_one(monkeypatch):
    monkeypatch.setattr(revisit, "KEPT_SESSIONS", 50)
    policy = RevisitEviction(RevisitSettings(), context())
    replay(policy, sessions_trace(seed=2, sessions=200))  # 200 chat sessions, hundreds of one-shot ones
    assert len(policy._sessions) == len(policy._seen_requests) == 50
    kept = next(reversed(policy._sessions))  # the latest session: its turns still counted
    number, turns = policy._sessions[kept]
    assert policy.conversation((), request("one-more", kept, "chat", 4)) == (number, turns + 1)
    first = request("again", "chat0", "chat", 4)  # long forgotten: a new conversation, its first turn
    conversation, turn = policy.conversation((), first)
    assert turn == 1 and conversation not in {n for n, _ in policy._sessions.values() if n != conversation}
    assert len(policy._sessions) == 50


def test_a_guessed_conversation_is_demoted_less_than_a_known_session():
    # the batch tenant's requests carry no session: their conversation is
    # guessed from the chain, and a block predicted dead is demoted less
    policy = RevisitEviction(RevisitSettings(demotion=2.0, guessed_demotion=0.5), context())
    replay(policy, sessions_trace(seed=5, batch_sessions=False))
    assert policy._guessed  # the batch blocks still cached, predicted dead
    guessed = tuple(CachedBlock(80_000 + i, i, 80_000 + i - 1 if i else None, key=96_000_000 + i) for i in range(10))
    known = tuple(CachedBlock(90_000 + i, i, 90_000 + i - 1 if i else None, key=95_000_000 + i) for i in range(10))
    for blocks, session in ((guessed, None), (known, "batch-known")):
        policy.sagellm_blocks_cached(blocks=blocks)
        policy.sagellm_blocks_released(blocks=blocks, now_s=1e6, request=request(f"x{session}", session, "batch", 10))
    assert all(b.block_id in policy._guessed for b in guessed)
    assert all(b.block_id in policy._dead for b in known)
    # released later, yet placed before the guessed ones: demoted further
    assert max(policy._dead[b.block_id] for b in known) < min(policy._guessed[b.block_id] for b in guessed)


def test_beats_lru_where_a_class_of_sessions_never_comes_back():
    trace = sessions_trace(seed=1)
    lru = replay("lru", trace)
    assert replay(RevisitEviction(RevisitSettings(), context()), trace) > 1.05 * lru
    bold = replay(RevisitEviction(RevisitSettings(demotion=2.0), context()), trace)
    assert bold > 1.2 * lru


def test_without_requests_it_still_runs_and_keeps_to_lru_order_when_unsure():
    # a pool that does not say which request released the blocks (vLLM's):
    # conversations come from the chains themselves
    trace = sessions_trace(seed=2)
    policy = RevisitEviction(RevisitSettings(), context())
    mine, lru = replay(policy, trace, with_requests=False), replay("lru", trace)
    assert mine >= 0.995 * lru


def test_before_any_eviction_nothing_is_dead_and_it_is_lru():
    ctx = PluginContext("p", block_size=16, num_blocks=100)
    mine, lru = _Expert.named("revisit", ctx), _Expert.named("lru", ctx)
    blocks = [CachedBlock(i, i % 4, None if i % 4 == 0 else i - 1, key=i) for i in range(40)]
    for expert in (mine, lru):
        expert.tell("sagellm_blocks_cached", tuple(blocks), 0.0)
        for i in range(0, 40, 4):
            expert.tell("sagellm_blocks_released", tuple(blocks[i : i + 4]), 0.0, request("r", "s", "t", 4))
    assert mine.policy.trained == [0, 0] and mine.policy.predicted_dead == 0
    candidates = set(range(0, 40, 3))
    assert mine.select(7, candidates).victim_ids == lru.select(7, candidates).victim_ids


def test_as_an_expert_of_adaptive_it_sees_the_requests_and_takes_the_lead():
    trace = sessions_trace(seed=4)
    policy = AdaptiveEviction(AdaptiveSettings(experts=("lru", "revisit:demotion=2;dead_chance=0.7")), context())
    mine, lru = replay(policy, trace), replay("lru", trace)
    assert policy.leader_name == "revisit:demotion=2;dead_chance=0.7"
    assert policy.experts[1].policy.trained[1] > 0
    assert mine > 1.1 * lru


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(3, 40),
    trace=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=80),
    asks=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 2**16)), min_size=1, max_size=5),
)
def test_victims_are_distinct_candidates_and_at_most_asked(capacity, trace, asks):
    policy = RevisitEviction(RevisitSettings(demotion=1.0), context(capacity))
    cache = ShadowCache(_Expert("under test", policy), capacity)
    for t, (root, length, session) in enumerate(trace):
        req = request(f"r{t}", f"s{session}", "t", length) if session else None
        cache.play([root * 100 + i for i in range(length)], float(t), req)
        assert len(cache.nodes) <= capacity
    evictable = set(cache.evictable)
    for k, mask in asks:
        candidates = {b for b in evictable if (mask >> (b % 16)) & 1}
        victims = policy.sagellm_select_victims(k, candidates).victim_ids
        assert len(victims) == len(set(victims)) <= k
        assert set(victims) <= candidates
        assert len(victims) == min(k, len(candidates))  # every evictable block is in its order
