"""The engine's KV tensor as the transports see it: announced once by the
runtime (``sagellm_kv_caches_allocated``), gathered, scattered, or laid out
as byte ranges for transports that read memory in place."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

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
        self._buffers: dict[str, torch.Tensor] = {}

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

    @property
    def outer(self) -> int:
        """The tensor's slabs: the product of its dimensions before the blocks'."""
        kv = self._kv()
        return math.prod(kv.tensor.shape[: kv.block_dim])

    def read(self, block_ids: tuple[int, ...]) -> torch.Tensor:
        """The blocks, copied into one contiguous tensor: a view of a buffer
        this object keeps for the next read (:meth:`drop_buffers`)."""
        kv = self._kv()
        out = self._buffer("send", len(block_ids))
        d = kv.block_dim
        at = 0
        with one_thread():
            for start, _, length in runs(block_ids, block_ids):
                _copy(out, at, kv.tensor, start, length, d)
                at += length
        return out

    def slabs(self, block_ids: tuple[int, ...]) -> list[torch.Tensor] | None:
        """The blocks as views of the KV tensor itself, one contiguous view
        per slab (:class:`BlockLayout`), when the ids are one run of
        consecutive blocks of a contiguous tensor; ``None`` otherwise."""
        tensor = self._kv().tensor
        if not block_ids or not tensor.is_contiguous() or len(runs(block_ids, block_ids)) != 1:
            return None
        flat = tensor.view(self.outer, tensor.shape[self._kv().block_dim], -1)
        return list(flat[:, block_ids[0] : block_ids[0] + len(block_ids)].unbind(0))

    def empty(self, num_blocks: int) -> torch.Tensor:
        """Room for ``num_blocks`` blocks, contiguous: a view of a buffer this
        object keeps for the next receive (:meth:`drop_buffers`)."""
        return self._buffer("receive", num_blocks)

    def write(self, block_ids: tuple[int, ...], data: torch.Tensor) -> None:
        kv = self._kv()
        d = kv.block_dim
        at = 0
        with one_thread():
            for start, _, length in runs(block_ids, block_ids):
                _copy(kv.tensor, start, data, at, length, d)
                at += length

    def drop_buffers(self) -> None:
        """Forget the kept buffers: after a failed send or receive, which
        may still hold one, the next transfer takes new ones."""
        self._buffers.clear()

    def _buffer(self, use: str, num_blocks: int) -> torch.Tensor:
        # Kept between transfers, grown to the largest: a fresh tensor of a
        # pull's size costs its page faults at every pull (a fresh 180 MiB
        # cost four times a copy into a kept one, torch 2.13 on this CPU).
        kv = self._kv()
        shape = list(kv.tensor.shape)
        shape[kv.block_dim] = num_blocks
        numel = math.prod(shape)
        kept = self._buffers.get(use)
        if kept is None or kept.numel() < numel:
            kept = self._buffers[use] = torch.empty(numel, dtype=kv.tensor.dtype)
        return kept[:numel].view(shape)

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


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch's intra-op work on the calling thread alone, for a copy.

    A copy of more than torch's grain (32768 elements; one block of
    SmolLM2-135M's KV is 184320) is split over its thread pool, whose idle
    threads must wake and be scheduled before the copy returns: on a 2-core
    machine under a load of 22, one block's copy after an idle gap took
    40 ms so against 0.25 ms on one thread, 16 blocks' 48 ms against 1.6 ms
    (``benchmarks/kv_copy_threads.py``; at 256 blocks the pool was the
    faster, 159 against 216 ms, but gloo copies a pull that large only where
    its blocks are not one run). Setting the count costs well under a
    microsecond; the engine's own count is restored after."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _copy(dst: torch.Tensor, dst_at: int, src: torch.Tensor, src_at: int, length: int, dim: int) -> None:
    """Blocks ``[src_at, src_at + length)`` of ``src`` into ``dst`` from ``dst_at``, along ``dim``."""
    dst.narrow(dim, dst_at, length).copy_(src.narrow(dim, src_at, length))


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
