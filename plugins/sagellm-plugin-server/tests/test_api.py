"""OpenAI API coverage against the official openai client: log-probabilities
(completions and chat, streamed and whole), ``n`` choices sharing the
prompt's KV blocks, penalties against transformers' generate, content parts,
echo, ``response_format``, ``/tokenize`` and ``/detokenize``, one
``max_model_len`` everywhere."""

import asyncio
import json

import httpx
import openai
import pytest
import torch
from sagellm_plugin_server.engine_thread import EngineThread
from sagellm_plugin_server.testing import Server, client, kv, metrics, server_config
from sagellm_plugin_torch import testing
from sagellm_plugin_torch.sampling import SamplingParams
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from sagellm_core.types import Request

# A prompt no other test sends (tokens 90-119 are used nowhere else): 42
# tokens, ten full blocks of 4 and a partial one.
SHARED = [117, 3, 118, 4] * 10 + [119, 3]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def ids_of(text: str) -> list[int]:
    """The tiny tokenizer's words back to ids (``w17`` is 17)."""
    return [int(word[1:]) for word in text.split()]


@torch.inference_mode()
def model_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


# ------------------------------------------------------------ logprobs --


def test_completion_logprobs_are_the_models_whole_and_streamed(server, hf_model):
    prompt = [5, 6, 7, 8, 9, 10]
    c = client(server)
    whole = c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=3).choices[0]
    lp = whole.logprobs
    generated = [int(t[1:]) for t in lp.tokens]
    assert len(generated) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    reference = model_logprobs(hf_model, prompt + generated)
    for i, token in enumerate(generated):
        row = reference[len(prompt) - 1 + i]
        assert lp.token_logprobs[i] == pytest.approx(float(row[token]), abs=1e-4)
        top = row.topk(3)
        assert list(lp.top_logprobs[i]) == [f"w{t}" for t in top.indices.tolist()]  # greedy: the chosen is the top
        assert list(lp.top_logprobs[i].values()) == pytest.approx(top.values.tolist(), abs=1e-4)
    for i in range(8):  # each offset is where its token's text starts
        end = lp.text_offset[i + 1] if i + 1 < 8 else len(whole.text)
        assert whole.text[lp.text_offset[i] : end].strip() == lp.tokens[i] or lp.tokens[i] == "w127"
    parts = list(
        c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=3, stream=True)
    )
    streamed = [p.choices[0].logprobs for p in parts if p.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs)
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_chat_logprobs_whole_and_streamed(server, hf_model):
    messages = [{"role": "user", "content": "w30 w31 w32"}]
    c = client(server)
    tokenized = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
    whole = c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    ).choices[0]
    content = whole.logprobs.content
    generated = [int(entry.token[1:]) for entry in content]
    reference = model_logprobs(hf_model, tokenized + generated)
    for i, entry in enumerate(content):
        row = reference[len(tokenized) - 1 + i]
        assert entry.logprob == pytest.approx(float(row[generated[i]]), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        assert [t.token for t in entry.top_logprobs] == [f"w{t}" for t in row.topk(2).indices.tolist()]
    parts = list(
        c.chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, stream=True
        )
    )
    streamed = [e for p in parts if p.choices and p.choices[0].logprobs for e in p.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = c.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0).choices[0]
    assert plain.logprobs is None and plain.message.content == whole.message.content


# ------------------------------------------------------------------- n --


def test_n_choices_share_the_prompts_blocks_and_equal_one_requests_output_at_temperature_0(server):
    c = client(server)
    before = metrics(server)
    three = c.completions.create(model="tiny", prompt=SHARED, max_tokens=6, temperature=0, n=3)
    after = metrics(server)
    # The siblings each hit every full block of the prompt (10 blocks of 4);
    # the first computed them.
    assert after["sagellm:prefix_cache_hits_total"] - before["sagellm:prefix_cache_hits_total"] == 2 * 40
    assert after["sagellm:prefix_cache_queries_total"] - before["sagellm:prefix_cache_queries_total"] == 3 * 42
    one = c.completions.create(model="tiny", prompt=SHARED, max_tokens=6, temperature=0).choices[0].text
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    assert [ch.text for ch in three.choices] == [one] * 3
    assert three.usage.prompt_tokens == 42 and three.usage.completion_tokens == 3 * 6
    chat = [{"role": "user", "content": "w90 w91 w92 w93 w94 w95 w96 w97 w98"}]
    single = c.chat.completions.create(model="tiny", messages=chat, max_tokens=5, temperature=0).choices[0]
    texts = {0: "", 1: "", 2: ""}
    for part in c.chat.completions.create(model="tiny", messages=chat, max_tokens=5, temperature=0, n=3, stream=True):
        for choice in part.choices:
            texts[choice.index] += choice.delta.content or ""
    assert list(texts.values()) == [single.message.content] * 3
    assert kv(server, check=True)["invariants"] == "ok"


