"""The engine's edges: bad input is one line and changes nothing, the host
KV store moves real K/V bytes, the CLI runs the engine."""

import json

import pytest
import torch
from sagellm_plugin_torch import models
from sagellm_plugin_torch import testing as helpers
from sagellm_plugin_torch.devices import load_device

from sagellm_core.errors import ConfigError, RequestError
from sagellm_core.types import CachedBlock, Request


@pytest.fixture
def tiny_core(tmp_path, tiny_model_dir):
    return helpers.engine_core(
        helpers.write_config(
            tmp_path, model=str(tiny_model_dir), num_blocks=16, block_size=4, offload=True, host_blocks=8
        )
    )


def snapshot(core):
    c = core.rt.counters
    return (
        len(core.waiting),
        len(core.running),
        core.rt.pool_usage(),
        c.requests_finished,
        c.requests_rejected,
        c.query_blocks,
    )


@pytest.mark.parametrize(
    "prompt, max_tokens, words",
    [
        ([], 4, "empty prompt"),
        # 68 tokens need 17 blocks of 4: the pool bounds max_model_len.
        (list(range(2, 66)), 4, "exceed max_model_len 64 (the least of the model's context (512), the KV pool (16"),
        ([3, 4, 5], 0, "max_tokens 0"),
    ],
)
def test_a_request_that_cannot_be_served_is_refused_and_changes_nothing(tiny_core, prompt, max_tokens, words):
    before = snapshot(tiny_core)
    with pytest.raises(RequestError) as err:
        tiny_core.add_request(Request("bad", prompt, max_tokens))
    assert words in str(err.value) and "\n" not in str(err.value)
    assert snapshot(tiny_core) == before
    tiny_core.rt.check_invariants()


def test_max_model_len_is_the_least_of_the_context_the_setting_and_the_pool(tmp_path, tiny_model_dir):
    def core(num_blocks: int, **settings):
        path = helpers.write_config(tmp_path, model=str(tiny_model_dir), num_blocks=num_blocks, block_size=4)
        return helpers.engine_core(path, **settings)

    assert core(16).max_model_len == 64  # the pool
    assert core(256).max_model_len == 512  # the model's context
    limited = core(256, max_model_len=40)
    assert limited.max_model_len == 40
    with pytest.raises(RequestError, match=r"exceed max_model_len 40 \(.*\[engine\] max_model_len \(40\)\)"):
        limited.add_request(Request("long", [3] * 30, 11))
    limited.add_request(Request("fits", [3] * 30, 10))


def test_a_missing_model_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"no such file or folder") as err:
        models.resolve(str(tmp_path / "nowhere"))
    assert "\n" not in str(err.value)


@pytest.mark.engine
def test_a_gguf_model_is_dequantized_once_and_kept_with_the_same_weights(tmp_path, monkeypatch):
    """SmolLM2's GGUF file: with a cache folder that cannot be made the model
    loads as it is; with one that can, the first load keeps a checkpoint
    there and the next reads it; weights and tokenizer are the same each way."""

    def fresh_load(cache, dtype="float32"):
        monkeypatch.setenv("SAGELLM_MODEL_CACHE", str(cache))
        models._load.cache_clear()
        return models.load("smollm2", dtype)

    (tmp_path / "a-file").write_text("")
    direct, tokenizer = fresh_load(tmp_path / "a-file" / "models")  # not a folder: nothing kept
    kept_to = tmp_path / "models"
    first, _ = fresh_load(kept_to)
    (kept,) = kept_to.iterdir()
    assert kept.name.startswith("SmolLM2") and (kept / "model.safetensors").exists()
    assert models._readable(models.resolve("smollm2")).folder == kept
    again, again_tokenizer = fresh_load(kept_to)
    half, _ = fresh_load(kept_to, "bfloat16")
    models._load.cache_clear()
    weights = direct.state_dict()
    for other in (first, again):
        assert other.state_dict().keys() == weights.keys()
        assert all(torch.equal(other.state_dict()[name], tensor) for name, tensor in weights.items())
    assert all(torch.equal(half.state_dict()[name], tensor.bfloat16()) for name, tensor in weights.items())
    text = "<|im_start|>user\nHello, wörld 123<|im_end|>"
    assert again_tokenizer(text).input_ids == tokenizer(text).input_ids
    assert again_tokenizer.chat_template == tokenizer.chat_template
    assert list(kept_to.iterdir()) == [kept]  # no staging folder left


def test_an_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2, "n_embd": 8, "n_head": 2}')
    with pytest.raises(ConfigError, match=r"architecture 'gpt2' is not supported; the torch engine runs llama"):
        models.load_config(models.resolve(str(tmp_path)))


