"""Running the model's own layers over paged KV.

The forward is thin on purpose: the engine calls the model's embedding, its
decoder layers, its final norm and its head, passing rotary positions from
the model's own rotary module. Only attention differs from transformers'
forward, and it is swapped in through transformers' attention-function
registry (``AttentionInterface``): the model's attention module projects Q,
K and V, applies its rotary embedding (and Qwen3's QK norms, Qwen2's biases),
then calls :func:`paged_attention_forward`, which writes K and V into the
step's slots and attends over each sequence's blocks through the device
seam. So the weights and numerics are the model's own, and the only KV state
is the block table the runtime decided.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from .devices import BLOCK_DIM, AttentionBatch, TorchDevice

ATTENTION_NAME = "sagellm_paged"


@attrs.frozen
class StepContext:
    """What every layer's attention needs for one step."""

    device: TorchDevice
    kv: torch.Tensor
    batch: AttentionBatch


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sagellm_step: StepContext | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An attention function for transformers' registry. ``query`` is
    ``[1, heads, tokens, head_dim]`` and ``key``/``value`` ``[1, kv_heads,
    tokens, head_dim]``: the step's tokens of every sequence, flattened."""
    if sagellm_step is None:
        raise RuntimeError("sagellm_paged attention runs inside the torch engine's forward only")
    step = sagellm_step
    layer = module.layer_idx
    q = query[0].transpose(0, 1)
    step.device.write_kv(step.kv, layer, key[0].transpose(0, 1), value[0].transpose(0, 1), step.batch)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = step.device.paged_attention(q.contiguous(), step.kv, layer, step.batch, scale)
    return out[None], None  # [1, tokens, heads, head_dim], as transformers' sdpa returns


_registered = False


def register_attention() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
        _registered = True


@attrs.frozen
class KVShape:
    num_layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> KVShape:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads, head_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return (
            self.num_layers
            * 2
            * block_size
            * self.kv_heads
            * self.head_dim
            * torch.empty((), dtype=dtype).element_size()
        )


class ModelRunner:
    """One model on one device, with the KV tensor the pool's blocks index."""

    def __init__(self, model, device: TorchDevice, num_blocks: int, block_size: int):
        register_attention()
        self.model = model.to(device.torch_device)
        # The configs the attention modules read their implementation from
        # when they are called. The engine switches them to sagellm's paged
        # attention for its own forward only: the model object is shared
        # (``models.load`` caches it) and stays usable by transformers.
        self._attention_configs = list(
            {id(layer.self_attn.config): layer.self_attn.config for layer in model.model.layers}.values()
        )
        self.device = device
        self.block_size = block_size
        self.shape = KVShape.of(model.config)
        self.dtype = next(model.parameters()).dtype
        self.kv = device.allocate_kv(
            self.shape.num_layers, num_blocks, block_size, self.shape.kv_heads, self.shape.head_dim, self.dtype
        )
        self.vocab_size = model.get_output_embeddings().weight.shape[0]

    @property
    def block_dim(self) -> int:
        return BLOCK_DIM

    @torch.inference_mode()
    def forward(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        sample_rows: list[int],
    ) -> torch.Tensor:
        """Run one step; return the logits (float32) at ``sample_rows``, the
        flat token indices whose next token is sampled."""
        dev = self.device.torch_device
        width = max(len(t) for t in block_tables)
        tables = torch.zeros((len(block_tables), width), dtype=torch.int32)
        for i, row in enumerate(block_tables):
            tables[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        starts = [0]
        for n in query_lens[:-1]:
            starts.append(starts[-1] + n)
        batch = AttentionBatch(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_lens=tuple(query_lens),
            seq_lens=tuple(seq_lens),
            block_tables=tables.to(dev),
            block_size=self.block_size,
            all_decode=all(n == 1 for n in query_lens),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            query_start=tuple(starts),
        )
        step = StepContext(self.device, self.kv, batch)
        inner = self.model.model
        ids = torch.tensor(token_ids, dtype=torch.long, device=dev)[None]
        pos = torch.tensor(positions, dtype=torch.long, device=dev)[None]
        saved = [config._attn_implementation for config in self._attention_configs]
        for config in self._attention_configs:
            config._attn_implementation = ATTENTION_NAME
        try:
            hidden = inner.embed_tokens(ids)
            rotary = inner.rotary_emb(hidden, pos)
            for layer in inner.layers:
                hidden = layer(
                    hidden, attention_mask=None, position_ids=pos, position_embeddings=rotary, sagellm_step=step
                )
                if isinstance(hidden, tuple):
                    hidden = hidden[0]
        finally:
            for config, name in zip(self._attention_configs, saved):
                config._attn_implementation = name
        rows = hidden[0, torch.tensor(sample_rows, dtype=torch.long, device=dev)]
        return self.model.lm_head(inner.norm(rows)).float()