def test_n_sampled_choices_differ_and_repeat_with_the_seed(server):
    c = client(server)

    def texts(seed):
        answer = c.completions.create(model="tiny", prompt="w7 w8 w9", max_tokens=10, temperature=1.0, n=3, seed=seed)
        return [ch.text for ch in answer.choices]

    first = texts(11)
    assert len(set(first)) == 3 and texts(11) == first


def test_n_choices_use_fewer_blocks_than_n_requests(tiny_model_dir, tmp_path):
    """The pool's used blocks at their peak, read as each step runs the
    model (after its blocks are allocated), in process: three choices of a
    42-token prompt against one."""
    core = testing.engine_core(server_config(tmp_path, tiny_model_dir))
    peak = [0]
    execute = core.runner.execute

    def execute_and_count():
        peak[0] = max(peak[0], core.rt.pool_usage().num_used_blocks)
        return execute()

    core.runner.execute = execute_and_count
    thread = EngineThread(core, 64)
    thread.start()

    async def run(n: int) -> tuple[int, list[list[int]]]:
        await thread.call(core.rt.reset_prefix_cache)
        peak[0] = 0
        group = [(Request(f"g{n}-{i}", SHARED, 6), SamplingParams(max_tokens=6)) for i in range(n)]
        outputs = await thread.submit(group)
        tokens: dict[str, list[int]] = {r.request_id: [] for r, _ in group}
        finished = 0
        while finished < n:
            out = await outputs.get()
            tokens[out.request_id].append(out.token_id)
            finished += out.finished
        return peak[0], list(tokens.values())

    try:
        one, (alone,) = asyncio.run(run(1))
        three, outputs = asyncio.run(run(3))
    finally:
        thread.stop()
    assert outputs == [alone] * 3
    # The prompt's ten full blocks once, and each choice's own blocks (its
    # partial prompt block and its output): 16, where three requests apart
    # would hold 3 x 11 as their prompts are computed.
    assert one == 12 and three == 10 + 3 * (one - 10) < 3 * one
    assert core.rt.counters.hit_blocks == 2 * 10


# ------------------------------------------------------------ penalties --


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens,
    as a transformers logits processor."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        generated = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


@pytest.mark.parametrize(
    "penalties",
    [{"repetition_penalty": 1.8}, {"presence_penalty": 1.5}, {"frequency_penalty": 0.8, "presence_penalty": -0.2}],
)
def test_penalties_change_the_output_as_transformers_processors_do(server, hf_model, penalties):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    c = client(server)
    extra = {k: v for k, v in penalties.items() if k == "repetition_penalty"}
    openai_args = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
    got = c.completions.create(
        model="tiny", prompt=prompt, max_tokens=16, temperature=0, extra_body=extra, **openai_args
    ).choices[0]
    plain = c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0).choices[0]
    processors = LogitsProcessorList()
    if openai_args:
        presence, frequency = openai_args.get("presence_penalty", 0), openai_args.get("frequency_penalty", 0)
        processors.append(OpenAIPenalties(len(prompt), presence, frequency))
    (reference,) = testing.hf_generate(
        hf_model, [prompt], 16, repetition_penalty=extra.get("repetition_penalty", 1.0), logits_processor=processors
    )
    eos = 127
    assert ids_of(got.text) == [t for t in reference if t != eos]
    assert got.text != plain.text


# ------------------------------------------------ content parts, echo --


def test_content_parts_are_the_text_they_hold(server):
    c = client(server)
    parts = [{"type": "text", "text": "w40 w41"}, {"type": "text", "text": "w42"}]
    joined = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w40 w41\nw42"}], max_tokens=4, temperature=0
    )
    listed = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=4, temperature=0
    )
    assert listed.usage.prompt_tokens == joined.usage.prompt_tokens
    assert listed.choices[0].message.content == joined.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match=r"messages.0.content: part 1 is of type 'image_url'"):
        c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": [parts[0], {"type": "image_url", "image_url": {"url": "x"}}]}],
            max_tokens=4,
        )


def test_echo_puts_the_prompt_before_the_completion(server):
    c = client(server)
    plain = c.completions.create(model="tiny", prompt="w50 w51", max_tokens=5, temperature=0).choices[0].text
    echoed = c.completions.create(model="tiny", prompt="w50 w51", max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == "w50 w51" + plain
    streamed = list(
        c.completions.create(model="tiny", prompt=[50, 51], max_tokens=5, temperature=0, echo=True, stream=True)
    )
    assert streamed[0].choices[0].text == "w50 w51"
    assert "".join(p.choices[0].text for p in streamed) == "w50 w51" + plain


def test_unsupported_fields_are_refused_by_name(server):
    c = client(server)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for kwargs, field in [
        ({"tools": tools}, "tools"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs: needs logprobs = true"),
    ]:
        with pytest.raises(openai.BadRequestError, match=field):
            c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "w5"}], max_tokens=2, **kwargs
            )


# -------------------------------------------- tokenize, max_model_len --


