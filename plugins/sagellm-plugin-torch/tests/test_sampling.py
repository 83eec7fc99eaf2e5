"""The batched sampler against transformers' own logits processors on the
same logits, its draws against its distribution, seeds that do not depend
on the batch, log-probabilities, constraints; and the engine with it on a
tiny random Llama against transformers' ``generate``."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sagellm_plugin_torch import testing as helpers
from sagellm_plugin_torch.sampling import MAX_LOGPROBS, Sampler, SamplingParams
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sagellm_core.types import Request

VOCAB = 48

rows = st.fixed_dictionaries(
    {
        "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.7]),
        "top_k": st.sampled_from([0, 1, 3, 20, VOCAB + 5]),
        "top_p": st.sampled_from([1.0, 0.9, 0.5, 0.05]),
        "min_p": st.sampled_from([0.0, 0.05, 0.3]),
        "presence_penalty": st.sampled_from([0.0, 0.5, -1.0, 2.0]),
        "frequency_penalty": st.sampled_from([0.0, 0.3, -0.5, 1.5]),
        "repetition_penalty": st.sampled_from([1.0, 1.3, 0.7, 2.0]),
        "prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
        "generated": st.lists(st.integers(0, VOCAB - 1), max_size=10),
    }
)
PARAMS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def forced(token: int) -> torch.Tensor:
    """Logits whose every processed form picks ``token``."""
    logits = torch.zeros(VOCAB)
    logits[token] = 1e4
    return logits


def with_history(sampler: Sampler, specs: list[dict]) -> list:
    """Each row tracked, and its generated tokens fed through the sampler
    (forced logits, greedy), as a real run would have."""
    seqs = []
    for spec in specs:
        params = SamplingParams(max_tokens=64, **{k: spec[k] for k in PARAMS})
        seqs.append(sampler.track(params, spec["prompt"]))
    for seq, spec in zip(seqs, specs):
        greedy = sampler.track(
            SamplingParams(
                max_tokens=64,
                presence_penalty=seq.params.presence_penalty,
                frequency_penalty=seq.params.frequency_penalty,
                repetition_penalty=seq.params.repetition_penalty,
            ),
            spec["prompt"],
        )
        for token in spec["generated"]:
            assert sampler.sample(forced(token)[None], [greedy])[0] == [token]
        # The history lives in the row's slot: hand it to the row under test.
        seq.slot, greedy.slot = greedy.slot, None
    return seqs


def transformers_probs(logits: torch.Tensor, spec: dict) -> torch.Tensor:
    """transformers' processors and warpers, in ``generate``'s order, on one
    row; presence and frequency penalties as a sequence bias per token
    generated (OpenAI's definition: ``- frequency * count - presence``)."""
    ids = torch.tensor([spec["prompt"] + spec["generated"]])
    chain = LogitsProcessorList()
    if spec["repetition_penalty"] != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(spec["repetition_penalty"]))
    counts: dict[int, int] = {}
    for t in spec["generated"]:
        counts[t] = counts.get(t, 0) + 1
    bias = {(t,): -(spec["frequency_penalty"] * c + spec["presence_penalty"]) for t, c in counts.items()}
    if any(bias.values()):
        chain.append(SequenceBiasLogitsProcessor(bias))
    scores = chain(ids, logits[None].clone())
    if spec["temperature"] == 0:
        return torch.nn.functional.one_hot(scores.argmax(-1), VOCAB).float()[0]
    warpers = LogitsProcessorList([TemperatureLogitsWarper(spec["temperature"])])
    if spec["top_k"]:
        warpers.append(TopKLogitsWarper(spec["top_k"]))
    if spec["top_p"] < 1:
        warpers.append(TopPLogitsWarper(spec["top_p"]))
    if spec["min_p"]:
        warpers.append(MinPLogitsWarper(spec["min_p"]))
    return torch.softmax(warpers(ids, scores), dim=-1)[0]


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(rows, min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_the_distribution_equals_transformers_processors_and_draws_lie_in_it(specs, seed):
    logits = torch.randn(len(specs), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    sampler = Sampler(VOCAB)
    seqs = with_history(sampler, specs)
    probs = sampler.distribution(logits, seqs)
    for row, spec in enumerate(specs):
        expected = transformers_probs(logits[row], spec)
        assert torch.allclose(probs[row], expected, atol=1e-5), (spec, probs[row], expected)
    tokens, _ = sampler.sample(logits, seqs)
    for row, (token, spec) in enumerate(zip(tokens, specs)):
        assert probs[row, token] > 0
        if spec["temperature"] == 0:
            assert probs[row, token] == 1  # greedy rows take the argmax


def test_draws_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.3, 1.5]])
    sampler = Sampler(8)
    seq = sampler.track(SamplingParams(temperature=0.8, top_p=0.95, seed=7), [0])
    probs = sampler.distribution(logits, [seq])[0]
    draws = 4000
    counts = torch.bincount(torch.tensor([sampler.sample(logits, [seq])[0][0] for _ in range(draws)]), minlength=8)
    # Within four standard deviations of each token's expected count.
    for token in range(8):
        p = float(probs[token])
        assert abs(int(counts[token]) - p * draws) <= 4 * math.sqrt(draws * p * (1 - p)) + 1, (counts, probs)
    assert int(counts[probs == 0].sum()) == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31),
    others=st.lists(rows, max_size=5),
    position=st.integers(0, 5),
    logits_seed=st.integers(0, 2**16),
)
def test_a_seeded_request_draws_the_same_tokens_whatever_it_is_batched_with(seed, others, position, logits_seed):
    steps = 6
    gen = torch.Generator().manual_seed(logits_seed)
    own = [torch.randn(VOCAB, generator=gen) for _ in range(steps)]
    params = SamplingParams(temperature=1.0, top_k=30, seed=seed)

    def run(companions: list[dict]) -> list[int]:
        sampler = Sampler(VOCAB)
        mine = sampler.track(params, [1, 2, 3])
        rest = with_history(sampler, companions)
        at = min(position, len(rest))
        tokens = []
        for step in range(steps):
            batch = [*rest[:at], mine, *rest[at:]]
            logits = torch.randn(len(batch), VOCAB, generator=gen)
            logits[at] = own[step]
            tokens.append(sampler.sample(logits, batch)[0][at])
        return tokens

    assert run([]) == run(others)


