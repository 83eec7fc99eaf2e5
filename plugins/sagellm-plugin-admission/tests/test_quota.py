"""The quota rule on its own: each hook called as the runtime calls it."""

from types import MappingProxyType

import hypothesis.strategies as st
import pytest
from hypothesis import example, given, settings
from sagellm_plugin_admission.quota import OVER_CAP, QuotaAdmission, QuotaSettings

from sagellm_core import PluginContext
from sagellm_core.errors import ConfigError
from sagellm_core.registry import build_settings
from sagellm_core.types import Admission, CachedBlock, Request, SequenceState, TenantLedger

POOL, BLOCK = 100, 4


def quota(**kw) -> QuotaAdmission:
    return QuotaAdmission(QuotaSettings(**kw), PluginContext("quota", block_size=BLOCK, num_blocks=POOL))


def ledger(**held) -> TenantLedger:
    return TenantLedger(MappingProxyType(dict(held)), MappingProxyType({t: 1 for t in held}))


def state(tenant: str, blocks: int, name: str | None = None) -> SequenceState:
    request = Request(name or f"{tenant}-{blocks}", list(range(blocks * BLOCK)), 1, tenant=tenant)
    return SequenceState(request=request)


RUNNING = (SequenceState(request=Request("x", [1], 1)),)


def ask(q, s, held, available=POOL, running=RUNNING):
    decision = q.sagellm_admit_request(state=s, ledger=held, running=running, available_blocks=available)
    return Admission.ADMIT if decision is None else decision.verdict


def test_a_request_over_its_cap_alone_is_rejected_and_one_at_its_cap_waits():
    q = quota(caps={"docs": 0.2})
    decision = q.sagellm_admit_request(state=state("docs", 21), ledger=ledger(), running=(), available_blocks=POOL)
    assert decision.verdict is Admission.REJECT and decision.reason == OVER_CAP
    assert ask(q, state("docs", 10), ledger(docs=10)) is Admission.ADMIT  # 20: at the cap
    assert ask(q, state("docs", 11), ledger(docs=10)) is Admission.DEFER
    assert ask(q, state("chat", 99), ledger(chat=99, docs=10)) is Admission.ADMIT  # not named: no cap
    assert q.figures["docs"].deferred == 1


def test_within_its_guarantee_a_request_is_admitted_whatever_the_others_hold():
    q = quota(guarantees={"chat": 0.3}, lend=0.0)
    assert ask(q, state("chat", 30), ledger(docs=70), available=0) is Admission.ADMIT
    assert q.figures["chat"].loans == 0


def test_a_loan_leaves_the_others_unused_guarantees_to_eviction_as_lend_says():
    q = quota(guarantees={"chat": 0.5}, lend=0.0)
    # docs has no guarantee: 20 blocks is a loan; chat's 40 unused blocks must stay free or evictable
    assert ask(q, state("docs", 20), ledger(chat=10), available=59) is Admission.DEFER
    assert ask(q, state("docs", 20), ledger(chat=10), available=60) is Admission.ADMIT
    figures = q.figures["docs"]
    assert (figures.deferred, figures.loans, figures.lent_blocks) == (1, 1, 20)
    half = quota(guarantees={"chat": 0.5}, lend=0.5)  # half of them may be lent to running requests
    assert ask(half, state("docs", 20), ledger(chat=10), available=40) is Admission.ADMIT
    assert ask(half, state("docs", 21), ledger(chat=10), available=40) is Admission.DEFER
    assert ask(half, state("docs", 21), ledger(), available=40, running=()) is Admission.ADMIT  # nothing to wait for


def test_a_request_within_its_guarantee_that_memory_refused_is_a_guarantee_violation():
    q = quota(guarantees={"chat": 0.5})
    s = state("chat", 10)
    assert ask(q, s, ledger()) is Admission.ADMIT
    assert ask(q, s, ledger()) is Admission.ADMIT  # asked again: memory refused it the first time
    s.num_preemptions = 1
    assert ask(q, s, ledger()) is Admission.ADMIT  # preempted since: admitted then, not a violation
    assert q.figures["chat"].guarantee_violations == 1


def block(block_id: int, tenant: str | None = None) -> CachedBlock:
    return CachedBlock(block_id, 0, None, block_id, "", tenant)


def test_the_tenant_furthest_over_its_guarantee_loses_its_cached_blocks_first():
    q = quota(guarantees={"chat": 0.5})
    q.sagellm_admit_request(state=state("chat", 1), ledger=ledger(chat=40, docs=5), running=(), available_blocks=POOL)
    chat, docs = Request("c", [1], 1, tenant="chat"), Request("d", [1], 1, tenant="docs")
    q.sagellm_blocks_released(blocks=(block(1), block(2)), request=chat)
    q.sagellm_blocks_released(blocks=(block(3), block(4), block(5)), request=docs)
    q.sagellm_blocks_released(blocks=(block(6, tenant="docs"),), request=chat)  # an isolated namespace's tenant
    # chat: 40 held + 2 cached, within its guarantee of 50; docs: 5 + 4 over its guarantee of 0
    decision = q.sagellm_select_victims(num_blocks=3, candidates={1, 2, 3, 4, 5, 6})
    assert decision.victim_ids == (5, 4, 3)  # docs, deepest first within a release, oldest release first
    q.sagellm_blocks_evicted(blocks=(block(5), block(4)))
    q.sagellm_blocks_touched(blocks=(block(3),))
    assert q.sagellm_select_victims(num_blocks=4, candidates={1, 2, 6}).victim_ids == (6,)
    q.sagellm_blocks_evicted(blocks=(block(6),))
    assert q.sagellm_select_victims(num_blocks=4, candidates={1, 2}) is None  # nobody over: the policy decides


