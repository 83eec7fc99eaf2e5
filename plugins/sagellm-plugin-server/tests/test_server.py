"""The server against the official openai client, on 127.0.0.1."""

import asyncio
import json
import random

import httpx
import openai
import pytest
from sagellm_plugin_server.testing import Server, client, kv, metrics, server_config
from sagellm_plugin_torch import testing
from sagellm_plugin_torch.engine import SamplingParams

from sagellm_core.types import Request


def test_completions_equal_the_engines_offline_greedy_output(server, tiny_model_dir, tmp_path):
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    got = client(server).completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    core = testing.engine_core(server.config)
    offline = core.generate([Request("x", prompt, 8)], lambda r: SamplingParams(max_tokens=8))["x"]
    assert got.choices[0].text == core.tokenizer.decode(offline, skip_special_tokens=True)
    assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens == len(offline)
    assert got.choices[0].finish_reason in ("stop", "length")


def test_streamed_completion_equals_the_whole_one(server):
    c = client(server)
    whole = c.completions.create(model="tiny", prompt="w20 w21 w22 w23", max_tokens=10, temperature=0)
    parts = list(
        c.completions.create(model="tiny", prompt="w20 w21 w22 w23", max_tokens=10, temperature=0, stream=True)
    )
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_streamed_and_whole(server):
    c = client(server)
    messages = [{"role": "system", "content": "w30 w31"}, {"role": "user", "content": "w40 w41 w42"}]
    whole = c.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens >= 1
    parts = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == whole.choices[0].message.content


def test_models_and_health(server):
    assert [m.id for m in client(server).models.list()] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_metrics_agree_with_kv_stats_and_the_requests_sent(server):
    before = metrics(server)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 60 + i] for i in range(5)]
    for p in prompts:
        client(server).completions.create(model="tiny", prompt=p, max_tokens=3, temperature=0)
    after, stats = metrics(server), kv(server)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert delta["sagellm:request_success_total"] == len(prompts)
    assert delta["sagellm:prefix_cache_queries_total"] == sum(len(p) for p in prompts)
    assert delta["sagellm:prefix_cache_hits_total"] >= 4 * 8  # the 8 shared tokens: two 4-token blocks, 4 repeats
    assert delta["sagellm:time_to_first_token_seconds_count"] == len(prompts)
    assert after["sagellm:num_requests_running"] == stats["requests_running"] == 0
    assert round(after["sagellm:kv_cache_usage_perc"] * stats["num_blocks"]) == stats["used_blocks"]
    assert stats["cached_blocks"] == stats["used_blocks"] and stats["blocks_held_by_requests"] == 0
    assert after["sagellm:hook_latency_seconds_count"] > 0
    assert after["sagellm:tenant_kv_blocks"] == 0  # every request ended: no tenant holds blocks


def test_reset_prefix_cache_evicts_what_no_request_holds(server):
    client(server).completions.create(model="tiny", prompt=list(range(30, 50)), max_tokens=2, temperature=0)
    assert kv(server)["cached_blocks"] > 0
    evicted = httpx.post(f"{server.url}/kv/reset_prefix_cache").json()["evicted_blocks"]
    stats = kv(server, check=True)
    assert evicted > 0 and stats["cached_blocks"] == 0 and stats["used_blocks"] == 0 and stats["invariants"] == "ok"


def test_a_tenant_header_reaches_the_runtime(server):
    httpx.post(
        f"{server.url}/v1/completions",
        headers={"x-sagellm-tenant": "acme"},
        json={"prompt": [5, 6, 7, 8, 9], "max_tokens": 1},
    ).raise_for_status()
    client(server).completions.create(model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=1, user="globex")
    assert {"acme", "globex"} <= set(kv(server)["tenants"])


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"model": "tiny", "max_tokens": 3}, 400, "prompt"),
        ({"model": "tiny", "prompt": "", "max_tokens": 3}, 400, "empty"),
        ({"model": "tiny", "prompt": "w5", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "w5", "max_tokens": 10**9}, 400, "output tokens"),
        ({"model": "gpt-4", "prompt": "w5"}, 404, "does not exist"),
        ({"model": "tiny", "prompt": " ".join(["w9"] * 1100), "max_tokens": 1}, 400, "tokens"),
        ({"model": "tiny", "prompt": "w5", "best_of": 3}, 400, "best_of"),
        ({"model": "tiny", "prompt": "w5", "n": 0}, 400, "n: Input should be greater than or equal to 1"),
        ({"model": "tiny", "prompt": "w5", "n": 5000}, 400, "n = 5000: more than [server] max_waiting"),
        ({"model": "tiny", "prompt": "w5", "tools": []}, 400, "tools: this server does not support this field"),
        ({"model": "tiny", "prompt": "w5", "logprobs": 21}, 400, "logprobs: Input should be less than or equal to 20"),
        ({"model": "tiny", "prompt": "w5", "echo": True, "logprobs": 1}, 400, "prompt's log-probabilities"),
        ({"model": "tiny", "prompt": "w5", "top_k": -2}, 400, "top_k"),
        ({"model": "tiny", "prompt": "w5", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"model": "tiny", "prompt": [5, 999]}, 400, "token ids"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, words):
    response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == status
    err = response.json()["error"]
    assert words in err["message"] and err["type"]
    assert client(server).completions.create(model="tiny", prompt="w5 w6", max_tokens=1).choices[0].finish_reason


def test_malformed_json_is_a_400(server):
    response = httpx.post(
        f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "error" in response.json()


def test_the_openai_client_sees_a_missing_model_as_not_found(server):
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="nope", prompt="w5", max_tokens=1)


