"""The cluster's front against stand-in instances (httpx's mock transport,
no engine; each tokenizes with a real tokenizer and gives block keys from
a real radix cache, as an instance does): it routes by the blocks the
instances' KV events show, its own keys equal to the instances' (with a
salt and a tenant, and for any prompt: a property), hands a prefill
instance's request to a decode instance and counts how the pull ended,
counts every request forwarded or failed and the time it took to route
it, queues only a prompt's uncached tokens on an instance, and leaves no
load counted once requests have ended, whatever the bodies (fuzzed),
asking the instances for the keys or not."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# The front is the `serve` extra's (FastAPI, httpx, the server's tokenizer
# and chat messages): without it, nothing here runs.
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")
pytest.importorskip("sagellm_plugin_server")

from sagellm_plugin_cluster.events import BlockStored, KVEventBatch, encode  # noqa: E402
from sagellm_plugin_cluster.front import SWEEP_GRACE_S, Member, PromptKeys, build_front, transfer_keys  # noqa: E402
from sagellm_plugin_cluster.transports import store_key  # noqa: E402
from sagellm_plugin_server.protocol import ChatMessage  # noqa: E402

from sagellm_core.drivers.router import Router  # noqa: E402
from sagellm_core.kit.testing import settings_from_toml  # noqa: E402
from sagellm_core.types import Request  # noqa: E402

from .conftest import CONFIG, runtime  # noqa: E402

BLOCK = 4  # conftest.CONFIG's
SETTINGS = settings_from_toml(CONFIG.format(blocks=64))


def word_tokenizer():
    """A real tokenizer of 128 words ``w0`` .. ``w127`` with a chat template (the torch plugin's test model's)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(tokenizer_models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="w127", unk_token="w0")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ 'w2' if m['role'] == 'user' else 'w3' }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w4{% endif %}"
    )
    return tokenizer


TOKENIZER = word_tokenizer()
#: What an instance computes with: its own runtime's radix cache (a replay one, no model).
INSTANCE_RT = runtime()


def words(*numbers: int) -> str:
    return " ".join(f"w{n}" for n in numbers)


def tokens_of(prompt: str) -> list[int]:
    return list(TOKENIZER.encode(prompt))


def keys_of(ids: list[int], salt: str | None = None, tenant: str = "default") -> list[int]:
    """The keys an instance gives (``/kv/keys``): its prefix cache's, through its runtime."""
    request = Request("keys", ids, 1, cache_salt=salt, tenant=tenant)
    return list(INSTANCE_RT.host.block_keys(request, 0, len(ids) // BLOCK))


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
            if "messages" in body:
                try:
                    messages = [ChatMessage.model_validate(m).for_template() for m in body["messages"]]
                    ids = TOKENIZER.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                except Exception as exc:  # noqa: BLE001 - as the instance refuses them
                    return httpx.Response(400, json={"error": {"message": f"messages: {type(exc).__name__}"}})
                return httpx.Response(200, json={"tokens": list(ids["input_ids"] if hasattr(ids, "keys") else ids)})
            if not isinstance(body.get("prompt"), str):
                return httpx.Response(400, json={"error": {"message": "prompt: not a string"}})
            return httpx.Response(200, json={"tokens": tokens_of(body["prompt"])})
        if path == "/kv/keys":
            return httpx.Response(200, json={"keys": keys_of(body["token_ids"], body.get("cache_salt"))})
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


def front_of(instances: Instances, roles: dict[str, str], router: str, ask_instances: bool = False, **kwargs):
    members = [Member(name, role, f"http://{name}", pid=0) for name, role in roles.items()]
    routed_by = Router(settings_from_toml(CONFIG.format(blocks=64) + f'[router]\nplugin = "{router}"\n'))
    keys = PromptKeys(TOKENIZER, SETTINGS)
    transport = httpx.MockTransport(instances.handle)
    return build_front(members, routed_by, keys, transport=transport, ask_instances=ask_instances, **kwargs)


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


@pytest.mark.parametrize("ask_instances", [False, True])
def test_kv_aware_routes_to_the_instance_whose_events_hold_the_prompt(ask_instances: bool):
    names = ["a", "b", "c"]
    instances = Instances(names)
    prompt = words(*range(10, 30))
    instances.publish("c", keys_of(tokens_of(prompt)))
    instances.publish("a", keys_of(tokens_of(words(*range(40, 60)))))
    app = front_of(instances, dict.fromkeys(names, "colocated"), "kv-aware", ask_instances)

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
    asked = [path for _, path in instances.calls if path in ("/tokenize", "/kv/keys")]
    assert asked == (["/tokenize", "/kv/keys"] * 3 if ask_instances else [])
    assert front.keys_asked == (3 if ask_instances else 0) and front.route_times()["count"] == 3


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 127), max_size=40), st.none() | st.text(max_size=8), st.sampled_from(["default", "t1"]))
def test_front_keys_equal_the_instances(ids: list[int], salt: str | None, tenant: str):
    """Property: for any prompt, salt and tenant, the front's keys are the
    ones an instance's prefix cache gives, and its ids the tokenizer's."""
    keys = PromptKeys(TOKENIZER, SETTINGS)
    text = words(*ids)
    assert keys.token_ids({"prompt": text}, chat=False) == tokens_of(text) == ids
    assert keys.token_ids({"prompt": ids}, chat=False) == ids
    request = Request("r", ids, 1, cache_salt=salt, tenant=tenant)
    assert keys.keys(request) == keys_of(ids, salt, tenant)
    chat = keys.token_ids({"messages": [{"role": "user", "content": text}]}, chat=True)
    assert chat == [2, *ids, 4]  # the template's user turn, then its answer prompt


