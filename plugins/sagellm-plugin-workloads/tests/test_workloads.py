"""Each workload is seeded, in arrival order, and shares exactly what it says."""

from collections import Counter

import attrs
import pytest
from sagellm_plugin_workloads import NoisySettings

from sagellm_core.config import WorkloadSettings
from sagellm_core.replay import workloads
from sagellm_core.replay.workloads import GeneratorSettings

SOURCES = ["agentic", "rag", "tenant-mix", "bursts", "noisy-neighbour"]


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
