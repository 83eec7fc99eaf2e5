"""The npu device: its config checks, its KV layout and alignment, its
absence reported in one line, and the torch engine on ``npu-fake`` giving the
cpu device's tokens."""

import subprocess
import sys
import textwrap

import pytest
import torch
from sagellm_plugin_torch import testing as helpers
from sagellm_plugin_torch.devices import load_device
from sagellm_plugin_torch.engine import TorchEngine, TorchSettings
from sagellm_plugin_torch_npu.device import KV_ALIGNMENT

from sagellm_core.errors import ConfigError
from sagellm_core.registry import PluginContext


@pytest.mark.parametrize(
    "dtype, block_size, words",
    [
        ("float32", 16, "dtype float32: Ascend's fused attention takes float16 or bfloat16"),
        ("bfloat16", 8, "block_size 8: Ascend's paged attention needs a multiple of 16 up to 512"),
        ("float16", 24, "block_size 24: Ascend's paged attention needs a multiple of 16"),
        ("bfloat16", 1024, "block_size 1024"),
    ],
)
def test_a_config_the_npu_cannot_use_is_refused_in_one_line(tiny_model_dir, dtype, block_size, words):
    settings = TorchSettings(model=str(tiny_model_dir), device="npu-fake", dtype=dtype)
    with pytest.raises(ConfigError, match=words) as err:
        TorchEngine(settings, PluginContext("torch", block_size, 64))
    assert "\n" not in str(err.value)


def test_the_cli_refuses_it_with_exit_2_and_one_line(tmp_path, tiny_model_dir):
    path = helpers.write_config(tmp_path, model=str(tiny_model_dir), block_size=8)
    text = path.read_text().replace('name = "torch"', 'name = "torch"\ndevice = "npu-fake"\ndtype = "bfloat16"')
    path.write_text(text)
    run = subprocess.run(
        [sys.executable, "-m", "sagellm_core.cli", "replay", "--config", str(path), "--quiet"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "block_size 8" in run.stderr


def test_kv_is_aligned_to_2_mib_and_laid_out_per_layer():
    device = load_device("npu-fake")
    kv = device.allocate_kv(3, 10, 16, 2, 16, torch.bfloat16)
    assert kv.data_ptr() % KV_ALIGNMENT == 0
    assert kv.shape == (3, 2, 10, 16, 2, 16) and kv[1, 0].is_contiguous() and not kv.any()


def test_block_copies_run_through_the_device_stream():
    device = load_device("npu-fake")
    kv = device.allocate_kv(2, 6, 16, 2, 16, torch.bfloat16)
    kv[:, :, 1].fill_(3.0)
    host = torch.zeros((2, 2, 4, 16, 2, 16), dtype=torch.bfloat16)
    device.copy_blocks(kv, [1], host, [2])
    device.copy_blocks(host, [2], kv, [5])
    assert bool((kv[:, :, 5] == 3.0).all()) and bool((host[:, :, 2] == 3.0).all())


def test_importing_the_plugin_never_imports_torch_npu_and_npu_says_why_not():
    # A subprocess: the plugin imports, torch stays usable, and picking "npu"
    # on a machine without torch_npu is one line naming the reason.
    code = textwrap.dedent("""
        import sys
        import torch
        import sagellm_plugin_torch_npu, sagellm_plugin_torch_npu.device
        assert "torch_npu" not in sys.modules
        from sagellm_plugin_torch.devices import load_device
        try:
            load_device("npu")
        except Exception as exc:
            print(type(exc).__name__, exc)
        print(torch.ones(2).sum().item())
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = run.stdout.strip().splitlines()
    assert lines[0].startswith("ConfigError device 'npu': ") and lines[-1] == "2.0"


def test_a_broken_torch_npu_cannot_break_torch(tmp_path):
    # torch-npu without CANN: its torch.backends entry point fails at
    # `import torch`. With autoload off (the plugin sets it before it loads
    # torch_npu; an Ascend user sets it for any process), torch imports and
    # the npu device names the failure in one line.
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('libhccl.so: cannot open shared object file')\n")
    dist = tmp_path / "torch_npu-2.13.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-npu\nVersion: 2.13.0\n")
    (dist / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    code = textwrap.dedent("""
        import torch
        from sagellm_plugin_torch.devices import load_device
        try:
            load_device("npu")
        except Exception as exc:
            print(type(exc).__name__, exc)
        print(torch.ones(3).sum().item())
    """)
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    lines = run.stdout.strip().splitlines()
    assert "libhccl.so" in lines[0] and lines[0].startswith("ConfigError device 'npu': ") and lines[-1] == "3.0"


MAX_TOKENS = 10
#: The chats served one request at a time: each question once (a request
#: alone runs the same whatever was asked before it).
ONE_AT_A_TIME = 12


@pytest.fixture(scope="module")
def chats():
    from sagellm_plugin_torch import models

    return helpers.chat_prompts(models.load("smollm2", "bfloat16")[1], 32)


@pytest.mark.engine
@pytest.mark.parametrize(
    "config, label",
    [
        (dict(prefix_cache=False), "no cache"),
        (dict(), "prefix cache"),
        (dict(num_blocks=24, max_num_seqs=4, offload=True), "evictions and host reloads"),
        (dict(num_blocks=40, prefix_cache=False), "preemption"),
        (dict(max_num_seqs=1), "one at a time"),
    ],
)
def test_npu_fake_gives_the_cpu_devices_tokens(tmp_path, chats, config, label):
    if label == "one at a time":
        chats = chats[:ONE_AT_A_TIME]
    outputs = {}
    for device in ("cpu", "npu-fake"):
        core = helpers.engine_core(helpers.write_config(tmp_path, **config), device=device, dtype="bfloat16")
        results = core.generate(helpers.requests(chats, MAX_TOKENS))
        core.rt.check_invariants()
        outputs[device] = [results[f"r{i}"] for i in range(len(chats))]
        c = core.rt.counters
        if label in ("prefix cache", "one at a time"):
            assert c.hit_blocks > 0
        if label == "evictions and host reloads":
            assert c.evicted_blocks > 0 and c.host_hit_blocks > 0
        if label == "preemption":
            assert c.preemptions > 0
    assert outputs["npu-fake"] == outputs["cpu"]
