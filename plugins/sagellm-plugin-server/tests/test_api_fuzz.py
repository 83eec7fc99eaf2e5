"""Random request bodies against a live server, valid and not: every field
the API takes (and some it refuses), the client hints' ``x-sagellm-*``
headers among them, with values in range, out of range and of the wrong
type. Each answer is a 200 whose choices and stream are whole,
or an OpenAI error body of one line; afterwards every engine request the
200s made has ended and been counted, and no block is held."""

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sagellm_plugin_server.testing import Server, kv, metrics, server_config

# Per field: values the API takes, then values it refuses.
COMMON = {
    "model": (["tiny", None], ["gpt-4", 5]),
    "max_tokens": ([1, 3, "3"], [0, -1, 10**9, "x"]),
    "temperature": ([0, 0.7, 2], [2.5, -1, "hot"]),
    "top_p": ([1, 0.5], [0, 1.5]),
    "top_k": ([0, -1, 5], [-3, 0.5]),
    "min_p": ([0, 0.2], [2, -1]),
    "n": ([1, 2, 3], [0, -1, 10**6]),
    "seed": ([None, 0, 7], ["x", 1.5]),
    "stop": (["w5", ["w6", ""], None], [5, [5]]),
    "stream": ([True, False], ["maybe", 3]),
    "stream_options": ([{"include_usage": True}, None], [{"x": 1}]),
    "presence_penalty": ([0, 1.5, -2], [3]),
    "frequency_penalty": ([0, -0.5, 2], [-3]),
    "repetition_penalty": ([1, 1.5, 0.5], [0, -1]),
    "response_format": (
        [{"type": "text"}],
        [
            {"type": "json_object"},  # the tiny model's word-level tokenizer: refused, naming why
            {"type": "json_schema"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            "json",
        ],
    ),
    "user": (["u"], [5]),
    "tools": ([], [[]]),
    "logit_bias": ([], [{"5": 1}]),
    "kv_hints": (
        [
            {"retain_s": 5},
            {"release": True, "cache_key": "c1"},
            {"prefetch": True},
            {"pin": True},
            {"unpin": True},
            {"pin": 4, "retain_s": 0.5},
        ],
        [
            {"retain_s": -1},
            {"retain_s": "long"},
            {"pin": -1},
            {"pin": 10**6},
            {"release": "yes"},
            {"pin": 4, "unpin": 4},
            {"release": True, "prefetch": True},
            {"cache_key": ""},
            {"evict": True},
            "pin",
        ],
    ),
    "prompt_cache_key": (["conv-1"], [5, ""]),
}
# The hints' headers: values taken, then values refused.
HEADERS = {
    "x-sagellm-retain-s": (["5", "0"], ["soon", "-1", "nan"]),
    "x-sagellm-pin": (["true", "4"], ["1.5", "-4"]),
    "x-sagellm-release": (["true", "false"], ["maybe"]),
    "x-sagellm-prefetch": (["false"], ["2"]),
    "x-sagellm-cache-key": (["c1"], []),
}
COMPLETION = {
    "prompt": (["w5 w6", [5, 6, 7], [5, 6, 7, 8, 9]], ["", [], [999], [-1], 5, ["a"]]),
    "logprobs": ([None, 0, 2, 20], [21, -1]),
    "echo": ([True, False], ["x"]),
    "suffix": ([], ["x"]),
}
CHAT = {
    "messages": (
        [
            [{"role": "user", "content": "w5 w6"}],
            [{"role": "developer", "content": "w7"}, {"role": "user", "content": [{"type": "text", "text": "w5"}]}],
        ],
        [
            [],
            [{"role": "tool", "content": "x"}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            [{"role": "user", "content": [{"type": "text"}]}],
            [{"role": "user"}],
            "hi",
        ],
    ),
    "logprobs": ([True, False], [2, "x"]),
    "top_logprobs": ([0, 2], [25, -1]),
    "max_completion_tokens": ([2], [0]),
}


@st.composite
def bodies(draw, fields: dict) -> dict:
    """A body of valid values, with at most one field given a value the API refuses."""
    body = {}
    for name, (good, _) in fields.items():
        if good and draw(st.booleans()):
            body[name] = draw(st.sampled_from(good))
    required = "messages" if "messages" in fields else "prompt"
    body.setdefault(required, fields[required][0][0])
    broken = draw(st.sampled_from([None, None, *fields]))
    if broken is not None:
        body[broken] = draw(st.sampled_from(fields[broken][1]))
    return body


@st.composite
def headers(draw) -> dict:
    """Hint headers of valid values, with at most one a value the server refuses."""
    chosen = {name: draw(st.sampled_from(good)) for name, (good, _) in HEADERS.items() if draw(st.booleans())}
    broken = draw(st.sampled_from([None, None, *(name for name, (_, bad) in HEADERS.items() if bad)]))
    if broken is not None:
        chosen[broken] = draw(st.sampled_from(HEADERS[broken][1]))
    return chosen


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    """A server of this module's own: its random hints pin blocks, which no
    other module's server should inherit."""
    srv = Server(server_config(tmp_path_factory.mktemp("fuzz-server"), tiny_model_dir))
    yield srv
    srv.stop()


def test_random_requests_are_answered_whole_and_leave_nothing_held(server):
    before = metrics(server).get("sagellm:request_success_total", 0.0)
    engine_requests = 0

    @settings(max_examples=80, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(chat=st.booleans(), data=st.data())
    def one(chat, data):
        nonlocal engine_requests
        request = data.draw(bodies({**COMMON, **(CHAT if chat else COMPLETION)}))
        request.setdefault("max_tokens", 2)  # no request decodes its whole context
        hints = data.draw(st.one_of(st.just({}), headers()))
        path = "/v1/chat/completions" if chat else "/v1/completions"
        with httpx.stream("POST", f"{server.url}{path}", json=request, headers=hints, timeout=60) as response:
            text = response.read().decode()
            streamed = response.headers["content-type"].startswith("text/event-stream")
        if response.status_code != 200:
            assert response.status_code in (400, 404), (request, hints, response.status_code, text)
            err = json.loads(text)["error"]
            assert err["message"] and "\n" not in err["message"] and err["type"], (request, err)
            return
        n = request.get("n", 1)
        engine_requests += n
        if streamed:
            events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", (request, text)
            chunks = [json.loads(e) for e in events[:-1]]
            ended = {c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]}
            assert ended == set(range(n)), (request, text)
        else:
            answer = json.loads(text)
            assert [c["index"] for c in answer["choices"]] == list(range(n)), (request, answer)
            assert all(c["finish_reason"] for c in answer["choices"]), (request, answer)

    one()
    for _ in range(100):  # stop-string aborts are applied between steps
        stats = kv(server, check=True)
        if stats["requests_running"] == stats["requests_waiting"] == 0:
            break
        time.sleep(0.05)
    assert stats["requests_running"] == stats["requests_waiting"] == stats["blocks_held_by_requests"] == 0
    assert stats["invariants"] == "ok" and engine_requests > 0
    assert metrics(server)["sagellm:request_success_total"] - before == engine_requests
