"""The ``npu`` device: the torch engine's device seam on Ascend NPUs.

* KV is written by ``torch_npu.npu_scatter_pa_kv_cache`` (``cache_mode =
  "Norm"``: per-layer caches ``[num_blocks, block_size, kv_heads,
  head_dim]``, int32 slot mapping) and attended by
  ``torch_npu.npu_fused_infer_attention_score`` with a block table (TND
  layout: queries ``[tokens, heads, head_dim]``, caches viewed as
  ``[num_blocks, block_size, kv_heads * head_dim]``, int32 block tables,
  cumulative query ends, per-sequence KV lengths, ``sparse_mode = 3``: the
  causal mask aligned bottom-right, so a chunk over a cached prefix sees
  the whole prefix). These are the calls vllm-ascend's attention backend
  makes.
* The KV tensor's start is aligned to 2 MiB, as vllm-ascend aligns KV
  buffers for prefill/decode disaggregation (its Mooncake connector
  asserts it): a torch.distributed ``hccl`` transport can register it as is.
* Block copies and host offload run on an NPU stream; memory comes from
  ``torch.npu.mem_get_info``.
* Checked before anything is allocated: float16 or bfloat16 (the fused
  attention takes no float32), block size a multiple of 16 and at most 512.
"""

from __future__ import annotations

import importlib
import os
from contextlib import AbstractContextManager as ContextManager
from itertools import accumulate
from types import ModuleType
from typing import Any

import torch
from sagellm_plugin_torch.devices import AttentionBatch, TorchDevice

from sagellm_core.errors import ConfigError

#: vllm-ascend aligns KV buffers to 2 MiB for disaggregated transfer.
KV_ALIGNMENT = 2 * 1024 * 1024
MAX_BLOCK_SIZE = 512
#: Block-size granularity of the fused attention by KV dtype.
BLOCK_MULTIPLE = {torch.float16: 16, torch.bfloat16: 16}
#: Ascend's causal mask for sparse_mode 2/3/4: 2048 x 2048, 1 = masked.
MASK_SIZE = 2048


def import_torch_npu() -> ModuleType:
    """``torch_npu``, or a one-line ConfigError saying why not."""
    # torch-npu's torch.backends entry point must not run on `import torch`
    # in a process that may lack CANN; importing torch_npu explicitly is
    # the one load.
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, ModuleNotFoundError) and exc.name == "torch_npu":
            reason = (
                "torch_npu is not installed (pip install 'sagellm-plugin-torch-npu[npu]' on a machine with Ascend CANN)"
            )
        raise ConfigError(f"device 'npu': {reason}") from None
    except Exception as exc:  # CANN libraries missing load as OSError and others
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"device 'npu': torch_npu failed to load ({type(exc).__name__}: {first});"
            " is Ascend CANN installed and sourced?"
        ) from None


class NpuDevice(TorchDevice):
    name = "npu"

    def __init__(self, index: int | None = None, torch_npu: ModuleType | None = None):
        self.torch_npu = torch_npu if torch_npu is not None else import_torch_npu()
        self.npu = self.torch_npu.npu
        if not self.npu.is_available():
            raise ConfigError(
                f"device {self.name!r}: torch.npu.is_available() is false (no NPU visible to this process)"
            )
        self.torch_device = self._torch_device(index)
        self._stream = self.npu.Stream(self.torch_device)
        self._masks: dict[torch.device, torch.Tensor] = {}

    def _torch_device(self, index: int | None) -> torch.device:
        return torch.device("npu", index or 0)

    # -------------------------------------------------------------- checks --

    def check(self, block_size: int, dtype: torch.dtype) -> None:
        if dtype not in BLOCK_MULTIPLE:
            raise ConfigError(
                f"device {self.name!r}: dtype {str(dtype).removeprefix('torch.')}: Ascend's fused attention takes"
                " float16 or bfloat16 ([engine] dtype)"
            )
        multiple = BLOCK_MULTIPLE[dtype]
        if block_size % multiple or not 0 < block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(
                f"device {self.name!r}: block_size {block_size}: Ascend's paged attention needs a multiple of"
                f" {multiple} up to {MAX_BLOCK_SIZE} for {str(dtype).removeprefix('torch.')} (128 recommended)"
            )

    # -------------------------------------------------------------- memory --

    def allocate_kv(self, num_layers, num_blocks, block_size, kv_heads, head_dim, dtype) -> torch.Tensor:
        shape = (num_layers, 2, num_blocks, block_size, kv_heads, head_dim)
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = torch.empty(size + KV_ALIGNMENT, dtype=torch.uint8, device=self.torch_device)
        offset = -raw.data_ptr() % KV_ALIGNMENT
        kv = raw[offset : offset + size].view(dtype).view(shape)
        kv.zero_()
        return kv

    def memory(self) -> tuple[int, int]:
        return self.npu.mem_get_info(self.torch_device)

    def stream(self) -> ContextManager[Any]:
        return self.npu.stream(self._stream)

    def synchronize(self) -> None:
        self.npu.synchronize()

    def event(self) -> Any:
        return self.npu.Event()

    # ------------------------------------------------------------ kernels --

    def write_kv(self, kv, layer, key, value, batch: AttentionBatch) -> None:
        self.torch_npu.npu_scatter_pa_kv_cache(
            key.contiguous(),
            value.contiguous(),
            kv[layer, 0],
            kv[layer, 1],
            batch.slot_mapping.to(torch.int32),
            cache_mode="Norm",
        )

    def _mask(self, device: torch.device) -> torch.Tensor:
        mask = self._masks.get(device)
        if mask is None:
            mask = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8, device=device), diagonal=1)
            self._masks[device] = mask
        return mask

    def paged_attention(self, query, kv, layer, batch: AttentionBatch, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv[layer, 0], kv[layer, 1]
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        out, _ = self.torch_npu.npu_fused_infer_attention_score(
            query,
            k_cache.view(num_blocks, block_size, kv_heads * head_dim),
            v_cache.view(num_blocks, block_size, kv_heads * head_dim),
            atten_mask=self._mask(query.device),
            block_table=batch.block_tables.to(torch.int32),
            input_layout="TND",
            block_size=block_size,
            actual_seq_lengths=list(accumulate(batch.query_lens)),
            actual_seq_lengths_kv=list(batch.seq_lens),
            num_heads=query.shape[1],
            num_key_value_heads=kv_heads,
            scale=scale,
            sparse_mode=3,
        )
        return out
