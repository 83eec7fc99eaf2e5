"""KV events: what each instance's cache gained and lost, in vLLM's wire
format (``vllm/distributed/kv_events.py``), so that a consumer of vLLM's
events (llm-d's indexer, Dynamo's router) decodes sagellm's unchanged.

A batch is a msgpack ``EventBatch`` ``[ts, events]``; each event a tagged
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` struct, encoded
as msgspec encodes vLLM's structs with ``array_like=True`` (the layout
vLLM's own subscriber example decodes: the tag, then the fields in order).
Newer vLLM releases encode events as tagged maps instead (the batch as an
array or as a map); :func:`decode` reads every layout. Batches are
numbered 0, 1, 2, ... per instance (vLLM sends the number beside the
payload, as an 8-byte big-endian frame), and the last
``buffer_batches`` are kept so that a subscriber that missed some asks for
them again (:meth:`KVEventPublisher.replay`, vLLM's replay socket).

The hashes are the blocks' content keys (``CachedBlock.key``): the prefix
cache's chained hash (with ``[prefix_cache] plugin = "hash"`` vLLM's own
block hash, truncated to 64 bits). A subscriber matches a prompt by
computing the same keys. ``token_ids`` is empty: block observations carry
keys, not tokens. ``medium`` is ``GPU`` for the device cache and ``CPU``
for the host tier.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from sagellm_core import hookimpl
from sagellm_core.types import CachedBlock

DEVICE = "GPU"
HOST = "CPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """One change of an instance's cache."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The same structs as tagged maps (newer vLLM releases' events).
class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class _MapStored(_MapEvent, tag="BlockStored"):  # type: ignore[call-arg]
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _MapRemoved(_MapEvent, tag="BlockRemoved"):  # type: ignore[call-arg]
    block_hashes: list[int | bytes]
    medium: str | None = None


class _MapCleared(_MapEvent, tag="AllBlocksCleared"):  # type: ignore[call-arg]
    pass


class _MapBatch(EventBatch):
    events: list[_MapStored | _MapRemoved | _MapCleared]


class _MapBatchMap(msgspec.Struct, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """A batch that is a map itself (``{"ts": ..., "events": [...]}``)."""

    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_MAP_DECODERS = (msgspec.msgpack.Decoder(_MapBatch), msgspec.msgpack.Decoder(_MapBatchMap))


class EventFormatError(ValueError):
    """A payload that is no KV event batch in either layout."""


def encode(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack payload (either layout); an
    :class:`EventFormatError` saying why if it is not one."""
    try:
        return _DECODER.decode(payload)
    except msgspec.DecodeError as first:
        for decoder in _MAP_DECODERS:
            try:
                mapped = decoder.decode(payload)
                break
            except msgspec.DecodeError:
                continue
        else:
            raise EventFormatError(f"not a KV event batch: {' '.join(str(first).split())}") from None
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for event in mapped.events:
        if isinstance(event, _MapStored):
            events.append(
                BlockStored(
                    event.block_hashes,
                    event.parent_block_hash,
                    event.token_ids,
                    event.block_size,
                    event.lora_id,
                    event.medium,
                    event.lora_name,
                )
            )
        elif isinstance(event, _MapRemoved):
            events.append(BlockRemoved(event.block_hashes, event.medium))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(mapped.ts, events, mapped.data_parallel_rank)


#: Where a publisher sends each batch: (sequence number, payload).
Sink = Callable[[int, bytes], None]


class KVEventPublisher:
    """An instance's KV events, from its runtime's block observations (the
    engine registers it with the instance's plugins): the device cache's
    blocks (``GPU``). The KV stores below the device do not report what
    they hold, so no ``CPU`` events are published yet. Events gather until :meth:`flush` (once a step)
    makes them one numbered batch, sent to ``sink`` and kept for
    :meth:`replay`."""

    def __init__(self, block_size: int, sink: Sink, buffer_batches: int = 10_000):
        self.block_size = block_size
        self.sink = sink
        self.next_seq = 0
        self._pending: list[KVCacheEvent] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        #: Device blocks by id -> content key, for a stored run's parent key.
        self._keys: dict[int, int] = {}

    # -------------------------------------------------- block observations --

    @hookimpl
    def sagellm_blocks_cached(self, blocks: tuple[CachedBlock, ...]) -> None:
        keys = self._keys
        run: list[CachedBlock] = []
        for block in blocks:
            if run and block.parent_id != run[-1].block_id:
                self._stored(run)
                run = []
            run.append(block)
            keys[block.block_id] = block.key
        if run:
            self._stored(run)

    def _stored(self, run: Sequence[CachedBlock]) -> None:
        parent = run[0].parent_id
        parent_key = None if parent is None else self._keys.get(parent)
        hashes: list[int | bytes] = [b.key for b in run]
        self._pending.append(BlockStored(hashes, parent_key, [], self.block_size, None, DEVICE, None))

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...]) -> None:
        keys = self._keys
        for block in blocks:
            keys.pop(block.block_id, None)
        self._pending.append(BlockRemoved([b.key for b in blocks], DEVICE))

    def cleared(self) -> None:
        """The instance (re)started with an empty cache."""
        self._keys.clear()
        self._pending.append(AllBlocksCleared())

    # ------------------------------------------------------------ batches --

    def flush(self, ts: float) -> int | None:
        """Send the events gathered since the last flush as one batch;
        return its sequence number (``None``: nothing to send)."""
        if not self._pending:
            return None
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        payload = encode(KVEventBatch(ts, self._pending))
        self._pending = []
        self._buffer.append((seq, payload))
        self.sink(seq, payload)
        return seq

    def replay(self, start_seq: int) -> list[tuple[int, bytes]] | None:
        """The batches from ``start_seq`` on, as first sent; ``None`` if the
        oldest of them is no longer kept."""
        if start_seq >= self.next_seq:
            return []
        if not self._buffer or self._buffer[0][0] > start_seq:
            return None
        return [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
