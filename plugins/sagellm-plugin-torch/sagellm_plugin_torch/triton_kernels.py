"""Triton kernels for the CUDA device: KV writes and paged attention that read
the block table directly, with no gathered copy of a sequence's KV.

One layer's caches are ``k_cache`` and ``v_cache``, each ``[num_blocks,
block_size, kv_heads, head_dim]`` (``kv[layer, 0]`` and ``kv[layer, 1]`` of
the KV tensor); token ``t`` of a sequence sits in block
``block_tables[seq, t // block_size]`` at offset ``t % block_size``, and a
slot is ``block_id * block_size + offset``.

* :func:`write_kv`: one launch scatters a step's new K and V into their
  slots; negative slots (padding rows of a captured batch) are skipped.
* :func:`paged_decode_attention`: one query per sequence, split along the
  context (flash-decoding). Grid ``(num_seqs, kv_heads, num_splits)``: each
  program handles every query head of one KV head group, so a KV tile is read
  once per group; a second kernel merges the splits by log-sum-exp. Nothing
  in it synchronises with the host or depends on tensor values on the host,
  so it can be captured in a CUDA graph; ``workspace`` (from
  :func:`decode_workspace`) is owned by the caller so replays allocate
  nothing.
* :func:`paged_prefill_attention`: the varlen case (vLLM's layout): a flat
  run of several sequences' queries, each sequence's queries being the last
  ``query_len`` of its ``seq_len`` tokens, causal among themselves, over the
  cached context before them. Flash attention over tiles of ``BLOCK_M`` rows,
  each row a (query, head) pair of one KV head group; KV tiles no query of a
  tile can see are never read.

Scores, softmax and accumulation are fp32; outputs are in the query's dtype.
fp32 inputs use IEEE fp32 products (not TF32), so fp32 results agree with the
plain-torch reference (:func:`sagellm_plugin_torch.devices.paged_attention_reference`)
to rounding. Block sizes are compile-time constants and may be any positive
number of tokens (a KV tile gathers its rows through the block table one
token at a time, so tiles and blocks need not align); head dims up to
:data:`MAX_HEAD_DIM`, padded to a power of two inside the kernels.

Input contract that cannot be checked without reading device memory (and so
is not checked): block ids and slots lie inside the caches, ``seq_lens[i]``
fits in sequence ``i``'s block-table row, and a sequence's query count does
not exceed its ``seq_len``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: The dtypes the kernels take (queries, caches and outputs alike).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The largest head dim: a tile of 256-wide rows is what fits in shared memory with room to pipeline.
MAX_HEAD_DIM = 256
#: The most splits one decode may use.
MAX_SPLITS = 256

_LOG2E = 1.4426950408889634


def check_supported(block_size: int, head_dim: int, dtype: torch.dtype) -> None:
    """Raise a one-line ValueError for a layout these kernels cannot run."""
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"triton kernels: block_size {block_size!r}: a positive number of tokens")
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"triton kernels: head_dim {head_dim}: from 1 to {MAX_HEAD_DIM}")
    if dtype not in DTYPES:
        raise ValueError(f"triton kernels: dtype {dtype}: one of float16, bfloat16, float32")


# --------------------------------------------------------------- tile sizes --
#
# Chosen for Hopper (H100); ``benchmarks/attention_kernels.py`` lists the
# alternatives worth timing. Decode is bound by reading KV: a 64-token tile
# keeps enough bytes in flight per program, two stages overlap the next
# tile's gather with this tile's products. Prefill is bound by the products:
# 128 query rows x 64 keys for 16-bit inputs on 8 warps, as Triton's own
# flash-attention tutorial on Hopper; fp32 tiles are twice the bytes, and
# IEEE fp32 products run on CUDA cores, so they are halved.


def _head_dim_padded(head_dim: int) -> int:
    # tl.dot wants every dimension of at least 16
    return max(16, triton.next_power_of_2(head_dim))


def _decode_config(head_dim_padded: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(TILE_N, num_warps, num_stages) of the decode split kernel."""
    if dtype == torch.float32 or head_dim_padded > 128:
        return 32, 4, 2
    return 64, 4, 2


