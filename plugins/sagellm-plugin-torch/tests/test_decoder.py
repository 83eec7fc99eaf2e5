"""The runner's own decoder forward (``decoder.py``, run by the ``cuda``
device) on the CPU, with the plain-torch versions of its fused ops: greedy
outputs token-identical to transformers' ``generate`` for each family it
covers (Llama, Mistral, Qwen2 with its projection biases, Qwen3 with its
QK norms), through the engine with the prefix cache on, and the model left
as transformers uses it. The Triton versions of the ops are checked against
the same plain-torch versions in ``test_triton_kernels.py``."""

import pytest
import torch
from sagellm_plugin_torch import engine as engine_module
from sagellm_plugin_torch import models
from sagellm_plugin_torch import testing as helpers
from sagellm_plugin_torch.decoder import FusedDecoder
from sagellm_plugin_torch.devices import CpuDevice

MAX_TOKENS = 10


class FusedCpuDevice(CpuDevice):
    fused_layers = True


@pytest.fixture
def fused_cpu(monkeypatch):
    monkeypatch.setattr(engine_module, "load_device", lambda spec: FusedCpuDevice())


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(5, 120, (3, 21), generator=g).tolist()
    tails = torch.randint(5, 120, (9, 12), generator=g).tolist()
    return [shared[i % 3] + tails[i][: 2 + i] for i in range(9)]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_fused_decoder_equals_transformers_generate(tmp_path, fused_cpu, family):
    model_dir = helpers.save_tiny_model(tmp_path / family, family, hidden_size=64, num_heads=4, num_kv_heads=2)
    model, _ = models.load(str(model_dir), "float32")
    reference = helpers.hf_generate(model, prompts(), MAX_TOKENS)
    core = helpers.engine_core(helpers.write_config(tmp_path, model=str(model_dir), block_size=8))
    assert core.runner.decoder is not None, f"{family} was meant to run the fused decoder"
    # Two waves: the second's prompts hit the first's cached prefixes.
    requests = helpers.requests(prompts(), MAX_TOKENS)
    results = {**core.generate(requests[:3]), **core.generate(requests[3:])}
    assert core.rt.counters.hit_blocks > 0
    assert [results[f"r{i}"] for i in range(len(prompts()))] == reference
    # The joined projections left the model's own parameters as views: transformers still runs it the same.
    assert helpers.hf_generate(model, prompts(), MAX_TOKENS) == reference


def test_families_it_does_not_reproduce_run_the_models_modules(tmp_path):
    model_dir = helpers.save_tiny_model(tmp_path / "llama", "llama", hidden_size=64, num_heads=4, num_kv_heads=2)
    model, _ = models.load(str(model_dir), "float32")
    model.config.hidden_act = "gelu"
    try:
        assert FusedDecoder.of(model) is None
    finally:
        model.config.hidden_act = "silu"