def test_front_leaves_what_it_cannot_tokenize_to_the_instance():
    keys = PromptKeys(TOKENIZER, SETTINGS)
    for body, chat in (
        ({"prompt": 3}, False),
        ({"prompt": [1, -2]}, False),
        ({"prompt": [True]}, False),
        ({"messages": []}, True),
        ({"messages": [{"role": "robot", "content": "w1"}]}, True),
        ({"messages": "w1"}, True),
    ):
        assert keys.token_ids(body, chat) is None, body


def test_kv_aware_queues_only_the_uncached_tokens_on_the_instance():
    """The load the front counts on an instance is the prompt's tokens not
    in its device cache: a request whose prefix is cached there queues its
    tail, one routed elsewhere its whole prompt."""
    names = ["a", "b"]
    instances = Instances(names)
    shared = list(range(10, 26))  # four blocks
    instances.publish("b", keys_of(shared))
    app = front_of(instances, dict.fromkeys(names, "colocated"), "kv-aware")
    front = app.state.front

    async def run() -> list[tuple[str, int]]:
        await poll_all(app)
        routed = []
        for tail in ([30, 31, 32], [40, 41, 42, 43, 44, 45]):
            _, member, decode, work = await front.route({"prompt": words(*shared, *tail)}, chat=False)
            assert decode is None
            routed.append((member.instance_id, work))
        # With b's queue past what the prompt costs on a: the whole prompt there.
        front.by_id["b"].prefill_tokens = 1000
        _, member, _, work = await front.route({"prompt": words(*shared, 50)}, chat=False)
        routed.append((member.instance_id, work))
        return routed

    assert asyncio.run(run()) == [("b", 3), ("b", 6), ("a", 17)]


def test_round_robin_takes_turns_and_counts_an_instance_down():
    names = ["a", "b"]
    instances = Instances(names)
    instances.down.add("b")
    app = front_of(instances, dict.fromkeys(names, "colocated"), "round-robin")
    answers = asyncio.run(send(app, [{"prompt": f"prompt {i}"} for i in range(4)]))
    assert [a.status_code for a in answers] == [200, 502, 200, 502]
    assert "instance b did not answer" in answers[1].json()["error"]["message"]
    front = app.state.front
    assert [e.split(":")[0] for e in front.errors] == ["instance b did not answer"] * 2
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
@given(
    st.lists(bodies, min_size=1, max_size=5),
    st.sampled_from(["round-robin", "least-loaded", "kv-aware"]),
    st.booleans(),
)
def test_fuzz_every_body_ends_forwarded_or_failed_and_no_load_is_left(sent: list[Any], router: str, ask: bool):
    instances = Instances(["a", "b"])
    app = front_of(instances, {"a": "colocated", "b": "colocated"}, router, ask_instances=ask)
    answers = asyncio.run(send(app, sent))
    front = app.state.front
    assert sum(front.counts.values()) == len(sent)
    for answer in answers:
        assert answer.status_code in (200, 400, 502)
        if answer.status_code != 200:
            assert "\n" not in answer.json()["error"]["message"]
    assert front.counts["forwarded"] == sum(m.routed for m in front.members) - sum(m.failed for m in front.members)
    assert loads(app) == [(0, 0, 0)] * 2