def _prefill_config(
    head_dim_padded: int, dtype: torch.dtype, group: int, max_query_len: int
) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages) of the prefill kernel.
    BLOCK_M rows are (query, head) pairs of one KV head group: no more rows
    than the longest sequence's queries fill, and at least one whole group."""
    if dtype == torch.float32 or head_dim_padded > 128:
        block_m, tile_n, warps, stages = 64, 32, 4, 2
    else:
        block_m, tile_n, warps, stages = 128, 64, 8, 2
    rows = triton.next_power_of_2(max(1, max_query_len) * group)
    block_m = max(16, triton.next_power_of_2(group), min(block_m, rows))
    if block_m <= 32:
        warps = 4
    return block_m, tile_n, warps, stages


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 products in IEEE fp32; 16-bit inputs ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


# ------------------------------------------------------------------ write_kv --


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_key_t,
    stride_key_h,
    stride_key_d,
    stride_value_t,
    stride_value_h,
    stride_value_d,
    stride_kc_b,
    stride_kc_t,
    stride_kc_h,
    stride_kc_d,
    stride_vc_b,
    stride_vc_t,
    stride_vc_h,
    stride_vc_d,
    num_slots,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, KV_HEADS_P2)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    # Negative slots are padding; slots past the cache would write outside it.
    inside = (slot >= 0) & (slot < num_slots)
    mask = inside & (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    block = slot // BLOCK_SIZE
    within = slot % BLOCK_SIZE
    t = token.to(tl.int64)
    key = tl.load(
        key_ptr + t * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :] * stride_key_d, mask=mask
    )
    value = tl.load(
        value_ptr + t * stride_value_t + offs_h[:, None] * stride_value_h + offs_d[None, :] * stride_value_d, mask=mask
    )
    k_dst = k_cache_ptr + block * stride_kc_b + within * stride_kc_t
    v_dst = v_cache_ptr + block * stride_vc_b + within * stride_vc_t
    tl.store(k_dst + offs_h[:, None] * stride_kc_h + offs_d[None, :] * stride_kc_d, key, mask=mask)
    tl.store(v_dst + offs_h[:, None] * stride_vc_h + offs_d[None, :] * stride_vc_d, value, mask=mask)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter ``key`` and ``value`` (``[tokens, kv_heads, head_dim]``, any
    strides) into ``k_cache`` / ``v_cache`` at ``slot_mapping`` (int32 or
    int64, ``[tokens]``), in one launch. Rows whose slot is negative are
    skipped."""
    _check_caches(k_cache, v_cache)
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    tokens = key.shape[0]
    if key.shape != (tokens, kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"write_kv: key {tuple(key.shape)} and value {tuple(value.shape)} must both be"
            f" [tokens, {kv_heads}, {head_dim}] (the caches' kv_heads and head_dim)"
        )
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        raise ValueError(f"write_kv: key {key.dtype} / value {value.dtype} must be the caches' {k_cache.dtype}")
    if slot_mapping.shape != (tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"write_kv: slot_mapping {tuple(slot_mapping.shape)} {slot_mapping.dtype} must be [{tokens}] int32 or int64"
        )
    _check_devices("write_kv", k_cache, key=key, value=value, slot_mapping=slot_mapping)
    if tokens == 0:
        return
    _write_kv_kernel[(tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        num_blocks * block_size,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        KV_HEADS_P2=triton.next_power_of_2(kv_heads),
        HEAD_DIM_P2=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        num_warps=4,
    )


# ------------------------------------------------------------------- decode --


# The table's row stride varies from step to step: no specialisation on it (one compiled kernel).
@triton.jit(do_not_specialize=["stride_bt_s"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    stride_q_s,
    stride_q_h,
    stride_q_d,
    stride_kc_b,
    stride_kc_t,
    stride_kc_h,
    stride_kc_d,
    stride_vc_b,
    stride_vc_t,
    stride_vc_h,
    stride_vc_d,
    stride_bt_s,
    stride_bt_b,
    stride_out_s,
    stride_out_h,
    stride_out_d,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    offs_n = tl.arange(0, TILE_N)
    heads = kv_head * GROUP + offs_h
    head_mask = offs_h < GROUP
    dim_mask = offs_d < HEAD_DIM

    # [BLOCK_H, HEAD_DIM_P2]: the group's query heads; padded rows are zeros.
    q = tl.load(
        q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    # This split's tiles of the context: an equal share, the last ones
    # shorter or empty (a split with no tiles reads nothing).
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_P2], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    k_head = k_cache_ptr + kv_head * stride_kc_h
    v_head = v_cache_ptr + kv_head * stride_vc_h

    for tile in range(tile_start, tile_end):
        pos = tile * TILE_N + offs_n
        valid = pos < seq_len
        block = tl.load(table + (pos // BLOCK_SIZE) * stride_bt_b, mask=valid, other=0).to(tl.int64)
        row_k = block * stride_kc_b + (pos % BLOCK_SIZE) * stride_kc_t
        row_v = block * stride_vc_b + (pos % BLOCK_SIZE) * stride_vc_t
        # K^T: [HEAD_DIM_P2, TILE_N]
        k = tl.load(
            k_head + row_k[None, :] + offs_d[:, None] * stride_kc_d, mask=valid[None, :] & dim_mask[:, None], other=0.0
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        # A tile of the split holds at least one valid key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + row_v[:, None] + offs_d[None, :] * stride_vc_d, mask=valid[:, None] & dim_mask[None, :], other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Nothing read (an empty split, a padding row): zeros and an lse of -inf.
    seen = l_i > 0
    part = acc / tl.where(seen, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq * stride_out_s + heads[:, None] * stride_out_h + offs_d[None, :] * stride_out_d,
            part.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None] & dim_mask[None, :],
        )
    else:
        # workspace: part_out [num_seqs, heads, NUM_SPLITS, HEAD_DIM], part_lse [num_seqs, heads, NUM_SPLITS]
        row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(
            part_out_ptr + row[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
            part,
            mask=head_mask[:, None] & dim_mask[None, :],
        )
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=head_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_out_s,
    stride_out_h,
    stride_out_d,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    split_mask = offs_s < NUM_SPLITS
    dim_mask = offs_d < HEAD_DIM
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # Every split empty (a padding row): weights of zero, output zeros.
    weight = tl.exp2(lse - tl.where(lse_max > float("-inf"), lse_max, 0.0))
    total = tl.sum(weight, 0)
    part = tl.load(
        part_out_ptr + row[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    merged = tl.sum(part * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_out_s + head * stride_out_h + offs_d * stride_out_d,
        merged.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def decode_workspace_numel(num_seqs: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements :func:`paged_decode_attention` needs: each split's
    partial output and log-sum-exp per (sequence, head); none with one split."""
    if num_splits == 1:
        return 0
    return num_seqs * num_heads * num_splits * (head_dim + 1)


