"""The device seam: everything the torch engine asks of an accelerator.

The engine itself is device-neutral: it builds block tables and slot
mappings from the runtime's allocations and runs the model's own layers. The
seven things below are what differ between a CPU, a CUDA GPU and an Ascend
NPU, and a device plugin implements them and nothing else:

* ``check``: refuse, in one line and before anything is allocated, a block
  size or dtype the device's kernels cannot use;
* ``allocate_kv``: the KV tensor, ``[num_layers, 2, num_blocks, block_size,
  kv_heads, head_dim]`` (``docs/decisions.md`` says why this layout);
* ``write_kv``: scatter a step's new K and V into their slots;
* ``paged_attention``: attention of a step's queries over their sequences'
  blocks;
* ``copy_blocks``: block copies inside the KV tensor and to or from host
  memory (offload, reload), on the device's copy stream;
* ``memory``: free and total bytes;
* ``stream`` / ``event`` / ``synchronize``: where copies run, and waiting
  for them.

A device whose ``fused_layers`` is set also serves the runner's own decoder
forward (:mod:`.decoder`) with four ops around the layer's products:
``rms_norm`` (with the residual add), ``silu_and_mul``, and
``rotary_write_kv`` (rotary embedding and the KV write in one). Their
plain-torch versions here are transformers' own arithmetic, op for op.

Devices are found through the ``sagellm.torch_devices`` entry point group:
``cpu`` and ``cuda`` come with this plugin, ``npu`` with
``sagellm-plugin-torch-npu``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager as ContextManager
from importlib import metadata
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from sagellm_core import registry
from sagellm_core.errors import ConfigError

DEVICE_GROUP = "sagellm.torch_devices"
#: Dimension of the KV tensor that indexes blocks.
BLOCK_DIM = 2


@attrs.frozen
class AttentionBatch:
    """One step's layout, shared by every layer: the engine packs the
    scheduled chunks of all sequences into one flat run of tokens (vLLM's
    varlen layout) and says where each sequence's queries and KV are."""

    #: Per token: the KV slot it writes (``block_id * block_size + offset``).
    slot_mapping: torch.Tensor
    #: Per sequence: tokens scheduled this step (its queries), in order.
    query_lens: tuple[int, ...]
    #: Per sequence: tokens in KV once this step's are written (context).
    seq_lens: tuple[int, ...]
    #: ``[num_seqs, max_blocks]`` int32 block ids, padded with 0.
    block_tables: torch.Tensor
    block_size: int
    #: Every sequence decodes one token: the batched decode path applies.
    all_decode: bool
    #: The same, as tensors on the device (built once per step).
    seq_lens_tensor: torch.Tensor
    query_start: tuple[int, ...]
    #: ``[num_seqs + 1]`` int32 on the device: where each sequence's queries start (the last is the total).
    query_start_loc: torch.Tensor | None = None
    #: The most queries one sequence has this step.
    max_query_len: int = 1


