"""A fake ``torch_npu`` for machines without Ascend hardware, and the
``npu-fake`` device that runs the NPU code path on the CPU with it.

vllm-ascend and LMDeploy's Ascend backend test their CPU paths the same way,
with a stand-in ``torch_npu`` module. Here the stand-in's two kernels take
Ascend's documented arguments (torch_npu's ``npu_scatter_pa_kv_cache`` with
``cache_mode="Norm"``, and ``npu_fused_infer_attention_score`` with a block
table in the TND layout, as vllm-ascend calls them) and refuse, with the
argument named, what the real kernels refuse: dtypes other than float16 /
bfloat16, shapes that disagree, block sizes that are not a multiple of 16 or
exceed 512, block tables that are not int32, lengths that do not add up, a
missing or wrong causal mask. They then compute in plain torch with the
reference device's own math (``paged_attention_reference``), so the torch
engine on ``npu-fake`` must give the very tokens it gives on ``cpu``: any
difference is in how the NPU device lays out its arguments.

Nothing here is imported by ``device = "npu"``.
"""

from __future__ import annotations

import contextlib
from types import ModuleType, SimpleNamespace

import torch
from sagellm_plugin_torch.devices import AttentionBatch, CpuDevice, paged_attention_reference

from .device import MASK_SIZE, MAX_BLOCK_SIZE, NpuDevice

KV_DTYPES = (torch.float16, torch.bfloat16)


class AscendArgumentError(RuntimeError):
    """What the real kernel would reject, naming the argument."""


def _require(ok: bool, kernel: str, message: str) -> None:
    if not ok:
        raise AscendArgumentError(f"{kernel}: {message}")


def npu_scatter_pa_kv_cache(
    key,
    value,
    key_cache,
    value_cache,
    slot_mapping,
    *,
    compress_lens=None,
    compress_seq_offsets=None,
    seq_lens=None,
    cache_mode="PA_NZ",
) -> None:
    """Write ``key`` / ``value`` (``[tokens, kv_heads, head_dim]``) into the
    caches (``[num_blocks, block_size, kv_heads, head_dim]``) at
    ``slot_mapping``, in place; a negative slot is skipped."""
    k = "npu_scatter_pa_kv_cache"
    _require(cache_mode == "Norm", k, f"cache_mode {cache_mode!r}: this emulation covers 'Norm' (the ND layout) only")
    _require(
        key.dim() == 3 and value.dim() == 3,
        k,
        f"key {tuple(key.shape)} / value {tuple(value.shape)}: [tokens, heads, head_size]",
    )
    _require(
        key_cache.dim() == 4 and value_cache.dim() == 4,
        k,
        "caches must be [num_blocks, block_size, heads, head_size] in Norm mode",
    )
    dtypes = {key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}
    _require(
        len(dtypes) == 1 and key.dtype in (*KV_DTYPES, torch.int8),
        k,
        f"dtypes {sorted(map(str, dtypes))}: one of float16, bfloat16, int8",
    )
    _require(
        slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.dim() == 1,
        k,
        f"slot_mapping: a 1-d int32/int64 tensor, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}",
    )
    _require(
        slot_mapping.shape[0] == key.shape[0] == value.shape[0],
        k,
        "slot_mapping, key and value disagree on the number of tokens",
    )
    _require(
        key.shape[1:] == key_cache.shape[2:] and value.shape[1:] == value_cache.shape[2:],
        k,
        "key/value heads or head size differ from the caches'",
    )
    _require(
        all(t.is_contiguous() for t in (key, value, key_cache, value_cache, slot_mapping)),
        k,
        "inputs must be contiguous",
    )
    capacity = key_cache.shape[0] * key_cache.shape[1]
    live = slot_mapping[slot_mapping >= 0].long()
    _require(bool((live < capacity).all()), k, f"slot out of range [0, {capacity})")
    _require(live.unique().numel() == live.numel(), k, "slots must be unique")
    keep = slot_mapping >= 0
    key_cache.view(capacity, *key_cache.shape[2:]).index_copy_(0, live, key[keep])
    value_cache.view(capacity, *value_cache.shape[2:]).index_copy_(0, live, value[keep])


