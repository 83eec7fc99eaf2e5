"""The runner's own decoder forward for the Llama family (Llama, Mistral,
Qwen2, Qwen3), on devices that set ``TorchDevice.fused_layers`` (``cuda``).

transformers' modules launch five to ten small kernels for each RMSNorm and
each rotary embedding, and three products where one would do; on a GPU a
decode step is then mostly launches, not the bandwidth of reading weights
and KV. This forward runs the same arithmetic over the model's own weights
with:

* one product for Q, K and V and one for the MLP's gate and up projections:
  their weights concatenated once, the model's own parameters becoming views
  of the joint tensor (no copy kept; the model stays usable by transformers);
* the residual add fused into the next RMSNorm, SiLU-and-multiply in one
  launch, and the rotary embedding fused with the KV write
  (``TorchDevice.rms_norm``, ``silu_and_mul``, ``rotary_write_kv``);
* attention through the device seam, as the model's modules reach it.

Each fused op rounds where transformers' separate ops round, so outputs
match the modules' forward but for the order of a few sums. Models of other
families, or with features this forward does not have (sliding windows,
biases on the output projection, non-SiLU activations), run the model's
modules (:meth:`FusedDecoder.of` returns ``None``).
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from .devices import TorchDevice

#: ``config.model_type`` values whose decoder layers this forward reproduces.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def _joint_linear(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linears over the same input: their
    rows concatenated, each linear's parameters replaced by a view of it."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    with_bias = [linear.bias is not None for linear in linears]
    if any(with_bias) and not all(with_bias):
        raise ValueError("some of the joined projections have a bias and some do not")
    bias = torch.cat([linear.bias.detach() for linear in linears]) if all(with_bias) else None
    at = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(weight[at : at + rows], requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias[at : at + rows], requires_grad=False)
        at += rows
    return weight, bias


@attrs.frozen
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.nn.Linear
    #: Qwen3's per-head norms of queries and keys (before the rotary embedding).
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    gate_up_weight: torch.Tensor
    down_proj: torch.nn.Linear
    scale: float


class FusedDecoder:
    """The decoder stack as one function of token ids and positions:
    :meth:`hidden` runs every layer and returns ``(hidden, residual)`` (the
    last MLP's output and the residual stream before it); :meth:`final_norm`
    adds them and applies the model's final norm for the rows that sample."""

    def __init__(self, model, layers: list[_Layer], heads: int, kv_heads: int, head_dim: int):
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = inner.norm.weight
        self.norm_eps = _eps(inner.norm)
        self.layers = layers
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    @classmethod
    def of(cls, model) -> FusedDecoder | None:
        """The fused forward of ``model``, its projections joined; ``None``
        when the model is not one this forward reproduces exactly."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(config, "model_type", None) not in FAMILIES:
            return None
        if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "sliding_window", None):
            return None
        if getattr(config, "mlp_bias", False) or getattr(config, "use_sliding_window", False):
            return None
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        inner = model.model
        first = inner.layers[0].self_attn
        head_dim = first.head_dim
        if head_dim & (head_dim - 1) or first.o_proj.bias is not None:
            return None
        layers = []
        for layer in inner.layers:
            attention, mlp = layer.self_attn, layer.mlp
            qkv_weight, qkv_bias = _joint_linear([attention.q_proj, attention.k_proj, attention.v_proj])
            gate_up_weight, _ = _joint_linear([mlp.gate_proj, mlp.up_proj])
            q_norm = getattr(attention, "q_norm", None)
            k_norm = getattr(attention, "k_norm", None)
            layers.append(
                _Layer(
                    input_norm=layer.input_layernorm.weight,
                    post_norm=layer.post_attention_layernorm.weight,
                    eps=_eps(layer.input_layernorm),
                    qkv_weight=qkv_weight,
                    qkv_bias=qkv_bias,
                    o_proj=attention.o_proj,
                    q_norm=None if q_norm is None else q_norm.weight,
                    k_norm=None if k_norm is None else k_norm.weight,
                    gate_up_weight=gate_up_weight,
                    down_proj=mlp.down_proj,
                    scale=attention.scaling,
                )
            )
        return cls(model, layers, heads, kv_heads, head_dim)

    def hidden(self, token_ids: torch.Tensor, positions: torch.Tensor, step) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over the step's flat run of tokens (``step``: the
        runner's ``StepContext``): ``(hidden, residual)``, each ``[tokens,
        hidden_size]``."""
        device: TorchDevice = step.device
        kv, batch = step.kv, step.batch
        hidden = self.embed(token_ids.long())
        cos, sin = self.rotary(hidden[None], positions.long()[None])
        cos, sin = cos[0], sin[0]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        tokens = hidden.shape[0]
        # The residual stream, which the fused adds update in place: first the embeddings.
        residual = hidden
        for index, layer in enumerate(self.layers):
            if index == 0:
                x = device.rms_norm(hidden, layer.input_norm, layer.eps)
            else:
                x = device.rms_norm(hidden, layer.input_norm, layer.eps, residual)
            qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
            q = qkv[:, :q_size].view(tokens, self.heads, self.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(tokens, self.kv_heads, self.head_dim)
            v = qkv[:, q_size + kv_size :].view(tokens, self.kv_heads, self.head_dim)
            if layer.q_norm is not None:
                q = device.rms_norm(q.reshape(-1, self.head_dim), layer.q_norm, layer.eps).view(q.shape)
                k = device.rms_norm(k.reshape(-1, self.head_dim), layer.k_norm, layer.eps).view(k.shape)
            q = device.rotary_write_kv(q, k, v, cos, sin, kv, index, batch)
            attended = device.paged_attention(q, kv, index, batch, layer.scale)
            hidden = layer.o_proj(attended.view(tokens, q_size))
            x = device.rms_norm(hidden, layer.post_norm, layer.eps, residual)
            hidden = layer.down_proj(device.silu_and_mul(F.linear(x, layer.gate_up_weight)))
        return hidden, residual

    def final_norm(self, device: TorchDevice, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The model's final norm of ``residual + hidden`` (the sampled rows
        of both; ``residual`` is updated in place)."""
        return device.rms_norm(hidden, self.norm, self.norm_eps, residual)


def _eps(norm: torch.nn.Module) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    return float(eps if eps is not None else norm.eps)
