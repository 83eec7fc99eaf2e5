"""Fuzzing ``bench serve``'s reading of an event stream: whatever a server
sends, each event is taken without raising, and a request counts as
completed exactly when every event parsed, a choice finished and [DONE]
came."""

import json

from hypothesis import given
from hypothesis import strategies as st
from sagellm_plugin_server.bench import FAILURES, StreamCheck

texts = st.one_of(st.none(), st.text(max_size=5), st.integers())
finish = st.one_of(st.none(), st.sampled_from(["stop", "length"]), st.integers())
choice = st.fixed_dictionaries({"text": texts, "finish_reason": finish})
usage = st.one_of(
    st.none(), st.fixed_dictionaries({"completion_tokens": st.one_of(st.integers(-2, 50), st.booleans(), st.text())})
)
chunks = st.one_of(
    st.builds(
        lambda choices, usage: json.dumps({"choices": choices, **({"usage": usage} if usage is not None else {})}),
        st.lists(choice, max_size=2),
        usage,
    ),
    st.just('{"error": {"message": "x"}}'),
    st.just("[DONE]"),
    st.text(max_size=20),
    st.builds(json.dumps, st.recursive(st.none() | st.integers() | st.text(max_size=3), st.lists, max_leaves=5)),
    st.just("[" * 5000),
)


def is_json(data: str) -> bool:
    try:
        json.loads(data)
    except (ValueError, RecursionError):
        return False
    return True


def outcome(events: list[str]) -> tuple[str | None, int, StreamCheck]:
    """What ``bench serve`` makes of the events: as ``one`` reads them."""
    check = StreamCheck()
    for read, data in enumerate(events, 1):
        failure = check.take(data, float(read))
        if failure is not None:
            return failure, read, check
        if check.done:
            return check.end(), read, check
    return check.end(), len(events), check


@given(st.lists(chunks, max_size=8))
def test_completed_only_after_parsed_chunks_a_finish_reason_and_done(events):
    failure, read, check = outcome(events)
    assert failure is None or failure in FAILURES
    taken = events[:read]
    if failure is None:
        # Every event before [DONE] a completion chunk, one of them finishing a choice.
        assert taken[-1] == "[DONE]" and "[DONE]" not in taken[:-1]
        chunks = [json.loads(data) for data in taken[:-1]]
        assert all(isinstance(c, dict) and "error" not in c for c in chunks)
        assert any(isinstance(x.get("finish_reason"), str) for c in chunks for x in c.get("choices", []))
        assert check.tokens >= 0
    if failure == "truncated":
        assert read == len(events) and "[DONE]" not in events  # read to the end, and it never came
    if failure == "no_finish_reason":
        assert taken[-1] == "[DONE]"
    if any(not is_json(data) and data != "[DONE]" for data in taken):
        assert failure == "unparsable" and not is_json(taken[-1])  # the first such event ends it


@given(st.lists(st.text(), max_size=6))
def test_any_text_is_taken_without_raising(events):
    failure, _, _ = outcome(events)
    assert failure in FAILURES or (failure is None and "[DONE]" in events)


def test_text_before_the_first_token_sets_ttft_once():
    check = StreamCheck()
    assert check.take(json.dumps({"choices": [{"text": "", "finish_reason": None}]}), 1.0) is None
    assert check.first_text_s is None
    for now in (2.0, 3.0):
        assert check.take(json.dumps({"choices": [{"text": "a", "finish_reason": None}]}), now) is None
    assert check.first_text_s == 2.0 and check.tokens == 2
    assert check.take(json.dumps({"choices": [], "usage": {"completion_tokens": 7}}), 4.0) is None
    assert check.tokens == 7  # the server's count, once it gives one
