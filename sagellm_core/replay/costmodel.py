"""Roofline step time: a step costs the larger of its FLOPs at the hardware's
sustained FLOP/s and its bytes (weights once, KV read and written) at the
sustained bandwidth, plus a fixed per-step overhead.

Numbers are dense BF16/FP16 peaks from the vendors' data sheets, times an
efficiency that real kernels reach (about 0.6 of peak FLOP/s for GEMMs, 0.8
of peak bandwidth); both are settable.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from attrs import field, frozen

from sagellm_core.drivers.step_scheduler import ScheduledChunk


@frozen
class Hardware:
    name: str
    flops: float  # peak dense FLOP/s, 16-bit
    bandwidth: float  # peak memory bytes/s


@frozen
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        attn += self.num_heads * self.head_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attn + mlp) + 2 * self.vocab_size * self.hidden_size

    @property
    def flops_per_token(self) -> float:
        """Dense FLOPs of one token through the weights (a multiply-add each)."""
        return 2.0 * self.num_params

    @property
    def flops_per_token_pair(self) -> float:
        """Attention FLOPs for one (query, key) pair: QK^T and AV, every layer."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


HARDWARE = {
    h.name: h
    for h in (
        Hardware("h100", flops=989e12, bandwidth=3.35e12),
        Hardware("h200", flops=989e12, bandwidth=4.8e12),
        Hardware("a100", flops=312e12, bandwidth=2.0e12),
        Hardware("ascend-910b", flops=320e12, bandwidth=1.6e12),
    )
}

MODELS = {
    m.name: m
    for m in (
        ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064),
        ModelShape("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256),
        ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152),
    )
}


@frozen
class CostModel:
    hardware: Hardware
    model: ModelShape
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 0.002
    # The model's per-token constants, derived once: step_time runs every
    # simulated step, and the model's properties recount its parameters.
    _flops_per_token: float = field(init=False, repr=False, eq=False)
    _flops_per_token_pair: float = field(init=False, repr=False, eq=False)
    _weight_bytes: int = field(init=False, repr=False, eq=False)
    _kv_bytes_per_token: int = field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        m = self.model
        object.__setattr__(self, "_flops_per_token", m.flops_per_token)
        object.__setattr__(self, "_flops_per_token_pair", m.flops_per_token_pair)
        object.__setattr__(self, "_weight_bytes", m.num_params * m.dtype_bytes)
        object.__setattr__(self, "_kv_bytes_per_token", m.kv_bytes_per_token)

    def step_time(self, chunks: Iterable[ScheduledChunk]) -> float:
        tokens = 0
        pairs = 0
        kv_tokens = 0
        for c in chunks:
            n, ctx = c.num_new_tokens, c.num_context_tokens
            tokens += n
            # Each new token attends to the context and the chunk up to itself.
            pairs += n * ctx + n * (n + 1) // 2
            kv_tokens += ctx + n
        return self.step_time_of(tokens, pairs, kv_tokens)

    def prefill_compute_s(self, num_tokens: int, num_cached_tokens: int) -> float:
        """The compute time of ``num_tokens`` prompt tokens after
        ``num_cached_tokens`` in a step (a prefill is compute-bound): what
        a load from a KV store saves."""
        n, c = num_tokens, num_cached_tokens
        flops = self._flops_per_token * n + self._flops_per_token_pair * (n * c + n * (n + 1) // 2)
        return flops / (self.hardware.flops * self.flops_efficiency)

    def step_time_of(self, tokens: int, pairs: int, kv_tokens: int) -> float:
        """The time of a step from its totals: ``tokens`` new tokens,
        ``pairs`` causal (query, key) pairs they attend to, ``kv_tokens``
        tokens in KV after it (summed over its chunks)."""
        if tokens == 0:
            return 0.0
        flops = self._flops_per_token * tokens + self._flops_per_token_pair * pairs
        bytes_moved = self._weight_bytes + kv_tokens * self._kv_bytes_per_token
        compute = flops / (self.hardware.flops * self.flops_efficiency)
        memory = bytes_moved / (self.hardware.bandwidth * self.bandwidth_efficiency)
        return max(compute, memory) + self.step_overhead_s


@frozen
class Link:
    """What a KV store's loads cross to reach the device: sustained bytes/s
    and the latency of one read. Presets, not measurements of this
    machine: docs/benchmarks/tiers.md measures real copies beside them."""

    name: str
    bandwidth: float
    latency_s: float


LINKS = {
    link.name: link
    for link in (
        # Pinned host memory to an H100 over PCIe Gen5 x16 (64 GB/s a way on
        # paper); paged block copies reach about 25 GB/s.
        Link("pcie", 25e9, 10e-6),
        # A local NVMe SSD (PCIe Gen4): sequential reads near 6 GB/s, 100 µs a read.
        Link("nvme", 5e9, 100e-6),
        # A store shared by instances over 25 GbE (Redis, Mooncake Store): 3 GB/s, a round trip of 0.5 ms.
        Link("network", 3e9, 500e-6),
    )
}


@frozen
class ModeledCosts:
    """Load and recompute times from the cost model (``LoadCosts``): a
    load is its link's latency plus the model's KV bytes at the link's
    bandwidth; a store with no link loads in no time."""

    cost: CostModel
    links: Mapping[str, Link]
    block_size: int
    simulated = True

    def load_s(self, tier: str, num_blocks: int) -> float:
        link = self.links.get(tier)
        if link is None:
            return 0.0
        return link.latency_s + num_blocks * self.block_size * self.cost.model.kv_bytes_per_token / link.bandwidth

    def recompute_s(self, num_tokens: int, num_cached_tokens: int) -> float:
        return self.cost.prefill_compute_s(num_tokens, num_cached_tokens)

    def loaded(self, tier: str, num_blocks: int, seconds: float) -> None:
        pass  # a load takes its link's time, whatever the stand-in copy took