def test_logprobs_are_the_models_own_and_the_top_ones_come_sorted():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=gen) * 2
    sampler = Sampler(VOCAB)
    asks = [None, 0, 5, MAX_LOGPROBS]
    seqs = [
        sampler.track(SamplingParams(temperature=t, logprobs=k, repetition_penalty=1.5), [1, 2])
        for t, k in zip([0.0, 1.0, 0.0, 0.7], asks)
    ]
    tokens, logprobs = sampler.sample(logits, seqs)
    model = torch.log_softmax(logits, dim=-1)  # before penalties and temperature
    assert logprobs[0] is None
    for row in range(1, 4):
        got = logprobs[row]
        assert got.logprob == pytest.approx(float(model[row, tokens[row]]), abs=1e-6)
        assert len(got.top) == asks[row]
        expected = model[row].topk(asks[row]) if asks[row] else None
        if expected is not None:
            assert [t for t, _ in got.top] == expected.indices.tolist()
            assert [v for _, v in got.top] == pytest.approx(expected.values.tolist(), abs=1e-6)


class AllowOnly:
    """A constraint that allows a fixed set of tokens and records what it is told."""

    def __init__(self, allowed: set[int]):
        self.allowed = allowed
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for t in self.allowed:
            bitmask[row, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)


def test_a_constraint_bounds_every_draw_and_hears_each_token():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    allowed = {3, 31, 32, 47}
    greedy, sampled = AllowOnly(allowed), AllowOnly(allowed)
    sampler = Sampler(VOCAB)
    seqs = [
        sampler.track(SamplingParams(constraint=greedy), [1]),
        sampler.track(SamplingParams(temperature=1.5, seed=1, constraint=sampled), [1]),
    ]
    for _ in range(20):
        tokens, _ = sampler.sample(logits, seqs)
        assert tokens[0] == max(allowed, key=lambda t: float(logits[0, t]))
        assert tokens[1] in allowed
    assert len(greedy.accepted) == len(sampled.accepted) == 20 and set(sampled.accepted) <= allowed