def test_load_with_cancellations_leaves_no_block_held(server):
    """32 concurrent streaming clients, 1,000 requests, a tenth of them
    cancelled after their first chunk; bounded to two minutes."""
    rng = random.Random(0)
    prefixes = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27], [40, 41, 42, 43]]
    plan = [
        (
            rng.choice(prefixes) + [rng.randrange(50, 120) for _ in range(rng.randrange(1, 12))],
            rng.randrange(2, 12),
            i % 10 == 0,
        )
        for i in range(1000)
    ]

    before = metrics(server)["sagellm:request_success_total"]

    async def run() -> tuple[int, int]:
        limit = asyncio.Semaphore(32)
        done = cancelled = 0
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

            async def one(prompt, max_tokens, cancel):
                nonlocal done, cancelled
                async with limit:
                    body = {
                        "model": "tiny",
                        "prompt": prompt,
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "stream": True,
                    }
                    async with http.stream("POST", "/v1/completions", json=body) as response:
                        assert response.status_code == 200
                        async for line in response.aiter_lines():
                            if cancel and line.startswith("data: "):
                                cancelled += 1
                                return  # leaving the block closes the connection mid-stream
                            if line == "data: [DONE]":
                                done += 1

            await asyncio.gather(*(one(*p) for p in plan))
        return done, cancelled

    done, cancelled = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert done + cancelled == 1000 and cancelled == 100
    for _ in range(100):  # aborts are applied between steps
        stats = kv(server, check=True)
        if stats["requests_running"] == stats["requests_waiting"] == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert stats["requests_running"] == stats["requests_waiting"] == stats["blocks_held_by_requests"] == 0
    assert stats["used_blocks"] == stats["cached_blocks"] and stats["invariants"] == "ok"
    assert metrics(server)["sagellm:request_success_total"] - before == 1000  # aborted ones as "abort"
    assert "abort" in httpx.get(f"{server.url}/metrics").text


def test_a_full_waiting_queue_is_a_429_not_a_hang(tmp_path, tiny_model_dir):
    srv = Server(server_config(tmp_path, tiny_model_dir, max_waiting=1, max_num_seqs=1))
    try:

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0}
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(12)))

        statuses = [r.status_code for r in asyncio.run(burst())]
        assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}
        assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "w5", "max_tokens": 1}).status_code == 200
    finally:
        srv.stop()


def test_bench_serve_replays_a_mooncake_trace_against_the_server(server, tmp_path):
    import subprocess
    import sys

    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": i * 10, "input_length": 512 * 2, "output_length": 4, "hash_ids": [1, 2 + i % 3]}
        for i in range(12)
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "bench.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "sagellm_core.cli",
            "bench",
            "serve",
            "--url",
            server.url,
            "--trace",
            str(trace),
            "--words-per-block",
            "4",
            "--json",
            str(out),
            "--quiet",
        ],
        check=True,
    )
    report = json.loads(out.read_text())
    assert report["completed"] == 12 and report["failed"] == 0 and report["ttft_s"]["p50"] > 0


def test_the_grafana_dashboard_names_only_metrics_the_server_exports(server):
    import re
    from pathlib import Path

    dashboard = Path(__file__).resolve().parents[3] / "contrib" / "grafana" / "sagellm-dashboard.json"
    client(server).completions.create(model="tiny", prompt="w5 w6", max_tokens=2)  # every family has samples
    exported = set(metrics(server))
    named = set(re.findall(r"sagellm:[a-z_0-9]+", dashboard.read_text()))
    assert named and named <= exported, sorted(named - exported)


def test_a_stop_string_ends_the_text_before_it(server):
    c = client(server)
    whole = c.completions.create(model="tiny", prompt="w60 w61 w62", max_tokens=12, temperature=0).choices[0].text
    words = whole.split()
    assert len(words) >= 3, whole
    stop = words[2]
    cut = c.completions.create(model="tiny", prompt="w60 w61 w62", max_tokens=12, temperature=0, stop=[stop]).choices[0]
    assert cut.text == whole[: whole.find(stop)] and cut.finish_reason == "stop"
    streamed = list(
        c.completions.create(model="tiny", prompt="w60 w61 w62", max_tokens=12, temperature=0, stop=stop, stream=True)
    )
    assert "".join(p.choices[0].text for p in streamed) == cut.text and streamed[-1].choices[0].finish_reason == "stop"
    assert kv(server, check=True)["invariants"] == "ok"


def test_sampling_with_a_seed_is_reproducible(server):
    c = client(server)

    def sample(seed):
        return (
            c.completions.create(model="tiny", prompt="w7 w8", max_tokens=12, temperature=1.0, seed=seed)
            .choices[0]
            .text
        )

    assert sample(1) == sample(1)
    assert len({sample(s) for s in range(2, 6)}) > 1  # a near-uniform tiny model: different seeds differ


def test_bench_reads_sharegpt_conversations(tmp_path):
    from types import SimpleNamespace

    from sagellm_plugin_server import bench

    path = tmp_path / "sharegpt.json"
    path.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "human", "value": "hello there"},
                        {"from": "gpt", "value": "one two three four"},
                    ]
                },
                {"conversations": [{"from": "human", "value": "only a question"}]},
                {"conversations": [{"from": "human", "value": "why?"}, {"from": "gpt", "value": "because " * 100}]},
            ]
        )
    )
    args = SimpleNamespace(trace=str(path), words_per_block=32, max_tokens=64, max_requests=None, rate=2.0, seed=0)
    requests = bench.load(args)
    assert [r.prompt for r in requests] == ["hello there", "why?"]
    assert [r.max_tokens for r in requests] == [5, 64] and requests[0].arrival_s == 0 < requests[1].arrival_s