class TransferSides(Instances):
    """A prefill and a decode stand-in that write a transfer's keys on a
    real store as the transports do, each request ending as ``outcomes``
    says: ``done`` (every key deleted by the side that read it last),
    ``declined``, or a side that died mid-transfer, leaving what it wrote
    (``dead-decode``: the offer and the leased block ids; ``dead-prefill``:
    the claim, the block ids and an answer), or ``no-pull`` (the decode
    instance does not answer: the lease's key ends ``expired``)."""

    def __init__(self, store, outcomes: list[str]):
        super().__init__(["p", "d"])
        self.store, self.outcomes = store, list(outcomes)
        self.ended: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path not in ("/kv/prefill", "/kv/pull"):
            return super().handle(request)
        self.calls.append((request.url.host, path))
        body = json.loads(request.content)
        rid, link = body["request_id"], body["link"]
        lease, blocks, answers = transfer_keys(link, rid)
        outcome = self.outcomes[len(self.ended)]
        if path == "/kv/prefill":
            self.store.set(store_key(link, "peer"), "a standing key: the prefill side's description")
            self.store.set(blocks, "3,4")
            self.store.set(lease, "offer 2 64")
            return httpx.Response(200, json={"offered_blocks": 2})
        self.ended.append(rid)
        if outcome == "no-pull":
            self.store.delete_key(blocks)
            self.store.set(lease, "expired")  # the lease's deadline: kept for a decode side that never reads it
            raise httpx.ConnectError("refused", request=request)
        if outcome == "dead-prefill":
            self.store.set(lease, "read 0 2 1")
            self.store.set(answers + "1", "sending 1")
            return httpx.Response(200, json={"status": "failed"})
        if outcome == "dead-decode":
            return httpx.Response(200, json={"status": "failed"})
        for key in (lease, blocks):  # done or declined: each side deleted what it read last
            self.store.delete_key(key)
        return httpx.Response(200, json={"status": "done"})


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.sampled_from(["done", "declined", "dead-decode", "dead-prefill", "no-pull"]), min_size=1, max_size=8)
)
def test_the_store_holds_no_key_of_a_finished_transfer_once_its_lease_is_over(outcomes: list[str]):
    """Whatever each transfer's end, once every lease's deadline has passed
    the front has swept what dead sides or missing pulls left: no key of a
    finished transfer is on the store; a standing key (a link's ``peer``)
    stays; before a lease's deadline nothing of its transfer is swept."""
    import datetime
    import time

    dist = pytest.importorskip("torch.distributed")  # the store is torch's TCPStore

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    sides = TransferSides(store, outcomes)
    lease_s = 60.0
    app = front_of(sides, {"p": "prefill", "d": "decode"}, "round-robin", store=store, lease_s=lease_s)
    front = app.state.front
    answers = asyncio.run(send(app, [{"prompt": f"prompt {i} " + words(*range(12))} for i in range(len(outcomes))]))
    assert [a.status_code for a in answers] == [200] * len(outcomes)
    left = [o for o in outcomes if o != "done" and o != "declined"]
    asyncio.run(front.sweep_due(time.monotonic()))  # every lease still within its deadline: nothing swept
    before = front.store_figures()
    assert before["swept"] == 0 and before["to_sweep"] == len(outcomes)
    assert before["transfer_keys"] == 2 * left.count("dead-decode") + 3 * left.count("dead-prefill") + left.count(
        "no-pull"
    )
    asyncio.run(front.sweep_due(time.monotonic() + lease_s + SWEEP_GRACE_S))
    after = front.store_figures()
    assert after == {"transfer_keys": 0, "to_sweep": 0, "swept": before["transfer_keys"]}
    for rid in sides.ended:
        lease, blocks, answers_prefix = transfer_keys("p>d", rid)
        assert not [k for k in store.list_keys() if k in (lease, blocks) or k.startswith(answers_prefix)]
    assert store.list_keys() == [store_key("p>d", "peer")]