def test_a_released_penalty_row_starts_a_new_request_afresh():
    sampler = Sampler(VOCAB)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(9))
    spec = {"prompt": [4], "generated": [7, 7, 9], "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    spec |= {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2}
    fresh = {**spec, "generated": []}
    for round_ in range(12):  # more requests than the table's first rows, one at a time
        (seq,) = with_history(sampler, [spec if round_ % 2 else fresh])
        expected = transformers_probs(logits[0], spec if round_ % 2 else fresh)
        assert torch.allclose(sampler.distribution(logits, [seq])[0], expected, atol=1e-5)
        sampler.release(seq)


def test_parameters_out_of_range_are_refused():
    for bad in [{"top_p": 0.0}, {"top_k": -1}, {"min_p": 1.5}, {"repetition_penalty": 0.0}, {"logprobs": 21}]:
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ------------------------------------------------------------ the engine --


@pytest.fixture
def engine(tmp_path, tiny_model_dir):
    return helpers.engine_core(
        helpers.write_config(tmp_path, model=str(tiny_model_dir), num_blocks=64, block_size=4, max_num_seqs=8)
    )


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 30, 31, 32, 33], [50, 51]]


def test_penalised_greedy_decoding_equals_transformers_generate(engine):
    model = engine.runner.model
    results = engine.generate(
        helpers.requests(PROMPTS, 12), lambda r: SamplingParams(max_tokens=12, repetition_penalty=1.8)
    )
    outputs = [results[f"r{i}"] for i in range(len(PROMPTS))]
    assert outputs == helpers.hf_generate(model, PROMPTS, 12, repetition_penalty=1.8)
    assert outputs != helpers.hf_generate(model, PROMPTS, 12)  # the penalty changed the output


def test_greedy_with_logprobs_keeps_the_tokens_and_reports_the_models_logprobs(engine):
    plain = engine.generate(helpers.requests(PROMPTS, 6, prefix="p"))
    outputs: dict[str, list] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(Request(f"l{i}", prompt, 6), SamplingParams(max_tokens=6, logprobs=3))
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    model = engine.runner.model
    for i, prompt in enumerate(PROMPTS):
        tokens = [o.token_id for o in outputs[f"l{i}"]]
        assert tokens == plain[f"p{i}"]
        with torch.inference_mode():
            logp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
        for j, out in enumerate(outputs[f"l{i}"]):
            row = logp[len(prompt) - 1 + j]
            assert out.logprobs.logprob == pytest.approx(float(row[out.token_id]), abs=1e-4)
            assert [t for t, _ in out.logprobs.top] == row.topk(3).indices.tolist()


def test_sampled_requests_with_seeds_are_reproducible_in_the_engine(engine):
    def run(prefix: str, count: int) -> list[list[int]]:
        results = engine.generate(
            helpers.requests(PROMPTS * count, 8, prefix=prefix),
            lambda r: SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=int(r.request_id[1:]) % 3),
        )
        return [results[f"{prefix}{i}"] for i in range(len(PROMPTS))]

    assert run("a", 1) == run("b", 2)  # the same seeds, alone or beside others
    engine.rt.check_invariants()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_launch_never_waits_for_the_device():
    sampler = Sampler(VOCAB)
    logits = torch.randn(4, VOCAB, device="cuda")
    seqs = [
        sampler.track(SamplingParams(temperature=0.9, top_p=0.8, seed=1, logprobs=2), [1, 2]),
        sampler.track(SamplingParams(temperature=0.0, repetition_penalty=1.4, presence_penalty=0.5), [3]),
        sampler.track(SamplingParams(temperature=1.2, top_k=5, min_p=0.1, frequency_penalty=0.2), [4, 5]),
        sampler.track(SamplingParams(constraint=AllowOnly({1, 2, 40})), [6]),
    ]
    sampler.sample(logits, seqs)  # first use: the penalty table is made
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = sampler.launch(logits, seqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens, logprobs = sampler.collect(packed, seqs)
    assert tokens[3] in {1, 2, 40} and logprobs[0] is not None and len(logprobs[0].top) == 2