def npu_fused_infer_attention_score(
    query,
    key,
    value,
    *,
    atten_mask=None,
    block_table=None,
    input_layout="BSH",
    block_size=0,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    num_heads=1,
    num_key_value_heads=0,
    scale=1.0,
    sparse_mode=0,
    **unsupported,
):
    """Attention of TND queries over paged caches given as ``[num_blocks,
    block_size, kv_heads * head_dim]`` with an int32 block table; returns
    ``(attention_out, softmax_lse)``."""
    k = "npu_fused_infer_attention_score"
    _require(
        not {n for n, v in unsupported.items() if v is not None}, k, f"arguments not emulated: {sorted(unsupported)}"
    )
    _require(input_layout == "TND", k, f"input_layout {input_layout!r}: this emulation covers TND with a block table")
    _require(block_table is not None, k, "block_table is required (paged KV)")
    _require(query.dtype in KV_DTYPES, k, f"query dtype {query.dtype}: float16 or bfloat16")
    _require(key.dtype == value.dtype == query.dtype, k, "key/value dtype must match the query's with paged KV")
    _require(
        query.dim() == 3 and query.shape[1] == num_heads,
        k,
        f"query {tuple(query.shape)}: [tokens, num_heads={num_heads}, head_dim]",
    )
    kv_heads = num_key_value_heads or num_heads
    _require(
        num_heads % kv_heads == 0 and num_heads // kv_heads <= 64,
        k,
        f"num_heads {num_heads} / num_key_value_heads {kv_heads}",
    )
    head_dim = query.shape[2]
    _require(head_dim <= 512 and head_dim % 16 == 0, k, f"head_dim {head_dim}: a multiple of 16, at most 512")
    _require(
        key.dim() == 3 and key.shape == value.shape and key.shape[2] == kv_heads * head_dim,
        k,
        f"key/value {tuple(key.shape)}: [num_blocks, block_size, {kv_heads} * {head_dim}]",
    )
    _require(block_size == key.shape[1], k, f"block_size {block_size} differs from the caches' {key.shape[1]}")
    _require(
        block_size % 16 == 0 and 0 < block_size <= MAX_BLOCK_SIZE,
        k,
        f"block_size {block_size}: a multiple of 16 up to {MAX_BLOCK_SIZE}",
    )
    _require(
        block_table.dtype == torch.int32 and block_table.dim() == 2,
        k,
        f"block_table: 2-d int32, got {block_table.dtype}",
    )
    q_ends, kv_lens = actual_seq_lengths, actual_seq_lengths_kv
    _require(
        isinstance(q_ends, list) and isinstance(kv_lens, list),
        k,
        "actual_seq_lengths and actual_seq_lengths_kv: lists of ints",
    )
    batch = block_table.shape[0]
    _require(len(q_ends) == len(kv_lens) == batch, k, "one query end and one KV length per block-table row")
    _require(
        q_ends == sorted(q_ends) and q_ends[-1] == query.shape[0],
        k,
        "actual_seq_lengths: cumulative query ends, the last one the token count",
    )
    query_lens = [e - s for s, e in zip([0, *q_ends[:-1]], q_ends)]
    _require(
        all(0 < q <= kv for q, kv in zip(query_lens, kv_lens)), k, "each sequence's KV length must cover its queries"
    )
    _require(max(kv_lens) <= block_table.shape[1] * block_size, k, "a KV length exceeds its block-table row")
    _require(
        sparse_mode == 3, k, f"sparse_mode {sparse_mode}: 3 (causal, aligned bottom-right) is what a decoder needs"
    )
    _require(
        atten_mask is not None
        and tuple(atten_mask.shape) == (MASK_SIZE, MASK_SIZE)
        and atten_mask.dtype in (torch.int8, torch.uint8, torch.bool),
        k,
        "sparse_mode 3 needs a 2048 x 2048 int8/uint8/bool mask",
    )
    _require(
        bool(atten_mask[0, 1]) and not bool(atten_mask[1, 0]), k, "atten_mask must be upper-triangular (1 = masked)"
    )
    starts = [0, *q_ends[:-1]]
    ref = AttentionBatch(
        slot_mapping=torch.empty(0, dtype=torch.long),
        query_lens=tuple(query_lens),
        seq_lens=tuple(kv_lens),
        block_tables=block_table,
        block_size=block_size,
        all_decode=all(q == 1 for q in query_lens),
        seq_lens_tensor=torch.tensor(kv_lens, dtype=torch.long, device=query.device),
        query_start=tuple(starts),
    )
    shape = (key.shape[0], block_size, kv_heads, head_dim)
    out = paged_attention_reference(query, key.view(shape), value.view(shape), ref, scale)
    return out, torch.zeros(1, dtype=torch.float32)


class _Event:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def fake_torch_npu() -> ModuleType:
    """A ``torch_npu`` stand-in: the two kernels above and the slice of
    ``torch.npu`` the device uses (availability, memory, streams, events)."""
    module = ModuleType("torch_npu")
    module.npu_scatter_pa_kv_cache = npu_scatter_pa_kv_cache
    module.npu_fused_infer_attention_score = npu_fused_infer_attention_score
    host = CpuDevice()
    module.npu = SimpleNamespace(
        is_available=lambda: True,
        mem_get_info=lambda device=None: host.memory(),
        Stream=lambda device=None, priority=0: SimpleNamespace(device=device),
        stream=lambda stream: contextlib.nullcontext(),
        Event=lambda enable_timing=False, blocking=False, interprocess=False: _Event(),
        synchronize=lambda device=None: None,
    )
    return module


class FakeNpuDevice(NpuDevice):
    """``device = "npu-fake"``: the NPU device's code path (its checks, its
    2 MiB-aligned KV, its kernel calls) on the CPU, through
    :func:`fake_torch_npu`. For testing without Ascend hardware."""

    name = "npu-fake"

    def __init__(self, index: int | None = None):
        super().__init__(index, torch_npu=fake_torch_npu())

    def _torch_device(self, index: int | None) -> torch.device:
        return torch.device("cpu")
