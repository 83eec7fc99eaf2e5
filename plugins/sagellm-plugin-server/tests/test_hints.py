"""Client KV hints through the server and the official openai client
(``extra_body``) or the ``x-sagellm-*`` headers: a released conversation's
blocks are evicted before older ones, a prefetch brings a prefix back from
the host tier so the next request hits it on the device, pins stay within
``[server] pin_budget_blocks``, and a hint the server cannot take is a 400
naming it."""

import httpx
import openai
import pytest
from sagellm_plugin_server.testing import Server, client, kv
from sagellm_plugin_torch import testing

BLOCK = 4
A, B = list(range(10, 34)), list(range(40, 64))  # two conversations' prompts: 6 blocks each


def start(folder, model, eviction: str, offload: bool = False, pin_budget: int = 8) -> Server:
    config = testing.write_config(
        folder,
        model=str(model),
        num_blocks=40,
        block_size=BLOCK,
        offload=offload,
        host_blocks=64,
        eviction=eviction,
        extra=f'[server]\nmodel_name = "tiny"\npin_budget_blocks = {pin_budget}\n',
    )
    return Server(config)


def hits(server: Server, tenant: str) -> int:
    """Blocks the tenant's requests found cached on the device so far."""
    return kv(server)["tenants"].get(tenant, {}).get("hit_blocks", 0)


def complete(server: Server, prompt: list[int], tenant: str = "default", extra_headers=None, **extra):
    headers = {"x-sagellm-tenant": tenant, **(extra_headers or {})}
    return client(server).completions.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, extra_headers=headers, **extra
    )


@pytest.fixture(scope="module")
def hinted(tmp_path_factory, tiny_model_dir):
    srv = start(tmp_path_factory.mktemp("hinted"), tiny_model_dir, "hints", pin_budget=4)
    yield srv
    srv.stop()


@pytest.mark.parametrize("eviction, given", [("hints", "body"), ("hints", "header"), ("lru", "body")])
def test_a_released_conversation_is_evicted_before_an_older_one(tmp_path, tiny_model_dir, eviction, given):
    """A, then B, then A's last turn marked ``release``: LRU would evict B
    (the older) when room is needed; the hints policy evicts A's blocks."""
    server = start(tmp_path, tiny_model_dir, eviction)
    try:
        complete(server, A, extra_body={"prompt_cache_key": "conv-a"})
        complete(server, B, extra_body={"prompt_cache_key": "conv-b"})
        last_turn = A + list(range(70, 78))
        if given == "body":
            complete(server, last_turn, extra_body={"prompt_cache_key": "conv-a", "kv_hints": {"release": True}})
        else:
            complete(server, last_turn, extra_headers={"x-sagellm-release": "true", "x-sagellm-cache-key": "conv-a"})
        before = kv(server)
        # A new prompt that needs four blocks more than are free: four cached blocks go.
        filler = [80 + i % 40 for i in range((before["free_blocks"] + 4) * BLOCK - 1)]
        complete(server, filler)
        assert kv(server)["evicted_blocks"] - before["evicted_blocks"] == 4
        complete(server, B, tenant="probe-b")
        b_hits = hits(server, "probe-b")
        whole_b = (len(B) - 1) // BLOCK  # (the last prompt token is always computed)
        if eviction == "hints":
            assert b_hits == whole_b  # B untouched: A's own blocks went
        else:
            assert b_hits < whole_b  # LRU: the older conversation went
    finally:
        server.stop()


def test_a_prefetch_brings_a_prefix_from_the_host_tier_to_the_device(tmp_path, tiny_model_dir):
    """The hint starts the host store's prefetch of the prompt's blocks
    (counted: started, none late or wasted), its admission loads them onto
    the device, and the next request finds every block there."""
    server = start(tmp_path, tiny_model_dir, "lru", offload=True)
    try:
        complete(server, A)
        assert httpx.post(f"{server.url}/kv/reset_prefix_cache").json()["evicted_blocks"] > 0  # A's blocks to the host
        before = kv(server)
        host_before, prefetch_before = before["host_hit_blocks"], before["stores"]["host"]
        assert prefetch_before["prefetch_rounds"] == 0
        answer = complete(server, A, tenant="prefetch", extra_body={"kv_hints": {"prefetch": True}})
        assert answer.choices[0].text == ""  # a prefetch answers no text
        after = kv(server)
        loaded = after["host_hit_blocks"] - host_before
        assert loaded > 0 and hits(server, "prefetch") == 0
        store = after["stores"]["host"]
        assert (store["prefetch_rounds"], store["prefetched_blocks"]) == (1, loaded)
        assert (store["late_prefetches"], store["wasted_prefetched_blocks"]) == (0, 0)
        complete(server, A, tenant="next")
        stats = kv(server, check=True)
        assert hits(server, "next") == (len(A) - 1) // BLOCK  # every block on the device
        assert stats["host_hit_blocks"] - host_before == loaded and stats["invariants"] == "ok"
        assert stats["stores"]["host"]["prefetch_rounds"] == 1  # a request without the hint starts none
    finally:
        server.stop()


