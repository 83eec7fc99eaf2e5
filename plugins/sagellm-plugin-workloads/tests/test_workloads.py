"""Each workload is seeded, in arrival order, and shares exactly what it says."""

from collections import Counter

import attrs
import pytest
from sagellm_plugin_workloads import NoisySettings

from sagellm_core.config import WorkloadSettings
from sagellm_core.replay import workloads
from sagellm_core.replay.workloads import GeneratorSettings

SOURCES = ["agentic", "rag", "tenant-mix", "bursts", "noisy-neighbour"]
#: The sources whose clients send hints (the noisy neighbour's do not).
HINTED = SOURCES[:4]


def load(source, **keys):
    """The source's requests, ``keys`` the [workload] keys: the kernel's and the source's."""
    cls = NoisySettings if source == "noisy-neighbour" else GeneratorSettings
    own = {f.name for f in attrs.fields(cls)}
    options = cls(**{k: v for k, v in keys.items() if k in own})
    kernel = {k: v for k, v in keys.items() if k not in own}
    return list(workloads.load(WorkloadSettings(source=source, options=options, **kernel)))


def prefix_len(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("source", SOURCES)
def test_seeded_ordered_and_unique_ids(source):
    first, again, other = load(source), load(source), load(source, seed=1)
    assert [(r.request_id, list(r.prompt_token_ids)) for r in first] == [
        (r.request_id, list(r.prompt_token_ids)) for r in again
    ]
    assert [list(r.prompt_token_ids) for r in first] != [list(r.prompt_token_ids) for r in other]
    assert [r.arrival_s for r in first] == sorted(r.arrival_s for r in first)
    assert len({r.request_id for r in first}) == len(first)
    assert all(r.output_tokens == len(r.output_token_ids) > 0 for r in first)


def test_agent_steps_extend_their_context_with_call_and_result():
    requests = load("agentic", tenants=2, sessions_per_tenant=3)
    by_session = {}
    for r in requests:
        by_session.setdefault(r.session_id, []).append(r)
    for steps in by_session.values():
        assert len(steps) >= 2 * 4  # from 2 x turns steps
        for before, after in zip(steps, steps[1:]):
            history = list(before.prompt_token_ids) + list(before.output_token_ids)
            assert list(after.prompt_token_ids[: len(history)]) == history
            assert len(after.prompt_token_ids) > len(history)  # and the tool's result
    # agents of one tool set share its long tool prompt (4 system prompts)
    tools = Counter(r.tenant for r in requests if r.request_id.endswith("turn0"))
    tenant = max(tools, key=tools.get)
    firsts = [r for r in requests if r.tenant == tenant and r.request_id.endswith("turn0")]
    assert prefix_len(firsts[0].prompt_token_ids, firsts[1].prompt_token_ids) >= 4 * 1024


def test_rag_prompts_share_documents_of_the_corpus():
    requests = load("rag", sessions_per_tenant=30)
    firsts = [r for r in requests if r.request_id.endswith("turn0")]
    shared = [prefix_len(a.prompt_token_ids, b.prompt_token_ids) for a in firsts for b in firsts if a is not b]
    assert min(shared) >= 256  # the instruction
    assert sum(s > 256 for s in shared) > 0.05 * len(shared)  # a popular first document recurs


def test_tenant_mix_has_three_patterns_and_the_batch_is_a_scan():
    requests = load("tenant-mix")
    assert {r.tenant for r in requests} == {"chat", "agents", "batch"}
    batch = [r for r in requests if r.tenant == "batch"]
    blocks = Counter()
    for r in batch:  # past the shared instruction, no batch document recurs
        blocks.update(r.prompt_token_ids[128:].tolist())
    assert max(blocks.values()) == 1


def test_bursts_share_one_document_within_a_burst():
    requests = [r for r in load("bursts") if r.tenant == "burst"]
    first = [r for r in requests if r.request_id.startswith("burst0-")]
    assert len(first) == 4 * 12
    assert first[-1].arrival_s - first[0].arrival_s <= 2.0
    assert all(prefix_len(first[0].prompt_token_ids, r.prompt_token_ids) >= 4 * 1024 for r in first)


def test_max_requests_and_session_sampling_apply():
    assert len(load("agentic", max_requests=5)) == 5
    held_out = load("rag", session_to=0.5)
    assert 0 < len(held_out) < len(load("rag"))


@pytest.mark.parametrize("source", SOURCES)
def test_time_goes_forward_even_with_zero_rates(source):
    # session_rate 0: every session starts at once; the loader raises a
    # TraceError if any request arrives before the one before it
    requests = load(source, session_rate=0.0)
    assert len(requests) > 0


def test_the_noisy_neighbour_adds_documents_and_leaves_the_chat_tenants_as_they_were():
    alone = load("noisy-neighbour", tenants=3, sessions_per_tenant=4, document_rate=0.0)
    noisy = load("noisy-neighbour", tenants=3, sessions_per_tenant=4, document_rate=2.0, document_tokens=512)
    assert {r.tenant for r in alone} == {"chat-0", "chat-1", "chat-2"}
    chat = [r for r in noisy if r.tenant != "docs"]
    assert [(r.request_id, list(r.prompt_token_ids), r.arrival_s) for r in chat] == [
        (r.request_id, list(r.prompt_token_ids), r.arrival_s) for r in alone
    ]
    docs = [r for r in noisy if r.tenant == "docs"]
    firsts = {r.session_id: r for r in docs if r.request_id.endswith("turn0")}
    assert firsts and max(f.arrival_s for f in firsts.values()) <= alone[-1].arrival_s  # while the chats arrive
    for r in docs:
        if r.request_id.endswith("turn1"):  # the second question extends the first turn
            first = firsts[r.session_id]
            history = list(first.prompt_token_ids) + list(first.output_token_ids)
            assert list(r.prompt_token_ids[: len(history)]) == history
    assert len({tuple(f.prompt_token_ids[64:128]) for f in firsts.values()}) == len(firsts)  # every document new


def test_the_noisy_neighbour_refuses_bad_keys_naming_them():
    for key, value in (("document_rate", -1.0), ("document_tokens", 0), ("document_turns", 0)):
        with pytest.raises(ValueError, match=key):
            NoisySettings(**{key: value})


def load_hinted(source, **keys):
    """The source's requests with the hint keys (``hints``, ``hints_wrong``, ``hints_missing``) among ``keys``."""
    from sagellm_core.replay.workloads import HintedSettings

    return list(workloads.load(WorkloadSettings(source=source, options=HintedSettings(**keys))))


def facts(requests):
    return [
        (r.request_id, list(r.prompt_token_ids), r.arrival_s, r.tenant, r.session_id, r.output_tokens) for r in requests
    ]


@pytest.mark.parametrize("source", HINTED)
def test_truthful_hints_release_a_session_on_its_last_request_and_change_no_request(source):
    plain, told = load_hinted(source), load_hinted(source, hints=True)
    assert facts(told) == facts(plain) and all(r.kv_hints is None for r in plain)
    last = {r.session_id: r.request_id for r in told if r.session_id is not None}
    for r in told:
        ends = r.session_id is None or last[r.session_id] == r.request_id
        assert r.kv_hints is not None and r.kv_hints.release == ends, (r.request_id, r.kv_hints)
        if not ends:  # going on: its tenant's shared prefix pinned, and nothing else released
            assert r.kv_hints.pin > 0
    assert sum(not r.kv_hints.release for r in told) > len(told) // 4


@pytest.mark.parametrize("key", ["hints_wrong", "hints_missing"])
def test_a_stated_share_of_the_hints_is_wrong_or_missing(key):
    many = {"hints": True, "sessions_per_tenant": 100}
    told, spoiled = load_hinted("rag", **many), load_hinted("rag", **many, **{key: 0.3})
    assert facts(spoiled) == facts(told)
    changed = [(a.kv_hints, b.kv_hints) for a, b in zip(told, spoiled) if a.kv_hints != b.kv_hints]
    assert len(told) > 500 and 0.25 < len(changed) / len(told) < 0.35
    if key == "hints_missing":
        assert all(b is None for _, b in changed)
    else:  # the opposite of the truth about whether the session goes on
        assert all(b is not None and a.release != b.release for a, b in changed)


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"hints_wrong": 1.5}, "hints_wrong = 1.5: a share, from 0 to 1"),
        ({"hints_missing": -0.1}, "hints_missing = -0.1: a share"),
        ({"hints_wrong": 0.6, "hints_missing": 0.6}, "hints_wrong + hints_missing: at most 1"),
    ],
)
def test_hint_shares_are_checked(keys, message):
    from sagellm_core.replay.workloads import HintedSettings

    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        HintedSettings(hints=True, **keys)
