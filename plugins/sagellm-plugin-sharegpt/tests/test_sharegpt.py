import json
from itertools import islice
from pathlib import Path

import pytest
from sagellm_plugin_sharegpt import Conversation, turns

from sagellm_core.config import WorkloadSettings
from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.replay import workloads

TRACES = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "traces"


def first(n, **kw):
    return list(workloads.load(WorkloadSettings(source="sharegpt", max_requests=n, **kw)))


def test_turns_share_their_history_as_a_prefix():
    conversation = Conversation(
        "c",
        [
            ("human", "hello there"),
            ("gpt", "hi, how can I help?"),
            ("human", "tell me a joke"),
            ("gpt", "why did the chicken..."),
        ],
    )
    first_turn, second_turn = turns(conversation)
    assert first_turn.user_text == "hello there" and second_turn.user_text == "tell me a joke"
    history = first_turn.prompt_token_ids + first_turn.reply_token_ids
    assert second_turn.prompt_token_ids[: len(history)] == history
    assert len(second_turn.prompt_token_ids) > len(history)


def test_messages_outside_a_pair_stay_in_later_prompts():
    # A split conversation may start with the assistant's reply.
    conversation = Conversation("c", [("gpt", "as I was saying"), ("human", "go on"), ("gpt", "so then")])
    (only,) = turns(conversation)
    assert only.turn == 0
    assert len(only.prompt_token_ids) > len(
        turns(Conversation("d", [("human", "go on"), ("gpt", "x")]))[0].prompt_token_ids
    )


def test_workload_is_in_arrival_order_with_text_and_sessions():
    requests = first(300)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    # (a few user messages in the dataset are empty strings)
    assert all(
        r.prompt_text is not None and r.session_id and r.output_tokens == len(r.output_token_ids) for r in requests
    )
    assert len({r.session_id for r in requests}) < len(requests)  # multi-turn


def test_counts_match_the_shared_per_turn_lengths():
    lengths = TRACES / "sharegpt_turn_lengths_qwen25.jsonl"
    if not lengths.exists():
        pytest.skip("../shared/data/traces is not beside the project")
    expected = {}
    with lengths.open() as fh:
        for line in islice(fh, 3000):
            row = json.loads(line)
            expected[f"{row['id']}-turn{row['turn']}"] = (row["context_tokens"], row["output_tokens"])
    requests = {r.request_id: r for r in first(1500)}
    common = set(requests) & set(expected)
    assert len(common) > 1000
    assert all((requests[k].num_prompt_tokens, requests[k].output_tokens) == expected[k] for k in common)


def test_azure_arrivals_start_the_conversations():
    azure = TRACES / "azure_conv_2023.csv"
    if not azure.exists():
        pytest.skip("../shared/data/traces is not beside the project")
    starts = [r.arrival_s for r in islice(workloads.azure(str(azure)), 5)]
    requests = first(200, path=str(azure))
    first_turns = [r.arrival_s for r in requests if r.request_id.endswith("-turn0")][:5]
    assert first_turns == starts


def test_config_accepts_the_installed_source():
    settings = settings_from_toml('[kv_pool]\nplugin = "paged"\nnum_blocks = 8\n[workload]\nsource = "sharegpt"\n')
    assert settings.workload.source == "sharegpt"


def test_empty_prompts_and_replies_are_left_out_but_stay_in_the_history():
    conversation = Conversation(
        "c",
        [("human", ""), ("gpt", "hello!"), ("human", "hi"), ("gpt", ""), ("human", "and now?"), ("gpt", "now this")],
    )
    (kept,) = turns(conversation)
    assert kept.turn == 2 and kept.user_text == "and now?"
    assert len(kept.prompt_token_ids) > len(
        turns(Conversation("d", [("human", "and now?"), ("gpt", "x")]))[0].prompt_token_ids
    )


@pytest.mark.parametrize("key", [None, "hints_wrong", "hints_missing"])
def test_hints_release_a_conversation_on_its_last_turn_truthfully_or_at_a_stated_share_wrong(key):
    from sagellm_plugin_sharegpt import ShareGPTSettings

    plain = first(1500)
    told = first(1500, options=ShareGPTSettings(hints=True, **({key: 0.3} if key else {})))
    facts = [[(r.request_id, list(r.prompt_token_ids), r.arrival_s, r.session_id) for r in rs] for rs in (plain, told)]
    assert facts[0] == facts[1] and all(r.kv_hints is None for r in plain)
    truthful = first(1500, options=ShareGPTSettings(hints=True))
    released = [r.kv_hints is not None and r.kv_hints.release for r in told]
    truth = [r.kv_hints is not None and r.kv_hints.release for r in truthful]
    if key is None:
        assert 0 < sum(truth) < len(truth)  # conversations of one turn and of several
        return
    differ = sum(a != b for a, b in zip(released, truth)) / len(truth)
    # Missing hints drop only the releases (a share of the last turns); wrong ones flip any turn.
    assert (0.25 < differ < 0.35) if key == "hints_wrong" else (0 < differ < 0.3 * sum(truth) / len(truth) + 0.05)