def decode_workspace(
    num_seqs: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device | str
) -> torch.Tensor:
    """A workspace for decodes of up to ``num_seqs`` sequences with
    ``num_splits`` splits (or fewer sequences, or any layout that needs no
    more elements: one buffer can serve every captured batch size)."""
    return torch.empty(
        decode_workspace_numel(num_seqs, num_heads, head_dim, num_splits), dtype=torch.float32, device=device
    )


def decode_num_splits(num_seqs: int, kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """A split count for a decode of ``num_seqs`` sequences of up to
    ``max_seq_len`` tokens on a device of ``num_sms`` multiprocessors: enough
    programs to fill the device twice over, no split shorter than 256 tokens.
    A host-side choice from shapes only, so a captured graph can fix it."""
    programs = max(1, num_seqs * kv_heads)
    wanted = triton.next_power_of_2(triton.cdiv(2 * num_sms, programs))
    longest_useful = triton.next_power_of_2(max(1, triton.cdiv(max_seq_len, 256)))
    return max(1, min(wanted, longest_useful, 32))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    num_splits: int,
    workspace: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of one query per sequence (``query`` and ``out``:
    ``[num_seqs, heads, head_dim]``) over its first ``seq_lens[i]`` KV tokens,
    read through ``block_tables`` (``[num_seqs, max_blocks]`` int32). A
    sequence of length 0 reads nothing and gets zeros. ``workspace``: from
    :func:`decode_workspace` with at least this decode's size; unused (may be
    None) when ``num_splits`` is 1. Returns ``out``."""
    num_seqs, num_heads, head_dim = query.shape
    kv_heads, group = _check_attention("paged_decode_attention", query, k_cache, v_cache, out)
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        raise ValueError(
            f"paged_decode_attention: block_tables {tuple(block_tables.shape)} {block_tables.dtype}"
            f" must be [{num_seqs}, max_blocks] int32"
        )
    if seq_lens.shape != (num_seqs,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"paged_decode_attention: seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype} must be [{num_seqs}] int32"
        )
    if not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"paged_decode_attention: num_splits {num_splits!r}: from 1 to {MAX_SPLITS}")
    needed = decode_workspace_numel(num_seqs, num_heads, head_dim, num_splits)
    if needed and (workspace is None or workspace.dtype != torch.float32 or workspace.numel() < needed):
        have = "None" if workspace is None else f"{workspace.numel()} {workspace.dtype}"
        raise ValueError(
            f"paged_decode_attention: workspace {have}: needs {needed} float32 elements"
            f" ({num_seqs} seqs x {num_heads} heads x {num_splits} splits x (head_dim + 1))"
        )
    tensors = {"block_tables": block_tables, "seq_lens": seq_lens, "out": out}
    if needed:
        tensors["workspace"] = workspace
    _check_devices("paged_decode_attention", query, k_cache=k_cache, v_cache=v_cache, **tensors)
    if num_seqs == 0:
        return out
    block_size = k_cache.shape[1]
    head_dim_padded = _head_dim_padded(head_dim)
    tile_n, warps, stages = _decode_config(head_dim_padded, query.dtype)
    part_out = part_lse = out  # placeholders the one-split kernel never touches
    if needed:
        part_out = workspace[: num_seqs * num_heads * num_splits * head_dim]
        part_lse = workspace[part_out.numel() : needed]
    _decode_split_kernel[(num_seqs, kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        float(scale) * _LOG2E,
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_padded,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            *out.stride(),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=triton.next_power_of_2(head_dim),
            NUM_SPLITS=num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits),
            num_warps=4 if head_dim > 64 else 2,
        )
    return out


# ------------------------------------------------------------------ prefill --


@triton.jit(do_not_specialize=["stride_bt_s"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_kc_b,
    stride_kc_t,
    stride_kc_h,
    stride_kc_d,
    stride_vc_b,
    stride_vc_t,
    stride_vc_h,
    stride_vc_d,
    stride_bt_s,
    stride_bt_b,
    stride_out_t,
    stride_out_h,
    stride_out_d,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return  # the grid covers the longest sequence's queries; this one has fewer
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    # Row r: query q_block * BLOCK_Q + r // GROUP of the sequence, head r % GROUP of the group.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    offs_n = tl.arange(0, TILE_N)
    q_index = q_block * BLOCK_Q + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_index < q_len)
    dim_mask = offs_d < HEAD_DIM
    tokens = (q_start + q_index).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    # Absolute position of each row's query: it sees keys 0..q_position.
    # Every row (padding rows too) sees key 0, so no row's maximum stays -inf.
    q_position = context + q_index
    kv_end = context + tl.minimum((q_block + 1) * BLOCK_Q, q_len)  # the keys the tile's last query sees

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    k_head = k_cache_ptr + kv_head * stride_kc_h
    v_head = v_cache_ptr + kv_head * stride_vc_h

    for tile in range(0, tl.cdiv(kv_end, TILE_N)):
        pos = tile * TILE_N + offs_n
        valid = pos < kv_end
        block = tl.load(table + (pos // BLOCK_SIZE) * stride_bt_b, mask=valid, other=0).to(tl.int64)
        row_k = block * stride_kc_b + (pos % BLOCK_SIZE) * stride_kc_t
        row_v = block * stride_vc_b + (pos % BLOCK_SIZE) * stride_vc_t
        k = tl.load(
            k_head + row_k[None, :] + offs_d[:, None] * stride_kc_d, mask=valid[None, :] & dim_mask[:, None], other=0.0
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(valid[None, :] & (pos[None, :] <= q_position[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + row_v[:, None] + offs_d[None, :] * stride_vc_d, mask=valid[:, None] & dim_mask[None, :], other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    result = acc / l_i[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_out_t + heads[:, None] * stride_out_h + offs_d[None, :] * stride_out_d,
        result.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    max_query_len: int,
) -> torch.Tensor:
    """Causal attention of a flat run of several sequences' queries
    (``query`` and ``out``: ``[tokens, heads, head_dim]``; sequence ``i``'s
    are rows ``query_start_loc[i]:query_start_loc[i + 1]``, int32) over their
    paged KV: sequence ``i``'s queries are the last of its ``seq_lens[i]``
    tokens, whose KV (cached context and this step's) is in the caches
    through ``block_tables`` (``[num_seqs, max_blocks]`` int32).
    ``max_query_len``: the most queries one sequence has (a host int; no
    sequence may have more). Returns ``out``."""
    _check_attention("paged_prefill_attention", query, k_cache, v_cache, out)
    tokens, num_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    if seq_lens.dim() != 1 or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"paged_prefill_attention: seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype}: [num_seqs] int32"
        )
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or query_start_loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"paged_prefill_attention: query_start_loc {tuple(query_start_loc.shape)} {query_start_loc.dtype}"
            f" must be [{num_seqs + 1}] int32 (num_seqs + 1)"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.dtype != torch.int32:
        raise ValueError(
            f"paged_prefill_attention: block_tables {tuple(block_tables.shape)} {block_tables.dtype}"
            f" must be [{num_seqs}, max_blocks] int32"
        )
    if not isinstance(max_query_len, int) or not 0 <= max_query_len <= tokens:
        raise ValueError(f"paged_prefill_attention: max_query_len {max_query_len!r}: from 0 to the {tokens} tokens")
    _check_devices(
        "paged_prefill_attention",
        query,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        out=out,
    )
    if num_seqs == 0 or max_query_len == 0:
        return out
    head_dim_padded = _head_dim_padded(head_dim)
    block_m, tile_n, warps, stages = _prefill_config(head_dim_padded, query.dtype, group, max_query_len)
    block_q = block_m // group
    _prefill_kernel[(triton.cdiv(max_query_len, block_q), num_seqs, kv_heads)](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        float(scale) * _LOG2E,
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_padded,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_SIZE=k_cache.shape[1],
        TILE_N=tile_n,
        DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return out


# ------------------------------------------------------------------- checks --


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"caches: k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)}"
            f" {v_cache.dtype} must both be [num_blocks, block_size, kv_heads, head_dim] of one dtype"
        )
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("caches: k_cache and v_cache need unit stride along head_dim")
    check_supported(k_cache.shape[1], k_cache.shape[3], k_cache.dtype)


def _check_attention(
    name: str, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor
) -> tuple[int, int]:
    """(kv_heads, group size) after checking the shapes and dtypes shared by both attention kernels."""
    _check_caches(k_cache, v_cache)
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if query.dim() != 3 or query.shape[2] != head_dim or query.shape[1] % kv_heads:
        raise ValueError(
            f"{name}: query {tuple(query.shape)} must be [rows, heads, {head_dim}] with heads a multiple of"
            f" the caches' {kv_heads} kv_heads"
        )
    if query.dtype != k_cache.dtype:
        raise ValueError(f"{name}: query {query.dtype} must be the caches' {k_cache.dtype}")
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(
            f"{name}: out {tuple(out.shape)} {out.dtype} must be the query's {tuple(query.shape)} {query.dtype}"
        )
    return kv_heads, query.shape[1] // kv_heads


def _check_devices(name: str, first: torch.Tensor, **tensors: torch.Tensor) -> None:
    for what, tensor in tensors.items():
        if tensor.device != first.device:
            raise ValueError(f"{name}: {what} is on {tensor.device}, the other inputs on {first.device}")


# ------------------------------------------------ the decoder layer's glue --
#
# The elementwise work around a decoder layer's products, one launch each
# where transformers' modules take five to ten: RMSNorm (with the residual
# add before it), SiLU-and-multiply, and rotary embedding fused with the KV
# write. Each rounds where transformers' own modules round (to the input
# dtype after each op it runs as a separate kernel), so 16-bit results match
# theirs but for the order of a row's sum of squares. ``enable_fp_fusion``
# is off: no multiply-add is contracted into a fused multiply-add that the
# separate kernels would round twice.


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_out,
    n_cols,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # transformers adds in the input dtype: the sum rounded, then normalised.
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(
            x.dtype
        )
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / n_cols
    normed = (xf * (1.0 / tl.sqrt(variance + eps))).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` per row of ``x`` (``[rows,
    cols]``, rows may be strided), as transformers' ``LlamaRMSNorm``: in
    float32, normalised rows rounded to ``x``'s dtype before the weight.
    With ``residual`` (same shape and dtype): ``residual += x`` first, in
    place, and the sum is normalised (vLLM's fused add-norm). Returns a new
    tensor."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(
            f"rms_norm: x {tuple(x.shape)} {x.dtype} must be [rows, cols] with unit column stride, weight"
            f" {tuple(weight.shape)} {weight.dtype} [cols] of its dtype"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} must be x's")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x,
            x if residual is None else residual,
            weight,
            out,
            x.stride(0),
            x.stride(0) if residual is None else residual.stride(0),
            out.stride(0),
            x.shape[1],
            float(eps),
            ADD_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(x.shape[1]),
            num_warps=4 if x.shape[1] <= 4096 else 8,
            enable_fp_fusion=False,
        )
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` (``[rows, 2 * cols]``),
    each op rounded to the dtype as transformers' MLP rounds it."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"silu_and_mul: x {tuple(x.shape)} must be [rows, 2 * cols] with unit column stride")
    cols = x.shape[1] // 2
    out = torch.empty((x.shape[0], cols), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(cols))
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(cols, block))](
            x, out, x.stride(0), out.stride(0), cols, BLOCK=block, num_warps=4, enable_fp_fusion=False
        )
    return out


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_cos_t,
    stride_sin_t,
    stride_qo_t,
    stride_qo_h,
    stride_kc_b,
    stride_kc_t,
    stride_kc_h,
    stride_vc_b,
    stride_vc_t,
    stride_vc_h,
    num_slots,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    KV_HEADS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    offs_d = tl.arange(0, HEAD_DIM)
    # rotate_half(x)[d] = -x[d + half] for d < half, x[d - half] after.
    partner = (offs_d + half) % HEAD_DIM
    sign = tl.where(offs_d < half, -1.0, 1.0)
    cos = tl.load(cos_ptr + token * stride_cos_t + offs_d).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin_t + offs_d).to(tl.float32)

    offs_h = tl.arange(0, HEADS_P2)
    q_mask = (offs_h < HEADS)[:, None]
    q_row = q_ptr + token * stride_q_t + offs_h[:, None] * stride_q_h
    q = tl.load(q_row + offs_d[None, :], mask=q_mask, other=0.0)
    q_rot = tl.load(q_row + partner[None, :], mask=q_mask, other=0.0)
    # As transformers: q * cos and rotate_half(q) * sin each rounded, then their sum.
    q_out = (q.to(tl.float32) * cos[None, :]).to(q.dtype).to(tl.float32) + (
        (q_rot.to(tl.float32) * sign[None, :]) * sin[None, :]
    ).to(q.dtype).to(tl.float32)
    tl.store(
        q_out_ptr + token * stride_qo_t + offs_h[:, None] * stride_qo_h + offs_d[None, :],
        q_out.to(q.dtype),
        mask=q_mask,
    )

    slot = tl.load(slot_ptr + token).to(tl.int64)
    inside = (slot >= 0) & (slot < num_slots)  # negative slots are padding rows
    offs_kh = tl.arange(0, KV_HEADS_P2)
    kv_mask = inside & (offs_kh < KV_HEADS)[:, None]
    k_row = k_ptr + token * stride_k_t + offs_kh[:, None] * stride_k_h
    k = tl.load(k_row + offs_d[None, :], mask=kv_mask, other=0.0)
    k_rot = tl.load(k_row + partner[None, :], mask=kv_mask, other=0.0)
    k_out = (k.to(tl.float32) * cos[None, :]).to(k.dtype).to(tl.float32) + (
        (k_rot.to(tl.float32) * sign[None, :]) * sin[None, :]
    ).to(k.dtype).to(tl.float32)
    v = tl.load(v_ptr + token * stride_v_t + offs_kh[:, None] * stride_v_h + offs_d[None, :], mask=kv_mask, other=0.0)
    block = slot // BLOCK_SIZE
    within = slot % BLOCK_SIZE
    k_dst = k_cache_ptr + block * stride_kc_b + within * stride_kc_t + offs_kh[:, None] * stride_kc_h
    v_dst = v_cache_ptr + block * stride_vc_b + within * stride_vc_t + offs_kh[:, None] * stride_vc_h
    tl.store(k_dst + offs_d[None, :], k_out.to(k.dtype), mask=kv_mask)
    tl.store(v_dst + offs_d[None, :], v, mask=kv_mask)


def rotary_write_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotary embedding of ``query`` and ``key`` (``[tokens, heads, head_dim]``
    and ``[tokens, kv_heads, head_dim]``, rows of any stride, unit stride
    along head_dim) by ``cos`` / ``sin`` (``[tokens, head_dim]``, the model's
    rotary module's output: ``x * cos + rotate_half(x) * sin``), the rotated
    keys and ``value`` written into the caches at ``slot_mapping`` (negative
    slots skipped), in one launch. Returns the rotated queries, a new
    contiguous tensor."""
    _check_caches(k_cache, v_cache)
    tokens, heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    if key.shape != (tokens, kv_heads, head_dim) or value.shape != key.shape or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"rotary_write_kv: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
            f" must be [tokens, heads, {k_cache.shape[3]}] and [tokens, {kv_heads}, {k_cache.shape[3]}]"
        )
    if head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"rotary_write_kv: head_dim {head_dim}: an even power of two")
    if cos.shape != (tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(
            f"rotary_write_kv: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be [{tokens}, {head_dim}]"
        )
    if any(t.stride(-1) != 1 for t in (query, key, value, cos, sin)):
        raise ValueError("rotary_write_kv: query, key, value, cos and sin need unit stride along head_dim")
    if {query.dtype, key.dtype, value.dtype} != {k_cache.dtype}:
        raise ValueError(f"rotary_write_kv: query, key and value must be the caches' {k_cache.dtype}")
    if slot_mapping.shape != (tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rotary_write_kv: slot_mapping {tuple(slot_mapping.shape)} must be [{tokens}] int32 or int64")
    out = torch.empty((tokens, heads, head_dim), dtype=query.dtype, device=query.device)
    if tokens:
        _rotary_write_kv_kernel[(tokens,)](
            query,
            key,
            value,
            cos,
            sin,
            out,
            k_cache,
            v_cache,
            slot_mapping,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            cos.stride(0),
            sin.stride(0),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            k_cache.shape[0] * k_cache.shape[1],
            HEADS=heads,
            KV_HEADS=kv_heads,
            HEADS_P2=triton.next_power_of_2(heads),
            KV_HEADS_P2=triton.next_power_of_2(kv_heads),
            HEAD_DIM=head_dim,
            BLOCK_SIZE=k_cache.shape[1],
            num_warps=4,
            enable_fp_fusion=False,
        )
    return out