def test_unknown_or_absent_devices_are_one_line():
    with pytest.raises(ConfigError, match=r"device = 'xpu': no such device; installed: cpu, cuda, cuda-torch"):
        load_device("xpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"device 'cuda': torch.cuda.is_available\(\) is false"):
            load_device("cuda")


def test_class1_a_blocked_device_is_refused(monkeypatch):
    monkeypatch.setenv("SAGELLM_BLOCK_PLUGINS", "sagellm.torch_devices:cpu")
    with pytest.raises(ConfigError, match=r"device = 'cpu'.*plugin 'cpu' \(sagellm.torch_devices\) is blocked"):
        load_device("cpu")


def test_a_pool_larger_than_memory_is_refused_before_the_runtime_builds_it(tiny_model_dir):
    from sagellm_plugin_torch.engine import TorchEngine, TorchSettings

    from sagellm_core.registry import PluginContext

    # The engine plugin is built before the runtime (and its pool plugin).
    with pytest.raises(ConfigError, match=r"num_blocks = 1099511627776 needs .* GiB of KV"):
        TorchEngine(TorchSettings(model=str(tiny_model_dir)), PluginContext("torch", 4, 1 << 40))


def test_a_pool_sized_from_memory_needs_a_gpu(tmp_path, tiny_model_dir, capsys):
    from sagellm_core.cli import main

    path = helpers.write_config(tmp_path, model=str(tiny_model_dir))
    path.write_text(path.read_text().replace("num_blocks = 512", 'num_blocks = "auto"'))
    assert main(["config", "check", str(path)]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "[kv_pool] num_blocks = \"auto\" sizes the pool from a GPU's memory; on device 'cpu' give a number of blocks"
        )
    )


def test_the_host_store_moves_real_kv_bytes(tiny_core):
    rt, kv = tiny_core.rt, tiny_core.runner.kv
    kv[:, :, 3].fill_(1.5)
    kv[:, :, 5].fill_(-2.0)
    rt.stores.offload((CachedBlock(3, 0, None, key=11), CachedBlock(5, 1, 3, key=12)))
    block_bytes = kv[:, :, 0].numel() * kv.element_size()
    assert rt.counters.tiers["host"].bytes_written == 2 * block_bytes
    kv[:, :, 3].zero_()
    kv[:, :, 5].zero_()
    assert rt.stores.load("r", rt.stores.runs((11, 12)), [7, 3], 0.0) == (2, 2)  # each block's checksum checked first
    assert torch.all(kv[:, :, 7] == 1.5) and torch.all(kv[:, :, 3] == -2.0) and torch.all(kv[:, :, 5] == 0)


def test_abort_frees_a_running_request_at_once(tiny_core):
    tiny_core.add_request(Request("a", [5, 6, 7, 8, 9, 10, 11], 50))
    tiny_core.step()
    assert tiny_core.running and tiny_core.rt.pool_usage().num_used_blocks > 0
    out = tiny_core.abort("a")
    assert out.finish_reason == "abort" and not tiny_core.has_work()
    usage = tiny_core.rt.pool_usage()
    assert usage.num_free_blocks + tiny_core.rt.num_cached_blocks == usage.num_blocks
    tiny_core.rt.check_invariants()


def test_replay_and_generate_commands(tmp_path, tiny_model_dir, capsys):
    """The commands as the console script runs them (``main``), in this
    process: torch and the model's code are imported once, not once a command."""
    from sagellm_core.cli import main

    path = helpers.write_config(
        tmp_path,
        model=str(tiny_model_dir),
        num_blocks=64,
        block_size=4,
        extra='[workload]\nsource = "generator"\ntenants = 2\nsessions_per_tenant = 2\nturns = 2\n'
        "system_prompt_tokens = 24\nuser_tokens = 8\noutput_tokens = 4\nsession_rate = 100.0\nthink_time_s = 0.01\n",
    )
    out = tmp_path / "report.json"
    assert main(["replay", "--config", str(path), "--json", str(out), "--quiet"]) == 0
    capsys.readouterr()

    report = json.loads(out.read_text())
    assert report["requests"] == 8 and report["mode"] == "timed" and report["block_hit_rate"] > 0
    generate = ["generate", "--config", str(path), "--prompt", "w5 w6 w7", "--raw", "--max-tokens", "3"]
    assert main(generate) == 0
    generated = capsys.readouterr().out
    core = helpers.engine_core(path)
    offline = core.generate([Request("x", [5, 6, 7], 3)])["x"]
    assert generated.strip() == core.tokenizer.decode(offline, skip_special_tokens=True).strip()
    # --set reaches generate's config: a max_model_len below prompt + output refuses the request.
    assert main([*generate, "--set", "engine.max_model_len=5"]) == 2
    assert "exceed max_model_len 5" in capsys.readouterr().err


def test_a_request_arrives_when_it_is_added(tiny_core):
    import time

    time.sleep(0.2)  # the engine's clock runs from its construction
    added = tiny_core.clock()
    tiny_core.add_request(Request("late", [5, 6, 7], 2))
    outputs = []
    while tiny_core.has_work():
        outputs += [o for o in tiny_core.step() if o.outcome is not None]
    outcome = outputs[0].outcome
    assert outcome.arrival_s >= added and 0 <= outcome.ttft_s < outcome.finish_s


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_each_supported_family_equals_transformers_generate(tmp_path, model_type):
    """A tiny random checkpoint of each family (Qwen2's projection biases,
    Qwen3's QK norms go through the model's own modules), fp32, greedy."""
    from sagellm_plugin_torch.testing import save_tiny_model

    folder = save_tiny_model(tmp_path / model_type, model_type)
    model, _ = models.load(str(folder))
    assert model.config.model_type == model_type
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 9, 30, 31, 32, 33], [50, 51]]
    reference = helpers.hf_generate(model, prompts, 8)
    core = helpers.engine_core(helpers.write_config(tmp_path, model=str(folder), num_blocks=32, block_size=4))
    first = core.generate(helpers.requests(prompts[:1], 8, prefix="a"))
    rest = core.generate(helpers.requests(prompts[1:], 8, prefix="b"))
    assert [first["a0"], rest["b0"], rest["b1"]] == reference
    assert core.rt.counters.hit_blocks > 0  # the second prompt reused the first's cached blocks
