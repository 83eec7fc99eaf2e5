import pytest

from sagellm_core.drivers.step_scheduler import ScheduledChunk
from sagellm_core.replay.costmodel import HARDWARE, MODELS, CostModel


def model(hw="h100", name="llama-3.1-8b"):
    return CostModel(HARDWARE[hw], MODELS[name], step_overhead_s=0.0)


def test_llama_8b_shape():
    m = MODELS["llama-3.1-8b"]
    assert 7.9e9 < m.num_params < 8.1e9
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB


def test_small_decode_is_memory_bound_at_weight_read_time():
    cm = model()
    decode = [ScheduledChunk("r", 1, 100, False)]
    weights = MODELS["llama-3.1-8b"].num_params * 2
    assert cm.step_time(decode) == pytest.approx(weights / (3.35e12 * 0.8), rel=0.01)


def test_large_prefill_is_compute_bound():
    cm = model()
    prefill = [ScheduledChunk("r", 8192, 0, True)]
    flops_time = 2 * MODELS["llama-3.1-8b"].num_params * 8192 / (989e12 * 0.6)
    assert cm.step_time(prefill) > flops_time  # plus attention
    assert cm.step_time(prefill) < flops_time * 1.5


def test_hardware_ordering():
    decode = [ScheduledChunk(str(i), 1, 2000, False) for i in range(64)]
    times = {hw: model(hw).step_time(decode) for hw in ("h100", "h200", "ascend-910b")}
    assert times["h200"] < times["h100"] < times["ascend-910b"]


def test_longer_context_costs_more():
    cm = model()
    assert cm.step_time([ScheduledChunk("r", 1, 100_000, False)]) > cm.step_time([ScheduledChunk("r", 1, 100, False)])
    assert cm.step_time([]) == 0.0