def test_tokenize_and_detokenize_agree_with_the_completions_endpoints(server):
    c = client(server)
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "w5 w6 w7", "return_token_strs": True}).json()
    assert tokens["tokens"] == [5, 6, 7] and tokens["count"] == 3 and tokens["token_strs"] == ["w5", "w6", "w7"]
    assert c.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=1).usage.prompt_tokens == 3
    messages = [{"role": "system", "content": "w8"}, {"role": "user", "content": [{"type": "text", "text": "w9"}]}]
    chat = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": messages}).json()
    answer = c.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert chat["count"] == answer.usage.prompt_tokens
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [5, 6, 7]}).json() == {"prompt": "w5 w6 w7"}
    for path, body, words in [
        ("/detokenize", {"tokens": [5, 500]}, "token ids must lie in [0, 128)"),
        ("/tokenize", {"prompt": "w5", "messages": messages}, "either prompt or messages"),
        ("/tokenize", {"messages": messages, "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"model": "gpt-4", "prompt": "w5"}, "does not exist"),
    ]:
        response = httpx.post(f"{server.url}{path}", json=body)
        assert response.status_code in (400, 404) and words in response.json()["error"]["message"]


def test_max_model_len_is_one_figure_everywhere(server):
    c = client(server)
    (model,) = c.models.list().data
    limit = model.model_extra["max_model_len"]
    assert limit == 512  # the tiny model's context; the pool (256 blocks of 4) holds more
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "w5"}).json()["max_model_len"] == limit
    prompt = [5] * (limit - 4)
    assert c.completions.create(model="tiny", prompt=prompt, max_tokens=4).usage.prompt_tokens == limit - 4
    with pytest.raises(openai.BadRequestError, match=rf"exceed max_model_len {limit}"):
        c.completions.create(model="tiny", prompt=prompt, max_tokens=5)
    with pytest.raises(openai.BadRequestError, match=rf"max_model_len is {limit}"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 " * limit}])


# ------------------------------------------------------ response_format --

SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ripe": {"type": "boolean"}},
    "required": ["colour", "ripe"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def bpe_server(tmp_path_factory, bpe_model_dir):
    srv = Server(server_config(tmp_path_factory.mktemp("bpe-server"), bpe_model_dir))
    yield srv
    srv.stop()


def test_a_json_schema_response_parses_and_follows_the_schema(bpe_server):
    c = client(bpe_server)
    messages = [{"role": "user", "content": "A fruit, as JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "fruit", "schema": SCHEMA}}
    greedy = c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=40, temperature=0, response_format=response_format
    )
    sampled = c.chat.completions.create(
        model="tiny", messages=messages, max_tokens=40, temperature=1.0, seed=4, n=3, response_format=response_format
    )
    for choice in [*greedy.choices, *sampled.choices]:
        value = json.loads(choice.message.content)
        assert set(value) == {"colour", "ripe"} and value["colour"] in SCHEMA["properties"]["colour"]["enum"]
        assert isinstance(value["ripe"], bool) and choice.finish_reason == "stop"
    plain = c.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    with pytest.raises(json.JSONDecodeError):
        json.loads(plain.choices[0].message.content)  # the random model does not write JSON by itself
    streamed = c.completions.create(
        model="tiny",
        prompt="JSON:",
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"response_format": response_format},
    )
    assert json.loads("".join(p.choices[0].text for p in streamed))["colour"] in ("red", "green", "blue")


def test_a_bad_schema_is_a_400_naming_it(bpe_server):
    response = httpx.post(
        f"{bpe_server.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        },
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("response_format.json_schema.schema: ")


def test_json_object_is_an_object_grammar(bpe_model_dir):
    from sagellm_plugin_server.protocol import ResponseFormat
    from sagellm_plugin_server.structured import Grammars
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bpe_model_dir)
    grammars = Grammars(tokenizer, len(tokenizer))
    (constraint,) = grammars.constraints(ResponseFormat(type="json_object"), 1)
    bitmask = torch.zeros((1, (len(tokenizer) + 31) // 32), dtype=torch.int32)

    def allowed(token: int) -> bool:
        constraint.fill_bitmask(bitmask, 0)
        return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)

    assert not allowed(tokenizer.encode("[1]")[0]) and not allowed(tokenizer.eos_token_id)
    for token in tokenizer.encode('{"a":[1,"x"]}'):
        assert allowed(token)
        constraint.accept(token)
    assert allowed(tokenizer.eos_token_id) and constraint.matcher.is_accepting()


def test_without_llguidance_response_format_is_a_400_naming_the_extra(monkeypatch, tiny_model_dir):
    import sys

    from sagellm_plugin_server.protocol import ResponseFormat
    from sagellm_plugin_server.structured import Grammars, StructuredOutputError
    from transformers import AutoTokenizer

    monkeypatch.setitem(sys.modules, "llguidance", None)
    grammars = Grammars(AutoTokenizer.from_pretrained(tiny_model_dir), 128)
    with pytest.raises(StructuredOutputError, match=r"pip install 'sagellm-plugin-server\[structured\]'"):
        grammars.constraints(ResponseFormat(type="json_object"), 1)
