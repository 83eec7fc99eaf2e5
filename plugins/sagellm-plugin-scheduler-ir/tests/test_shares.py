"""``tenant-shares``: each tenant's guaranteed share and cap of a step's
prefill tokens, as chunk limits on the step's requests."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sagellm_plugin_scheduler_ir.shares import TenantSharesPass, TenantSharesSettings

from sagellm_core import PluginContext, checks
from sagellm_core.types import Request, ScheduleIR, SequenceState

CTX = PluginContext("tenant-shares", block_size=16, num_blocks=100)
TENANTS = ("chat-0", "chat-1", "docs")


def waiting(rid, tenant, prompt, cached=0):
    state = SequenceState(Request(rid, list(range(prompt)), 4, tenant=tenant))
    state.cached_tokens_hint = cached
    return state


def running(rid, tenant, prompt, computed, generated=0):
    state = SequenceState(Request(rid, list(range(prompt)), 64, tenant=tenant))
    state.num_computed_tokens, state.num_output_tokens = computed, generated
    return state


def shares_pass(**kw):
    return TenantSharesPass(TenantSharesSettings(**kw), CTX)


def test_a_waiting_chat_turn_gets_its_share_before_a_running_document():
    doc = running("doc", "docs", 6000, computed=1000)
    chat = waiting("chat", "chat-0", 1500, cached=1000)  # asks 500
    ir = ScheduleIR(0.0, [chat], [doc], 2048, 8)
    shares_pass(shares={"chat-0": 0.5}).sagellm_schedule_pass(ir=ir)
    # 2,047 tokens to divide (one is the document's floor): the chat turn's 500
    # are within its 1,023, the document takes the rest on top of its floor.
    assert ir.chunk_limits == {"doc": 1 + 2047 - 500}
    assert ir.waiting == [chat] and ir.running == [doc]


def test_a_cap_holds_even_when_nobody_else_asks():
    doc = running("doc", "docs", 6000, computed=0)
    queued = waiting("doc-2", "docs", 4000)
    ir = ScheduleIR(0.0, [queued], [doc], 8192, 8)
    shares_pass(caps={"docs": 0.125}).sagellm_schedule_pass(ir=ir)
    assert ir.chunk_limits == {"doc": 1 + 1023, "doc-2": 0}


def test_a_cap_holds_when_the_cache_hint_understates_the_ask():
    # The second question on a document: the hint says the document is
    # cached, so it asks for its question's 40 tokens; admission may find
    # the document evicted and compute all 4,136. Its limit is what it was given.
    question = waiting("doc-q2", "docs", 4136, cached=4096)
    ir = ScheduleIR(0.0, [question], [], 8192, 8)
    shares_pass(caps={"docs": 0.03125}).sagellm_schedule_pass(ir=ir)
    assert ir.chunk_limits == {"doc-q2": 40}
    uncapped = ScheduleIR(0.0, [waiting("doc-q2", "docs", 4136, cached=4096)], [], 8192, 8)
    shares_pass(shares={"docs": 0.5}).sagellm_schedule_pass(ir=uncapped)
    assert uncapped.chunk_limits == {}


def test_a_yielding_tenant_takes_its_contended_cap_only_while_a_shared_tenant_prefills():
    doc = running("doc", "docs", 6000, computed=1000)
    queued = waiting("doc-2", "docs", 4000)
    settings = dict(shares={"chat-0": 0.25}, caps={"docs": 0.125}, contended_caps={"docs": 0.0})
    alone = ScheduleIR(0.0, [queued], [doc], 8192, 8)
    yielding = shares_pass(**settings)
    yielding.sagellm_schedule_pass(ir=alone)
    assert alone.chunk_limits == {"doc": 1 + 1023, "doc-2": 0}  # nobody with a share asks: its cap
    chat = waiting("chat", "chat-0", 1500)
    contended = ScheduleIR(0.0, [chat, waiting("doc-2", "docs", 4000)], [running("doc", "docs", 6000, 1000)], 8192, 8)
    yielding.sagellm_schedule_pass(ir=contended)
    # The chat turn asks: the document keeps its floor of one token, the queued one gets none.
    assert contended.chunk_limits == {"doc": 1, "doc-2": 0}
    assert yielding.sagellm_report_figures() == {"tenant-shares": {"contended_steps": 1, "yielded_steps": {"docs": 1}}}
    # A shared tenant's running prefill with only its floor left asks for nothing more.
    last = ScheduleIR(0.0, [], [running("chat", "chat-0", 1500, 1499), running("doc", "docs", 6000, 1000)], 8192, 8)
    yielding.sagellm_schedule_pass(ir=last)
    assert last.chunk_limits == {"doc": 1 + 1023}
    assert shares_pass(caps={"docs": 0.125}).sagellm_report_figures() is None


def test_nothing_is_capped_when_every_ask_fits():
    ir = ScheduleIR(0.0, [waiting("a", "chat-0", 100)], [running("b", "docs", 300, computed=100)], 8192, 8)
    shares_pass(shares={"chat-0": 0.5}).sagellm_schedule_pass(ir=ir)
    assert ir.chunk_limits == {}


def test_decodes_take_their_token_first():
    decoding = [running(f"d{i}", "docs", 100, computed=100 + i, generated=i + 1) for i in range(4)]
    chat = waiting("chat", "chat-0", 1000)
    ir = ScheduleIR(0.0, [chat], decoding, 100, 8)
    shares_pass(shares={"chat-0": 0.5}).sagellm_schedule_pass(ir=ir)
    assert ir.chunk_limits == {"chat": 96}


def test_settings_refuse_shares_past_the_step_or_a_cap():
    with pytest.raises(ValueError, match="more than the step"):
        TenantSharesSettings(shares={"a": 0.6, "b": 0.5})
    with pytest.raises(ValueError, match="more than its cap"):
        TenantSharesSettings(shares={"a": 0.5}, caps={"a": 0.25})
    with pytest.raises(ValueError):
        TenantSharesSettings(caps={"a": 1.5})
    with pytest.raises(ValueError, match="only a tenant without one yields"):
        TenantSharesSettings(shares={"a": 0.5}, contended_caps={"a": 0.1})
    with pytest.raises(ValueError, match="more than its cap"):
        TenantSharesSettings(caps={"a": 0.1}, contended_caps={"a": 0.2})


requests = st.lists(
    st.tuples(
        st.sampled_from(TENANTS),
        st.integers(1, 6000),  # prompt tokens
        st.booleans(),  # running
        st.integers(0, 6000),  # computed (running) or cached hint (waiting)
        st.integers(0, 3),  # generated (running)
    ),
    max_size=24,
)
fractions = st.dictionaries(st.sampled_from(TENANTS), st.sampled_from([0.0, 0.05, 0.125, 0.25, 0.5]))


def build(spec, budget) -> ScheduleIR:
    ir = ScheduleIR(0.0, [], [], budget, 256)
    for i, (tenant, prompt, is_running, tokens, generated) in enumerate(spec):
        if is_running:
            computed = min(tokens, prompt + generated - 1)
            ir.running.append(running(f"r{i}", tenant, prompt, computed, generated if computed >= prompt else 0))
        else:
            ir.waiting.append(waiting(f"w{i}", tenant, prompt, cached=min(tokens, prompt)))
    return ir


def ask(state, running_: bool) -> int:
    """What the pass takes a request to ask for beyond its floor (the module's docstring)."""
    if running_:
        return state.num_tokens - state.num_computed_tokens - 1 if state.in_prefill else 0
    return max(1, state.num_tokens - state.cached_tokens_hint)


@settings(max_examples=300, deadline=None)
@given(spec=requests, budget=st.integers(1, 10000), shares=fractions, caps=fractions)
def test_every_tenant_that_asks_gets_its_share_and_no_cap_is_passed(spec, budget, shares, caps):
    if sum(shares.values()) > 1:
        shares = {}
    shares = {t: s for t, s in shares.items() if s <= caps.get(t, 1.0)}
    ir = build(spec, budget)
    before_waiting, before_running = list(ir.waiting), list(ir.running)
    shares_pass(shares=shares, caps=caps).sagellm_schedule_pass(ir=ir)
    # Nothing dropped, duplicated or reordered; the core's check of a pass holds.
    assert ir.waiting == before_waiting and ir.running == before_running
    assert checks.schedule(ir, {"waiting": before_waiting, "running": before_running}, budget, 256) is None
    divided = budget - len(ir.running)  # one token for each decode and each running prefill's floor
    given: dict[str, int] = {}
    asked: dict[str, int] = {}
    for state, is_running in [(s, True) for s in ir.running] + [(s, False) for s in ir.waiting]:
        wants, floor = ask(state, is_running), 1 if is_running else 0
        limit = ir.chunk_limits.get(state.request_id, floor + wants)
        assert floor <= limit <= floor + wants
        tenant = state.request.tenant
        given[tenant] = given.get(tenant, 0) + limit - floor
        asked[tenant] = asked.get(tenant, 0) + wants
    if divided <= 0:
        assert ir.chunk_limits == {}
        return
    assert sum(given.values()) <= divided
    for tenant, tokens in given.items():
        room = max(1, math.floor(caps[tenant] * divided + 1e-9)) if tenant in caps else divided
        guaranteed = math.floor(shares.get(tenant, 0.0) * divided + 1e-9)
        assert tokens >= min(asked[tenant], guaranteed, room)  # the share, whenever it asks for that much
        assert tokens <= room  # the cap
        if sum(given.values()) < divided:  # work-conserving: tokens left over only where nobody may take them
            assert tokens == asked[tenant] or tokens == room


def reference_limits(shares: dict, caps: dict, ir: ScheduleIR, contended_caps: dict | None = None) -> dict[str, int]:
    """The pass's rule read literally (every ask built, every tenant's room
    kept, every request's limit written one by one), the spec the pass's
    faster reading must agree with."""
    budget = ir.token_budget
    asks = []
    for state in ir.running:
        budget -= 1
        if state.in_prefill:
            asks.append((state.request_id, state.request.tenant, state.num_tokens - state.num_computed_tokens - 1, 1))
    for state in ir.waiting:
        asks.append((state.request_id, state.request.tenant, max(1, state.num_tokens - state.cached_tokens_hint), 0))
    limits = dict(ir.chunk_limits)
    if budget <= 0 or not asks:
        return limits
    asked: dict[str, int] = {}
    for _, tenant, tokens, _ in asks:
        asked[tenant] = asked.get(tenant, 0) + tokens
    fraction = lambda share, n: math.floor(share * n + 1e-9)  # noqa: E731
    room = {t: max(1, fraction(caps[t], budget)) if t in caps else budget for t in asked}
    contended_caps = contended_caps or {}
    # Contended: a tenant with a (nonzero) share asks for a token or more beyond a running prefill's floor.
    if any(shares.get(tenant, 0) > 0 and tokens > 0 for _, tenant, tokens, _ in asks):
        room.update({t: fraction(cap, budget) for t, cap in contended_caps.items() if t in asked})
    owed = {t: min(n, fraction(shares.get(t, 0.0), budget), room[t]) for t, n in asked.items()}
    left = budget - sum(owed.values())
    given = []
    for _, tenant, tokens, _ in asks:
        own = min(tokens, owed[tenant])
        owed[tenant] -= own
        room[tenant] -= own
        given.append(own)
    for i, (_, tenant, tokens, _) in enumerate(asks):
        if left <= 0:
            break
        more = min(tokens - given[i], room[tenant], left)
        if more > 0:
            given[i] += more
            room[tenant] -= more
            left -= more
    for (request_id, tenant, asked_tokens, floor), tokens in zip(asks, given):
        # A capped tenant's waiting request is held to what it is given even
        # when that covers its ask (which a stale cache hint may understate).
        if tokens < asked_tokens or (floor == 0 and (tenant in caps or tenant in contended_caps)):
            limits[request_id] = min(limits.get(request_id, floor + tokens), floor + tokens)
    return limits


_fractions = st.dictionaries(st.sampled_from(TENANTS), st.sampled_from([0.0, 0.03125, 0.1, 0.25, 0.3, 0.5]))


@settings(max_examples=400, deadline=None)
@given(
    st.data(),
    _fractions,
    _fractions,
    st.integers(1, 3000),
    st.lists(st.tuples(st.sampled_from(TENANTS), st.integers(1, 900), st.integers(0, 900), st.integers(0, 3))),
    st.lists(st.tuples(st.sampled_from(TENANTS), st.integers(1, 900), st.integers(0, 900), st.integers(0, 2))),
)
def test_the_pass_decides_exactly_as_its_rule_read_literally(data, shares, caps, budget, run, wait):
    shares = {t: s for t, s in shares.items() if s <= caps.get(t, 1.0)}
    while sum(shares.values()) > 1:
        shares.pop(next(iter(shares)))
    unshared = [t for t in TENANTS if not shares.get(t)]
    contended_caps = (
        data.draw(st.dictionaries(st.sampled_from(unshared), st.sampled_from([0.0, 0.01, 0.1]))) if unshared else {}
    )
    contended_caps = {t: min(cap, caps.get(t, 1.0)) for t, cap in contended_caps.items()}
    running_states = []
    for i, (tenant, prompt, computed, generated) in enumerate(run):
        # A running request has a token left to compute (the last, or the next decode's).
        state = running(f"run-{i}", tenant, prompt, min(computed, prompt + generated - 1), generated)
        running_states.append(state)
    waiting_states = []
    for i, (tenant, prompt, cached, generated) in enumerate(wait):
        state = waiting(f"wait-{i}", tenant, prompt, cached=min(cached, prompt))
        state.num_output_tokens = generated  # a preempted request waits with its output to recompute
        waiting_states.append(state)
    ids = [s.request_id for s in running_states + waiting_states]
    earlier = data.draw(st.dictionaries(st.sampled_from(ids), st.integers(0, 500)) if ids else st.just({}))
    ir = ScheduleIR(0.0, waiting_states, running_states, budget, 64, dict(earlier))
    expected = reference_limits(shares, caps, ir, contended_caps)
    shares_pass(shares=shares, caps=caps, contended_caps=contended_caps).sagellm_schedule_pass(ir=ir)
    assert ir.chunk_limits == expected
