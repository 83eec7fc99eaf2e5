"""The cluster's front against stand-in instances (httpx's mock transport,
no engine): it routes by the blocks the instances' KV events show, hands a
prefill instance's request to a decode instance and counts how the pull
ended, counts every request forwarded or failed, and leaves no load
counted once requests have ended, whatever the bodies (fuzzed)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# The front is the `serve` extra's (FastAPI, httpx): without it, nothing here runs.
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from sagellm_plugin_cluster.events import BlockStored, KVEventBatch, encode  # noqa: E402
from sagellm_plugin_cluster.front import Member, build_front  # noqa: E402

from sagellm_core.drivers.router import Router  # noqa: E402
from sagellm_core.kit.testing import settings_from_toml  # noqa: E402

from .conftest import CONFIG  # noqa: E402

BLOCK = 4  # conftest.CONFIG's


def tokens_of(prompt: str) -> list[int]:
    return [ord(c) % 50 + 1 for c in prompt][:64]


def keys_of(ids: list[int]) -> list[int]:
    return [hash(tuple(ids[: BLOCK * (i + 1)])) for i in range(len(ids) // BLOCK)]


class Instances:
    """Stand-ins for instance processes, by host name: each tokenizes, gives
    block keys, publishes the KV event batches a test gives it, and answers
    with its own name; hosts in ``down`` do not answer at all."""

    def __init__(self, names: list[str], pull_status: str = "done"):
        self.batches: dict[str, list[tuple[int, bytes]]] = {n: [] for n in names}
        self.down: set[str] = set()
        self.pull_status = pull_status
        self.calls: list[tuple[str, str]] = []

    def publish(self, name: str, keys: list[int]) -> None:
        stored = BlockStored(list(keys), None, [], BLOCK, None, "GPU", None)
        batches = self.batches[name]
        batches.append((len(batches), encode(KVEventBatch(0.0, [stored]))))

    def handle(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        self.calls.append((host, path))
        if host in self.down:
            raise httpx.ConnectError("refused", request=request)
        body = json.loads(request.content) if request.content else {}
        if path == "/tokenize":
            prompt = body.get("prompt") if "prompt" in body else json.dumps(body.get("messages"))
            if not isinstance(prompt, str):
                return httpx.Response(400, json={"error": {"message": "prompt: not a string"}})
            return httpx.Response(200, json={"tokens": tokens_of(prompt)})
        if path == "/kv/keys":
            return httpx.Response(200, json={"keys": keys_of(body["token_ids"])})
        if path == "/kv/events":
            start = int(request.url.params["start"])
            batches = self.batches[host]
            return httpx.Response(
                200, json={"batches": [[s, p.hex()] for s, p in batches if s >= start], "next": len(batches)}
            )
        if path == "/kv/prefill":
            return httpx.Response(200, json={"offered_blocks": len(body["token_ids"]) // BLOCK})
        if path == "/kv/pull":
            return httpx.Response(200, json={"status": self.pull_status})
        if body.get("stream"):
            chunks = [f"data: {json.dumps({'text': host, 'i': i})}\n\n" for i in range(3)] + ["data: [DONE]\n\n"]
            return httpx.Response(200, content="".join(chunks).encode(), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"choices": [{"text": host}]})


def front_of(instances: Instances, roles: dict[str, str], router: str):
    members = [Member(name, role, f"http://{name}", pid=0) for name, role in roles.items()]
    routed_by = Router(settings_from_toml(CONFIG.format(blocks=64) + f'[router]\nplugin = "{router}"\n'))
    return build_front(members, routed_by, transport=httpx.MockTransport(instances.handle))


async def send(app, bodies: list[Any]) -> list[httpx.Response]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front") as client:
        answers = []
        for body in bodies:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            answers.append(await client.post("/v1/completions", content=raw))
        return answers


async def poll_all(app) -> None:
    front = app.state.front
    for member in front.members:
        await front.poll(member)


def loads(app) -> list[tuple[int, int, int]]:
    return [(m.prefill_tokens, m.decode_requests, m.decode_tokens) for m in app.state.front.members]


def test_kv_aware_routes_to_the_instance_whose_events_hold_the_prompt():
    names = ["a", "b", "c"]
    instances = Instances(names)
    prompt = "the shared system prompt, then a question"
    instances.publish("c", keys_of(tokens_of(prompt)))
    instances.publish("a", keys_of(tokens_of("something else entirely, of equal length")))
    app = front_of(instances, dict.fromkeys(names, "colocated"), "kv-aware")

    async def run() -> list[httpx.Response]:
        await poll_all(app)
        return await send(app, [{"prompt": prompt, "max_tokens": 4}] * 3)

    answers = asyncio.run(run())
    assert [a.json()["choices"][0]["text"] for a in answers] == ["c", "c", "c"]
    front = app.state.front
    assert front.index.exact and front.index.applied == 2
    assert [m.routed for m in front.members] == [0, 0, 3]
    assert front.counts == {"forwarded": 3, "failed": 0}
    assert loads(app) == [(0, 0, 0)] * 3


def test_round_robin_takes_turns_and_counts_an_instance_down():
    names = ["a", "b"]
    instances = Instances(names)
    instances.down.add("b")
    app = front_of(instances, dict.fromkeys(names, "colocated"), "round-robin")
    answers = asyncio.run(send(app, [{"prompt": f"prompt {i}"} for i in range(4)]))
    assert [a.status_code for a in answers] == [200, 502, 200, 502]
    assert "instance b did not answer" in answers[1].json()["error"]["message"]
    front = app.state.front
    assert front.counts == {"forwarded": 2, "failed": 2}
    assert [(m.routed, m.failed) for m in front.members] == [(2, 0), (2, 2)]
    assert loads(app) == [(0, 0, 0)] * 2


def test_streamed_answer_relayed_unchanged():
    instances = Instances(["a"])
    app = front_of(instances, {"a": "colocated"}, "least-loaded")
    (answer,) = asyncio.run(send(app, [{"prompt": "hello there", "stream": True}]))
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    events = [line for line in answer.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and [json.loads(e[6:])["i"] for e in events[:-1]] == [0, 1, 2]
    assert app.state.front.counts == {"forwarded": 1, "failed": 0}
    assert loads(app) == [(0, 0, 0)]


def test_prefill_request_handed_to_decode_and_each_pull_counted():
    roles = {"p": "prefill", "d": "decode"}
    for status in ("done", "expired", "failed"):
        instances = Instances(list(roles), pull_status=status)
        app = front_of(instances, roles, "kv-aware")
        (answer,) = asyncio.run(send(app, [{"prompt": "a prompt of a few blocks"}]))
        # Whatever the pull's end, the decode instance answers (computing what was not pulled).
        assert answer.json()["choices"][0]["text"] == "d"
        served = [c for c in instances.calls if c[1] not in ("/tokenize", "/kv/keys", "/kv/events")]
        assert served == [("p", "/kv/prefill"), ("d", "/kv/pull"), ("d", "/v1/completions")]
        assert app.state.front.transfers == {"done": 0, "failed": 0, "expired": 0, status: 1}
    instances = Instances(list(roles))
    instances.down.add("p")
    app = front_of(instances, roles, "round-robin")
    (answer,) = asyncio.run(send(app, [{"prompt": "a prompt of a few blocks"}]))
    assert answer.json()["choices"][0]["text"] == "d"
    assert app.state.front.transfers == {"done": 0, "failed": 1, "expired": 0}
    assert loads(app) == [(0, 0, 0)] * 2


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
bodies = st.one_of(
    st.binary(max_size=40),
    json_values,
    st.fixed_dictionaries(
        {"prompt": st.one_of(st.text(max_size=30), json_values)},
        optional={
            "stream": st.booleans(),
            "max_tokens": st.one_of(st.integers(-5, 100), json_values),
            "prompt_cache_key": json_values,
            "messages": json_values,
        },
    ),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(bodies, min_size=1, max_size=5), st.sampled_from(["round-robin", "least-loaded", "kv-aware"]))
def test_fuzz_every_body_ends_forwarded_or_failed_and_no_load_is_left(sent: list[Any], router: str):
    instances = Instances(["a", "b"])
    app = front_of(instances, {"a": "colocated", "b": "colocated"}, router)
    answers = asyncio.run(send(app, sent))
    front = app.state.front
    assert sum(front.counts.values()) == len(sent)
    for answer in answers:
        assert answer.status_code in (200, 400, 502)
        if answer.status_code != 200:
            assert "\n" not in answer.json()["error"]["message"]
    assert front.counts["forwarded"] == sum(m.routed for m in front.members) - sum(m.failed for m in front.members)
    assert loads(app) == [(0, 0, 0)] * 2
