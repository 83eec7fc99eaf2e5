"""The engine's KV tensor as the transports see it: announced once by the
runtime (``sagellm_kv_caches_allocated``), gathered, scattered, or laid out
as byte ranges for transports that read memory in place."""

from __future__ import annotations

import math

import torch

from sagellm_core import hookimpl
from sagellm_core.types import KVCaches


class TransportError(RuntimeError):
    """A transfer that could not be carried out (the peer, the group, the data)."""


class KVTensors:
    """The engine's KV tensor, as the runtime announces it
    (``sagellm_kv_caches_allocated``): register before the engine starts."""

    def __init__(self) -> None:
        self.caches: KVCaches | None = None

    @hookimpl
    def sagellm_kv_caches_allocated(self, kv_caches: KVCaches) -> None:
        self.caches = kv_caches

    def _kv(self) -> KVCaches:
        if self.caches is None:
            raise TransportError("the engine announced no KV tensor (sagellm_kv_caches_allocated)")
        return self.caches

    @property
    def tensor(self) -> torch.Tensor:
        return self._kv().tensor  # type: ignore[no-any-return]

    @property
    def fingerprint(self) -> str:
        return self._kv().fingerprint

    @property
    def bytes_per_block(self) -> int:
        return self._kv().bytes_per_block

    def read(self, block_ids: tuple[int, ...]) -> torch.Tensor:
        """The blocks, copied into one contiguous tensor (one large copy)."""
        kv = self._kv()
        index = torch.tensor(block_ids, device=kv.tensor.device)
        # Indexing gathers along the block dimension in one pass; index_select
        # along it was several times slower on the CPU (torch 2.13).
        return kv.tensor[(slice(None),) * kv.block_dim + (index,)].cpu()

    def empty(self, num_blocks: int) -> torch.Tensor:
        kv = self._kv()
        shape = list(kv.tensor.shape)
        shape[kv.block_dim] = num_blocks
        return torch.empty(shape, dtype=kv.tensor.dtype)

    def write(self, block_ids: tuple[int, ...], data: torch.Tensor) -> None:
        kv = self._kv()
        index = torch.tensor(block_ids, device=kv.tensor.device)
        kv.tensor.index_copy_(kv.block_dim, index, data.to(kv.tensor.device))

    def layout(self) -> BlockLayout:
        """The tensor as byte ranges, for a transport that reads memory in
        place: it must be contiguous host memory."""
        kv = self._kv()
        tensor = kv.tensor
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise TransportError(
                f"the KV tensor is {'non-contiguous ' if not tensor.is_contiguous() else ''}{tensor.device.type}"
                " memory: this transport reads contiguous host memory"
            )
        shape = tuple(tensor.shape)
        d = kv.block_dim
        return BlockLayout(math.prod(shape[:d]), shape[d], math.prod(shape[d + 1 :]) * tensor.element_size())


class BlockLayout:
    """A contiguous tensor whose dimension ``block_dim`` indexes blocks, as
    ``outer`` slabs of ``num_blocks`` chunks of ``chunk_bytes`` each: block
    ``b``'s bytes are one chunk in every slab (every layer's K and V, in
    the torch engine's ``[layers, 2, blocks, ...]``)."""

    def __init__(self, outer: int, num_blocks: int, chunk_bytes: int) -> None:
        self.outer, self.num_blocks, self.chunk_bytes = outer, num_blocks, chunk_bytes

    def offset(self, slab: int, block: int) -> int:
        return (slab * self.num_blocks + block) * self.chunk_bytes


def runs(src_ids: tuple[int, ...], dst_ids: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(src, dst, length)``: the pairs of block ids cut into the longest
    runs where both sides' ids go up by one together."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    found: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if found and found[-1][0] + found[-1][2] == s and found[-1][1] + found[-1][2] == d:
            found[-1] = (found[-1][0], found[-1][1], found[-1][2] + 1)
        else:
            found.append((s, d, 1))
    return found


def segments(
    src: BlockLayout, src_ids: tuple[int, ...], dst: BlockLayout, dst_ids: tuple[int, ...]
) -> list[tuple[int, int, int]]:
    """``(src offset, dst offset, bytes)``: the byte ranges that copy blocks
    ``src_ids`` of ``src`` into ``dst_ids`` of ``dst``, as few as the
    layouts allow (one per slab and run of consecutive ids)."""
    if (src.outer, src.chunk_bytes) != (dst.outer, dst.chunk_bytes):
        raise ValueError(
            f"layouts differ: {src.outer} slabs of {src.chunk_bytes} B chunks against {dst.outer} of {dst.chunk_bytes}"
        )
    found = []
    for s, d, length in runs(src_ids, dst_ids):
        for slab in range(src.outer):
            found.append((src.offset(slab, s), dst.offset(slab, d), length * src.chunk_bytes))
    return found