class TorchDevice:
    """The reference device, in plain torch; ``cpu`` and ``cuda`` are this.
    Paged attention is :func:`paged_attention_reference`."""

    name = "cpu"
    #: Whether the runner may capture decode steps as CUDA graphs: the
    #: device's kernels never synchronise with the host nor branch on
    #: tensor values.
    graphs = False
    #: Whether the runner runs its own decoder forward (:mod:`.decoder`,
    #: fused ops from this device) for the model families it knows, instead
    #: of the model's modules.
    fused_layers = False

    def __init__(self, index: int | None = None):
        self.torch_device = torch.device(self.name if index is None else f"{self.name}:{index}")

    # -------------------------------------------------------------- checks --

    def check(self, block_size: int, dtype: torch.dtype) -> None:
        """Raise a one-line ConfigError for a block size or dtype this device
        cannot use."""
        if block_size <= 0:
            raise ConfigError(f"device {self.name!r}: block_size {block_size}: a positive number of tokens")

    # -------------------------------------------------------------- memory --

    def allocate_kv(
        self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> torch.Tensor:
        shape = (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)
        return torch.zeros(shape, dtype=dtype, device=self.torch_device)

    def memory(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the memory KV lives in."""
        import os

        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * size, os.sysconf("SC_PHYS_PAGES") * size

    def peak_memory(self, run: Any) -> int:
        """Bytes of device memory ``run()`` allocated at its peak, beyond
        what was allocated before it; a one-line ConfigError on a device that
        cannot tell (sizing the pool from memory needs it)."""
        raise ConfigError(f"device {self.name!r} does not report its peak memory; give [kv_pool] num_blocks")

    def stream(self) -> ContextManager[Any]:
        """Where block copies run; the CPU has one stream."""
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        """Wait for work queued on the device."""

    # ------------------------------------------------------------ kernels --

    def write_kv(
        self, kv: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, batch: AttentionBatch
    ) -> None:
        """Scatter ``key`` / ``value`` (``[tokens, kv_heads, head_dim]``) into
        ``kv[layer]`` at ``batch.slot_mapping``."""
        k_cache, v_cache = kv[layer, 0], kv[layer, 1]
        flat = (-1, *k_cache.shape[2:])
        k_cache.view(flat).index_copy_(0, batch.slot_mapping, key)
        v_cache.view(flat).index_copy_(0, batch.slot_mapping, value)

    def paged_attention(
        self, query: torch.Tensor, kv: torch.Tensor, layer: int, batch: AttentionBatch, scale: float
    ) -> torch.Tensor:
        """``query``: ``[tokens, heads, head_dim]``, the step's queries in
        ``batch`` order; returns the attention output in the same shape. Each
        query attends to its sequence's KV up to its own position."""
        return paged_attention_reference(query, kv[layer, 0], kv[layer, 1], batch, scale)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """transformers' RMSNorm of the rows of ``x``; with ``residual``,
        ``residual += x`` first (in place) and the sum is normalised."""
        if residual is not None:
            x = residual.add_(x)
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for the rows ``[gate | up]`` of ``x``."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_write_kv(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        layer: int,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """Rotary embedding of ``query`` / ``key`` (``[tokens, heads,
        head_dim]``) by ``cos`` / ``sin`` (``[tokens, head_dim]``), the keys
        and ``value`` written to ``kv[layer]`` at the batch's slots; returns
        the rotated queries."""

        def rotate(x: torch.Tensor) -> torch.Tensor:
            half = x.shape[-1] // 2
            return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]

        self.write_kv(kv, layer, rotate(key), value, batch)
        return rotate(query)

    def copy_blocks(self, src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor, dst_ids: Sequence[int]) -> None:
        """Copy blocks ``src_ids`` of ``src`` into blocks ``dst_ids`` of
        ``dst``, every layer at once: inside the KV tensor, or between it and
        a host tensor of the same per-block shape (offload, reload). Runs on
        the device's copy stream and returns once an event recorded after
        the copy has completed. Ids that come as runs (:func:`copy_runs`)
        are copied a run at a time, each as one slice of every layer; others
        are gathered by index."""
        runs = copy_runs(src, src_ids, dst, dst_ids)
        with self.stream():
            if runs is not None:
                for s, d, n in runs:
                    run_view(dst, d, n).copy_(run_view(src, s, n))
            else:
                rows = src.index_select(BLOCK_DIM, torch.tensor(src_ids, dtype=torch.long, device=src.device))
                dst.index_copy_(
                    BLOCK_DIM,
                    torch.tensor(dst_ids, dtype=torch.long, device=dst.device),
                    rows.to(dst.device, non_blocking=True),
                )
            done = self.event()
            done.record()
        done.synchronize()

    def event(self) -> Any:
        """An event with ``record()`` and ``synchronize()``; the CPU runs
        copies synchronously, so its event is already complete."""
        return _CompletedEvent()


#: Copy a run at a time when the runs average at least this many blocks: a
#: run is a few copies whatever its length, a gather one whatever the count.
MIN_MEAN_RUN = 4


def copy_runs(
    src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor, dst_ids: Sequence[int]
) -> list[tuple[int, int, int]] | None:
    """``(src start, dst start, length)`` of the runs in which both sides'
    ids go up by one, when they average at least :data:`MIN_MEAN_RUN`
    blocks; ``None`` when they do not, or when a copy inside one tensor
    writes a block it reads (a gather reads every block before writing)."""
    n = len(src_ids)
    if n != len(dst_ids):
        raise ValueError(f"copy_blocks: {n} source blocks for {len(dst_ids)} destination blocks")
    if n == 0:
        return []
    runs: list[tuple[int, int, int]] = []
    start = 0
    for k in range(1, n + 1):
        if k == n or src_ids[k] != src_ids[k - 1] + 1 or dst_ids[k] != dst_ids[k - 1] + 1:
            runs.append((src_ids[start], dst_ids[start], k - start))
            start = k
            if len(runs) * MIN_MEAN_RUN > n:
                return None
    if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr() and not set(src_ids).isdisjoint(dst_ids):
        return None
    return runs


def run_view(kv: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Blocks ``start .. start + length`` of ``kv``, block dimension first:
    a slice of every layer's K and V, contiguous where ``kv`` is a block-major
    host tensor seen through its block dimension (the host store's rows), so
    a copy to or from it is one transfer."""
    return kv.narrow(BLOCK_DIM, start, length).movedim(BLOCK_DIM, 0)


class _CompletedEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def paged_attention_reference(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch, scale: float
) -> torch.Tensor:
    """Paged attention in plain torch over one layer's caches
    (``[num_blocks, block_size, kv_heads, head_dim]``): per sequence (gather
    its blocks, SDPA with the causal mask offset by its cached context), or,
    when every sequence decodes one token, one SDPA over the padded block
    tables with a length mask."""
    if batch.all_decode:
        tables = batch.block_tables.long()  # [seqs, max_blocks]
        k = k_cache[tables].flatten(1, 2)  # [seqs, max_blocks * block_size, kv_heads, head_dim]
        v = v_cache[tables].flatten(1, 2)
        mask = torch.arange(k.shape[1], device=query.device)[None, :] < batch.seq_lens_tensor[:, None]
        o = F.scaled_dot_product_attention(
            query[:, :, None, :],
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )  # [seqs, heads, 1, head_dim]
        return o.view(tables.shape[0], *query.shape[1:])
    out = torch.empty_like(query)
    for i, (start, n, ctx) in enumerate(zip(batch.query_start, batch.query_lens, batch.seq_lens)):
        blocks = batch.block_tables[i, : -(-ctx // batch.block_size)].long()
        k = k_cache.index_select(0, blocks).flatten(0, 1)[:ctx]  # [ctx, kv_heads, head_dim]
        v = v_cache.index_select(0, blocks).flatten(0, 1)[:ctx]
        # Query j sits at position ctx - n + j and sees keys 0..that.
        positions = torch.arange(ctx - n, ctx, device=query.device)
        mask = torch.arange(ctx, device=query.device)[None, :] <= positions[:, None]
        o = F.scaled_dot_product_attention(
            query[start : start + n].transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start : start + n] = o[0].transpose(0, 1)
    return out


class CpuDevice(TorchDevice):
    name = "cpu"


class CudaTorchDevice(TorchDevice):
    """CUDA with the plain-torch kernels (``cuda-torch``): the reference
    path on a GPU, SDPA picking its flash / memory-efficient kernels; copies
    on a side stream, memory from the CUDA driver."""

    name = "cuda"

    def __init__(self, index: int | None = None):
        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda': torch.cuda.is_available() is false (no GPU, or a CPU build of torch)")
        super().__init__(index)
        self._stream = torch.cuda.Stream(self.torch_device)

    def memory(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.torch_device)

    def peak_memory(self, run: Any) -> int:
        self.synchronize()
        torch.cuda.reset_peak_memory_stats(self.torch_device)
        before = torch.cuda.memory_allocated(self.torch_device)
        run()
        self.synchronize()
        return torch.cuda.max_memory_allocated(self.torch_device) - before

    def stream(self) -> ContextManager[Any]:
        return torch.cuda.stream(self._stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def event(self) -> Any:
        return torch.cuda.Event()

    def copy_blocks(self, src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor, dst_ids: Sequence[int]) -> None:
        """On the copy stream, after the compute stream's writes so far. A
        copy onto the GPU (a reload, a copy inside the KV tensor) returns at
        once: the compute stream waits on its event, so the next step reads
        the blocks only once they are there, and the host does not wait. A
        copy to host memory (an offload) waits for the rows to arrive in
        pinned memory before the host scatters them into the host tensor.
        Ids that come as runs (:func:`copy_runs`) are copied a run at a time,
        straight between the tensors, and a run copied to or from host
        memory returns once it is done: it reads or writes the host tensor
        in place, which the host may touch next."""
        compute = torch.cuda.current_stream(self.torch_device)
        done = torch.cuda.Event()
        runs = copy_runs(src, src_ids, dst, dst_ids)
        if runs is not None:
            with torch.cuda.stream(self._stream):
                self._stream.wait_stream(compute)
                for s, d, n in runs:
                    run_view(dst, d, n).copy_(run_view(src, s, n), non_blocking=True)
                done.record(self._stream)
            if src.device.type == "cpu" or dst.device.type == "cpu":
                # The runs are read from or written to the host tensor in
                # place (no staging copy): the host may touch it next.
                done.synchronize()
            else:
                compute.wait_event(done)
            return
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(compute)
            rows = src.index_select(BLOCK_DIM, torch.tensor(src_ids, dtype=torch.long, device=src.device))
            if dst.device.type == "cpu":
                rows = rows.to("cpu", non_blocking=True)
            else:
                if rows.device.type == "cpu":
                    # From pinned memory the copy is asynchronous; torch's pinned
                    # allocator keeps the rows until the copy has read them.
                    rows = rows.pin_memory()
                dst.index_copy_(
                    BLOCK_DIM,
                    torch.tensor(dst_ids, dtype=torch.long, device=dst.device),
                    rows.to(dst.device, non_blocking=True),
                )
            done.record(self._stream)
        if dst.device.type == "cpu":
            done.synchronize()
            dst.index_copy_(BLOCK_DIM, torch.tensor(dst_ids, dtype=torch.long), rows)
        else:
            compute.wait_event(done)


class CudaDevice(CudaTorchDevice):
    """CUDA (``cuda``): Triton kernels (:mod:`.triton_kernels`) that write a
    step's K and V in one launch per layer and attend straight through the
    block table, flash-decoding split along the context for decodes. None
    synchronises with the host, so the runner captures decode steps as CUDA
    graphs (:attr:`graphs`)."""

    graphs = True
    fused_layers = True

    def __init__(self, index: int | None = None):
        super().__init__(index)
        from . import triton_kernels

        self.kernels = triton_kernels
        self._num_sms = torch.cuda.get_device_properties(self.torch_device).multi_processor_count
        #: Decode workspaces by split count, grown to the largest batch seen.
        #: Every one ever made stays referenced (``_kept``): a captured graph
        #: replays with the address it was captured with.
        self._workspaces: dict[int, torch.Tensor] = {}
        self._kept: list[torch.Tensor] = []

    def check(self, block_size: int, dtype: torch.dtype) -> None:
        super().check(block_size, dtype)
        try:
            self.kernels.check_supported(block_size, 64, dtype)
        except ValueError as exc:
            raise ConfigError(f"device 'cuda': {exc}") from None

    def write_kv(
        self, kv: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, batch: AttentionBatch
    ) -> None:
        self.kernels.write_kv(key, value, kv[layer, 0], kv[layer, 1], batch.slot_mapping)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.kernels.rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(x)

    def rotary_write_kv(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        layer: int,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        return self.kernels.rotary_write_kv(query, key, value, cos, sin, kv[layer, 0], kv[layer, 1], batch.slot_mapping)

    def paged_attention(
        self, query: torch.Tensor, kv: torch.Tensor, layer: int, batch: AttentionBatch, scale: float
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        k_cache, v_cache = kv[layer, 0], kv[layer, 1]
        if batch.all_decode:
            num_seqs, heads, head_dim = query.shape
            longest = batch.block_tables.shape[1] * batch.block_size
            splits = self.kernels.decode_num_splits(num_seqs, k_cache.shape[2], longest, self._num_sms)
            workspace = self._workspace(num_seqs, heads, head_dim, splits, query.device)
            return self.kernels.paged_decode_attention(
                query,
                k_cache,
                v_cache,
                batch.block_tables,
                batch.seq_lens_tensor,
                scale,
                out,
                num_splits=splits,
                workspace=workspace,
            )
        return self.kernels.paged_prefill_attention(
            query,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.query_start_loc,
            batch.seq_lens_tensor,
            scale,
            out,
            max_query_len=batch.max_query_len,
        )

    def _workspace(self, num_seqs: int, heads: int, head_dim: int, splits: int, device) -> torch.Tensor | None:
        needed = self.kernels.decode_workspace_numel(num_seqs, heads, head_dim, splits)
        if not needed:
            return None
        workspace = self._workspaces.get(splits)
        if workspace is None or workspace.numel() < needed:
            workspace = self.kernels.decode_workspace(num_seqs, heads, head_dim, splits, device)
            self._workspaces[splits] = workspace
            self._kept.append(workspace)
        return workspace


def load_device(spec: str) -> TorchDevice:
    """``cpu``, ``cuda``, ``cuda:1``, ``npu`` ...: the device plugin named
    by the part before the colon, from the ``sagellm.torch_devices`` group."""
    name, _, index = spec.partition(":")
    # as every plugin group: refused when blocked or registered twice (docs/threat-model.md)
    entry = registry.find(DEVICE_GROUP, name, f"[engine] device = {spec!r}")
    if entry is None:
        found = sorted({ep.name for ep in metadata.entry_points(group=DEVICE_GROUP)})
        hint = " (pip install sagellm-plugin-torch-npu)" if name == "npu" else ""
        raise ConfigError(f"[engine] device = {spec!r}: no such device; installed: {', '.join(found)}{hint}")
    try:
        cls = entry.load()
    except Exception as exc:
        raise ConfigError(
            f"[engine] device = {spec!r}: {entry.value} failed to import: {type(exc).__name__}: {exc}"
        ) from None
    if index and not index.isdigit():
        raise ConfigError(f"[engine] device = {spec!r}: the index after ':' must be a number")
    return cls(int(index) if index else None)
