"""The ``cuda`` device's fast path (Triton paged attention, CUDA graphs for
decode, static step buffers) against transformers' own greedy ``generate``
on the same GPU, in fp32: token-identical with the prefix cache off and on,
with evictions and host-tier reloads, under preemption, and each of those
again with ``async_scheduling`` (step N+1 packed while step N runs on the
GPU, its decodes fed step N's sampled ids on the device, and launched
before step N's tokens are read), also behind a slow device. Each run
asserts it did what its name says. Skipped where CUDA is absent (CI)."""

import pytest
import torch
from sagellm_plugin_torch import models
from sagellm_plugin_torch import testing as helpers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Four layers, GQA 8/2 with head_dim 32: a layout the kernels must handle as a real model's.
    return helpers.save_tiny_model(
        tmp_path_factory.mktemp("cuda-llama"), hidden_size=256, num_heads=8, num_kv_heads=2, num_layers=4
    )


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(5, 120, (4, 37), generator=g).tolist()
    tails = torch.randint(5, 120, (32, 20), generator=g).tolist()
    return [shared[i % 4] + tails[i][: 3 + i % 17] for i in range(32)]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    model, _ = models.load(str(model_dir), "float32")
    return helpers.hf_generate(model.to("cuda"), prompts, MAX_TOKENS)


def run(tmp_path, model_dir, prompts, overlap=False, device_delay=0, **config):
    """The engine's greedy outputs and counters; with ``device_delay``, a
    kernel that spins that many GPU cycles is queued before each step, so
    that the host runs further ahead of the device than it would."""
    core = helpers.engine_core(
        helpers.write_config(tmp_path, model=str(model_dir), **config), device="cuda", async_scheduling=overlap
    )
    assert core.runner.graphs is not None, "the cuda device was meant to capture decode graphs"
    if device_delay:
        execute = core.runner.execute

        def delayed():
            torch.cuda._sleep(device_delay)
            return execute()

        core.runner.execute = delayed
    results = core.generate(helpers.requests(prompts, MAX_TOKENS))
    if overlap:
        assert core.steps_launched_ahead > 0, "no step was launched before the one ahead of it was applied"
    core.rt.check_invariants()
    assert not core.has_work() and core.rt.counters.requests_finished == len(prompts)
    return [results[f"r{i}"] for i in range(len(prompts))], core.rt.counters


def test_equals_transformers_generate(tmp_path, model_dir, prompts, reference):
    outputs, counters = run(tmp_path, model_dir, prompts, prefix_cache=False)
    assert counters.hit_blocks == 0
    assert outputs == reference


def test_prefix_cache_on(tmp_path, model_dir, prompts, reference):
    outputs, counters = run(tmp_path, model_dir, prompts, block_size=16)
    assert counters.hit_blocks > 0
    assert outputs == reference


def test_evictions_and_host_tier_reloads(tmp_path, model_dir, prompts, reference):
    # 8-token blocks: the prompts' shared 37-token prefixes span four of them, which come back from the host.
    outputs, counters = run(tmp_path, model_dir, prompts, num_blocks=24, max_num_seqs=4, offload=True, block_size=8)
    assert counters.evicted_blocks > 0 and counters.host_hit_blocks > 0
    assert counters.transfer_failures == 0
    assert outputs == reference


def test_preemption_and_recompute(tmp_path, model_dir, prompts, reference):
    outputs, counters = run(tmp_path, model_dir, prompts, num_blocks=20, prefix_cache=False)
    assert counters.preemptions > 0 and counters.reprefill_tokens > 0
    assert outputs == reference


@pytest.mark.parametrize(
    "config",
    [
        dict(prefix_cache=False),
        dict(block_size=16),
        dict(num_blocks=24, max_num_seqs=4, offload=True, block_size=8),
        dict(num_blocks=20, prefix_cache=False),
    ],
    ids=["cache-off", "cache-on", "evictions-reloads", "preemption"],
)
def test_async_scheduling_equals_transformers_generate(tmp_path, model_dir, prompts, reference, config):
    outputs, counters = run(tmp_path, model_dir, prompts, overlap=True, **config)
    if config.get("offload"):
        assert counters.evicted_blocks > 0 and counters.host_hit_blocks > 0
    if config.get("num_blocks") == 20:
        assert counters.preemptions > 0
    assert outputs == reference


def test_steps_launched_ahead_of_a_slow_device_equal_transformers_generate(tmp_path, model_dir, prompts, reference):
    """Each step queued behind a long kernel: the host prepares and launches
    the next step while the device still has this one's input copies ahead
    of it, and the staging buffers it writes are not the ones being read."""
    outputs, counters = run(tmp_path, model_dir, prompts, overlap=True, device_delay=2_000_000, block_size=16)
    assert counters.hit_blocks > 0
    assert outputs == reference


def test_graphs_off_equals_on(tmp_path, model_dir, prompts, reference):
    core = helpers.engine_core(helpers.write_config(tmp_path, model=str(model_dir)), device="cuda", cuda_graphs=False)
    assert core.runner.graphs is None
    results = core.generate(helpers.requests(prompts, MAX_TOKENS))
    assert [results[f"r{i}"] for i in range(len(prompts))] == reference


def test_a_pool_sized_from_memory_serves(tmp_path, model_dir, prompts, reference):
    """``num_blocks = "auto"``: the pool fills ``gpu_memory_utilization`` of
    the GPU beside the model and a step's activations, and the engine serves
    on it."""
    from sagellm_core.drivers.engines import build_engine, sized_pool
    from sagellm_core.replay import session
    from sagellm_core.runtime import Runtime

    path = helpers.write_config(tmp_path, model=str(model_dir), extra="")
    text = path.read_text().replace("num_blocks = 512", 'num_blocks = "auto"')
    path.write_text(text.replace("[engine]\n", '[engine]\ndevice = "cuda"\ngpu_memory_utilization = 0.3\n', 1))
    settings = session.load_settings(str(path))
    engine, _ = build_engine(settings)
    free, total = torch.cuda.mem_get_info()
    core = engine.start(Runtime(sized_pool(settings, engine)))
    kv_bytes = core.runner.kv.numel() * core.runner.kv.element_size()
    assert core.rt.num_blocks == engine.pool_blocks > 1000
    assert kv_bytes < 0.3 * total, "the pool was meant to fit in the share of memory it was given"
    results = core.generate(helpers.requests(prompts, MAX_TOKENS))
    assert [results[f"r{i}"] for i in range(len(prompts))] == reference