def test_a_prefetch_of_a_prefix_no_store_holds_starts_nothing(tmp_path, tiny_model_dir):
    server = start(tmp_path, tiny_model_dir, "lru", offload=True)
    try:
        answer = complete(server, B, extra_body={"kv_hints": {"prefetch": True}})
        assert answer.choices[0].text == ""
        stats = kv(server, check=True)
        assert stats["stores"]["host"]["prefetch_rounds"] == 0 and stats["host_hit_blocks"] == 0
        assert stats["invariants"] == "ok"
    finally:
        server.stop()


def test_pins_stay_within_the_tenants_budget(hinted):
    pinned = {"kv_hints": {"pin": 12}}  # three blocks of the budget's four
    complete(hinted, A, tenant="acme", extra_body=pinned)
    complete(hinted, A, tenant="acme", extra_body=pinned)  # the same prefix again costs nothing more
    with pytest.raises(openai.BadRequestError) as refused:
        complete(hinted, B, tenant="acme", extra_body=pinned)
    assert "kv_hints.pin" in str(refused.value) and "pin_budget_blocks" in str(refused.value)
    complete(hinted, B, tenant="globex", extra_body=pinned)  # another tenant's budget
    complete(hinted, A, tenant="acme", extra_body={"kv_hints": {"unpin": 12}})
    complete(hinted, B, tenant="acme", extra_headers={"x-sagellm-pin": "12"})  # room again
    with pytest.raises(openai.BadRequestError, match="kv_hints.unpin"):
        complete(hinted, A, tenant="acme", extra_body={"kv_hints": {"unpin": 12}})  # unpinned already


def test_chat_takes_hints_too(hinted):
    answer = client(hinted).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "w5 w6"}],
        max_tokens=1,
        extra_body={"kv_hints": {"retain_s": 30, "cache_key": "chat-1"}},
    )
    assert answer.choices[0].finish_reason
    with pytest.raises(openai.BadRequestError, match="kv_hints.retain_s"):
        client(hinted).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w5"}], extra_body={"kv_hints": {"retain_s": -1}}
        )


@pytest.mark.parametrize(
    "body, headers, param",
    [
        ({"kv_hints": {"retain_s": -1}}, {}, "kv_hints.retain_s"),
        ({"kv_hints": {"retain_s": "long"}}, {}, "kv_hints.retain_s"),
        ({"kv_hints": {"pin": -3}}, {}, "kv_hints.pin"),
        ({"kv_hints": {"pin": 999}}, {}, "kv_hints.pin"),
        ({"kv_hints": {"pin": 2}}, {}, "kv_hints.pin"),  # less than one block
        ({"kv_hints": {"unpin": 1.5}}, {}, "kv_hints.unpin"),
        ({"kv_hints": {"pin": 8, "unpin": 8}}, {}, "kv_hints.unpin"),
        ({"kv_hints": {"release": "yes"}}, {}, "kv_hints.release"),
        ({"kv_hints": {"release": True, "retain_s": 5}}, {}, "kv_hints.release"),
        ({"kv_hints": {"prefetch": 1}}, {}, "kv_hints.prefetch"),
        ({"kv_hints": {"prefetch": True}, "stream": True}, {}, "stream"),
        ({"kv_hints": {"cache_key": ""}}, {}, "kv_hints.cache_key"),
        ({"kv_hints": {"cache_key": "x" * 257}}, {}, "kv_hints.cache_key"),
        ({"kv_hints": {"evict": True}}, {}, "kv_hints.evict"),
        ({"kv_hints": "pin"}, {}, "kv_hints"),
        ({"prompt_cache_key": 5}, {}, "prompt_cache_key"),
        ({"prompt_cache_key": "a", "kv_hints": {"cache_key": "b"}}, {}, "prompt_cache_key"),
        ({}, {"x-sagellm-retain-s": "soon"}, "x-sagellm-retain-s"),
        ({}, {"x-sagellm-retain-s": "inf"}, "x-sagellm-retain-s"),
        ({}, {"x-sagellm-release": "maybe"}, "x-sagellm-release"),
        ({}, {"x-sagellm-pin": "1.5"}, "x-sagellm-pin"),
        ({"kv_hints": {"release": True}}, {"x-sagellm-release": "false"}, "x-sagellm-release"),
    ],
)
def test_a_hint_the_server_cannot_take_is_a_400_naming_it(hinted, body, headers, param):
    before = kv(hinted)["requests_running"], kv(hinted)["evicted_blocks"]
    response = httpx.post(f"{hinted.url}/v1/completions", json={"prompt": A, "max_tokens": 1, **body}, headers=headers)
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    assert err["param"] == param and param in err["message"] and "\n" not in err["message"], err
    assert (kv(hinted)["requests_running"], kv(hinted)["evicted_blocks"]) == before