def test_without_a_guarantee_to_protect_the_policy_chooses_the_victims():
    q = quota(guarantees={"chat": 0.5})
    docs = Request("d", [1], 1, tenant="docs")
    q.sagellm_blocks_released(blocks=(block(3), block(4)), request=docs)
    assert q.sagellm_select_victims(num_blocks=1, candidates={3, 4}) is None  # chat has nothing cached
    none = quota()
    none.sagellm_blocks_released(blocks=(block(3),), request=docs)
    assert none.sagellm_select_victims(num_blocks=1, candidates={3}) is None  # no guarantees at all


def test_moved_blocks_keep_their_tenant_and_order():
    q = quota(guarantees={"chat": 0.5})
    q.sagellm_blocks_released(blocks=(block(9),), request=Request("c", [1], 1, tenant="chat"))
    docs = Request("d", [1], 1, tenant="docs")
    q.sagellm_blocks_released(blocks=(block(1), block(2), block(3)), request=docs)
    q.sagellm_blocks_moved(moves=((2, 20), (1, 10)))
    assert q.sagellm_select_victims(num_blocks=3, candidates={10, 20, 3, 9}).victim_ids == (3, 20, 10)


def test_a_request_within_its_guarantee_reclaims_a_loan_by_preempting_the_furthest_over():
    q = quota(guarantees={"chat": 0.5, "batch": 0.1})
    running = []
    for name, tenant, blocks in (("c1", "chat", 40), ("d1", "docs", 5), ("d2", "docs", 5), ("b1", "batch", 12)):
        s = state(tenant, blocks, name)
        s.block_ids = list(range(blocks))
        running.append(s)
    chat, batch = running[0], running[3]
    # chat holds 40 of its 50: docs (10 over its 0) before batch (2 over its 10)
    assert q.sagellm_select_preemption(running=tuple(running), needed_by=chat).request_id == "d2"
    assert q.sagellm_select_preemption(running=tuple(running), needed_by=batch) is None  # batch is over its own
    assert q.sagellm_select_preemption(running=(chat,), needed_by=chat) is None  # nobody over


@pytest.mark.parametrize(
    "params, message",
    [
        ({"guarantees": {"a": 0.6, "b": 0.5}}, "add up to more than the pool"),
        ({"guarantees": {"a": 0.6}, "caps": {"a": 0.5}}, "more than its cap"),
        ({"caps": {"a": 1.5}}, "caps"),
        ({"lend": 2.0}, "lend"),
    ],
)
def test_bad_shares_are_one_line_errors_naming_the_key(params, message):
    with pytest.raises(ConfigError, match=message) as err:
        build_settings(QuotaAdmission, params, "cfg.toml: [admission] plugin 'quota'")
    assert "\n" not in str(err.value)


@settings(max_examples=300, deadline=None)
@given(
    guarantees=st.lists(st.integers(0, 33), min_size=3, max_size=3),
    caps=st.lists(st.integers(0, 100), min_size=3, max_size=3),
    held=st.lists(st.integers(0, 100), min_size=3, max_size=3),
    who=st.integers(0, 2),
    need=st.integers(1, 60),
    available=st.integers(0, 100),
    lend=st.sampled_from([0.0, 0.5, 1.0]),
)
# 29 of 100 blocks as a share is 0.29, and 0.29 * 100 is 28.999...: still 29 blocks.
@example(guarantees=[29, 0, 0], caps=[29, 0, 0], held=[0, 0, 0], who=0, need=29, available=100, lend=0.0)
def test_an_admission_never_breaks_a_cap_and_a_loan_leaves_what_lend_keeps(
    guarantees, caps, held, who, need, available, lend
):
    tenants = ["a", "b", "c"]
    caps = [max(c, g) for c, g in zip(caps, guarantees)]
    q = quota(
        guarantees={t: g / POOL for t, g in zip(tenants, guarantees)},
        caps={t: c / POOL for t, c in zip(tenants, caps)},  # (a cap of the pool binds like no cap)
        lend=lend,
    )
    t = tenants[who]
    verdict = ask(q, state(t, need), ledger(**dict(zip(tenants, held))), available)
    within_guarantee = held[who] + need <= min(guarantees[who], caps[who])
    if within_guarantee:
        assert verdict is Admission.ADMIT
    if verdict is Admission.ADMIT:
        assert held[who] + need <= caps[who]
        if not within_guarantee:  # a loan
            kept = (1 - lend) * sum(max(0, g - h) for u, g, h in zip(tenants, guarantees, held) if u != t)
            assert not kept or available - need >= kept  # (nothing kept: memory is the runtime's to refuse)
    assert (verdict is Admission.REJECT) == (need > caps[who])
