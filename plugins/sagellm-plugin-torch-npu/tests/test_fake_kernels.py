"""The fake torch_npu's two kernels accept what Ascend documents and refuse,
naming the argument, what the real kernels refuse."""

import pytest
import torch
from sagellm_plugin_torch_npu.device import MASK_SIZE
from sagellm_plugin_torch_npu.fake import AscendArgumentError, npu_fused_infer_attention_score, npu_scatter_pa_kv_cache

NUM_BLOCKS, BLOCK, KV_HEADS, HEADS, DIM = 4, 16, 2, 4, 16


def scatter_args(**change):
    args = dict(
        key=torch.randn(5, KV_HEADS, DIM, dtype=torch.bfloat16),
        value=torch.randn(5, KV_HEADS, DIM, dtype=torch.bfloat16),
        key_cache=torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16),
        value_cache=torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16),
        slot_mapping=torch.tensor([0, 1, 17, -1, 63], dtype=torch.int32),
        cache_mode="Norm",
    )
    args.update(change)
    return args


def attention_args(**change):
    caches = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS * DIM, dtype=torch.bfloat16)
    args = dict(
        query=torch.randn(3, HEADS, DIM, dtype=torch.bfloat16),
        key=caches,
        value=caches.clone(),
        atten_mask=torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8), diagonal=1),
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        input_layout="TND",
        block_size=BLOCK,
        actual_seq_lengths=[2, 3],
        actual_seq_lengths_kv=[20, 17],
        num_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        scale=DIM**-0.5,
        sparse_mode=3,
    )
    args.update(change)
    return args


def call_attention(args):
    query, key, value = args.pop("query"), args.pop("key"), args.pop("value")
    return npu_fused_infer_attention_score(query, key, value, **args)


def test_scatter_writes_slots_in_place_and_skips_negative_ones():
    args = scatter_args()
    npu_scatter_pa_kv_cache(**args)
    flat = args["key_cache"].view(-1, KV_HEADS, DIM)
    assert torch.equal(flat[17], args["key"][2]) and torch.equal(flat[63], args["key"][4])
    assert int((flat.abs().sum(dim=(1, 2)) > 0).sum()) == 4  # slot -1 wrote nothing


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(cache_mode="PA_NZ"), "cache_mode"),
        (dict(key=torch.randn(5, KV_HEADS, DIM)), "dtypes"),  # float32
        (dict(slot_mapping=torch.tensor([0, 1, 2, 3, 4], dtype=torch.float32)), "slot_mapping"),
        (dict(slot_mapping=torch.tensor([0, 1, 2, 3], dtype=torch.int32)), "number of tokens"),
        (dict(slot_mapping=torch.tensor([0, 1, 2, 3, 64], dtype=torch.int32)), "out of range"),
        (dict(slot_mapping=torch.tensor([0, 1, 1, 3, 4], dtype=torch.int32)), "unique"),
        (dict(key_cache=torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS * DIM, dtype=torch.bfloat16)), "caches must be"),
        (dict(key=torch.randn(5, KV_HEADS, 2 * DIM, dtype=torch.bfloat16)[:, :, :DIM]), "contiguous"),
    ],
)
def test_scatter_refuses_what_ascend_refuses(change, words):
    with pytest.raises(AscendArgumentError, match=words) as err:
        npu_scatter_pa_kv_cache(**scatter_args(**change))
    assert str(err.value).startswith("npu_scatter_pa_kv_cache: ")


def test_attention_returns_tnd_output_and_a_softmax_placeholder():
    out, lse = call_attention(attention_args())
    assert out.shape == (3, HEADS, DIM) and out.dtype == torch.bfloat16 and lse.dtype == torch.float32


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(query=torch.randn(3, HEADS, DIM)), "query dtype"),
        (dict(input_layout="BSH"), "input_layout"),
        (dict(block_table=None), "block_table is required"),
        (dict(block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int64)), "int32"),
        (dict(block_size=32), "differs from the caches"),
        (
            dict(
                key=torch.randn(NUM_BLOCKS, 8, KV_HEADS * DIM, dtype=torch.bfloat16),
                value=torch.randn(NUM_BLOCKS, 8, KV_HEADS * DIM, dtype=torch.bfloat16),
                block_size=8,
            ),
            "multiple of 16",
        ),
        (
            dict(
                key=torch.randn(2, 1024, KV_HEADS * DIM, dtype=torch.bfloat16),
                value=torch.randn(2, 1024, KV_HEADS * DIM, dtype=torch.bfloat16),
                block_size=1024,
            ),
            "up to 512",
        ),
        (dict(actual_seq_lengths=[2, 2]), "cumulative"),
        (dict(actual_seq_lengths=[1, 3]), None),  # valid: cumulative ends may differ
        (dict(actual_seq_lengths_kv=[40, 17]), "exceeds its block-table row"),
        (dict(actual_seq_lengths_kv=[1, 17]), "cover its queries"),
        (dict(num_key_value_heads=3), "num_heads"),
        (dict(sparse_mode=0), "sparse_mode"),
        (dict(atten_mask=None), "2048 x 2048"),
        (
            dict(atten_mask=torch.tril(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8), diagonal=-1)),
            "upper-triangular",
        ),
        (dict(query=torch.randn(3, HEADS, 12, dtype=torch.bfloat16)), "head_dim"),
    ],
)
def test_attention_refuses_what_ascend_refuses(change, words):
    if words is None:
        call_attention(attention_args(**change))
        return
    with pytest.raises(AscendArgumentError, match=words) as err:
        call_attention(attention_args(**change))
    assert str(err.value).startswith("npu_fused_infer_attention_score: ")
