import numpy as np
import pytest
from sagellm_plugin_kv_transport.local import LocalSettings, LocalTransport

from sagellm_core import PluginContext
from sagellm_core.types import TransferPlan

CTX = PluginContext("local", block_size=16, num_blocks=8)


def transport(host=4, bpb=32):
    return LocalTransport(LocalSettings(host_blocks=host, bytes_per_block=bpb), CTX)


def test_offload_and_load_back_moves_the_bytes():
    t = transport()
    device = t.tiers["device"]
    device[:] = np.arange(8, dtype=np.uint8)[:, None] * 3 + 1
    out = t.sagellm_transfer_blocks(plan=TransferPlan("device", "host", (5, 2), 16, dst_block_ids=(3, 0)))
    assert out.ok and out.num_blocks == 2 and out.num_bytes == 64 and out.dst_block_ids == (3, 0)
    device[[5, 2]] = 0
    back = t.sagellm_transfer_blocks(plan=TransferPlan("host", "device", (3, 0), 16, dst_block_ids=(0, 7)))
    assert back.ok
    assert (device[0] == 5 * 3 + 1).all() and (device[7] == 2 * 3 + 1).all()


def test_failures_are_results_not_exceptions():
    t = transport()
    for plan, error in [
        (TransferPlan("device", "ssd", (0,), 16), "unknown tier 'ssd'"),
        (TransferPlan("host", "device", (0,), 16), "needs dst_block_ids"),
        (TransferPlan("device", "host", (99,), 16, dst_block_ids=(0,)), "out of the tier's range"),
        (TransferPlan("device", "host", (0,), 16, dst_block_ids=(4,)), "out of the tier's range"),
        (TransferPlan("device", "host", (0, 1), 16, dst_block_ids=(0,)), "differ in length"),
    ]:
        result = t.sagellm_transfer_blocks(plan=plan)
        assert not result.ok and error in result.error


@pytest.mark.parametrize("count", [1, 8, 9, 16])  # row by row up to 8 blocks, numpy's fancy indexing above
def test_every_batch_size_moves_each_blocks_bytes(count):
    t = LocalTransport(LocalSettings(host_blocks=32, bytes_per_block=8), PluginContext("local", 16, 32))
    device = t.tiers["device"]
    device[:] = np.arange(32, dtype=np.uint8)[:, None]
    src = tuple(range(31, 31 - count, -1))
    out = t.sagellm_transfer_blocks(plan=TransferPlan("device", "host", src, 16, dst_block_ids=tuple(range(count))))
    assert [int(t.tiers["host"][slot][0]) for slot in out.dst_block_ids] == list(src)
    device[:] = 0
    back = t.sagellm_transfer_blocks(
        plan=TransferPlan("host", "device", out.dst_block_ids, 16, dst_block_ids=tuple(range(count)))
    )
    assert back.ok and [int(device[i][0]) for i in range(count)] == list(src)
