"""One stored block as bytes, the format of the stores that outlive the
process (a disk's files, a shared store's values): a header, the KV layout
as text, then the block's bytes.

The header holds a magic and version, the content key, the KV layout's
fingerprint (``KVCaches.fingerprint``: model, dtype, per-block shape), the
CRC-32 of the payload (``block_checksum``), the payload's length and the
length of the layout text (``dtype|shape``) that follows it. A record is
this store's block only if every field is what this layout and key expect
and the payload is whole; its checksum the runtime checks on every read.
"""

from __future__ import annotations

import struct

from sagellm_core.types import KVCaches, block_checksum

MAGIC = b"SGLMKV01"
#: magic, content key, fingerprint (32 hex digits), CRC-32 of the payload,
#: payload bytes, the length of the layout text that follows.
HEADER = struct.Struct("<8sQ32sIQH")
#: A checksum no block has (CRC-32 is below 2**32): a block read back that
#: cannot be what was written fails the runtime's check.
UNREADABLE = 1 << 32


def layout_text(kv: KVCaches) -> bytes:
    shape = list(kv.tensor.shape)
    del shape[kv.block_dim]
    return f"{kv.tensor.dtype}|{shape}".encode()


def header(key: int, kv: KVCaches, payload: memoryview | bytes) -> bytes:
    """The header and layout text of block ``key`` whose bytes are ``payload``."""
    layout = layout_text(kv)
    fields = HEADER.pack(MAGIC, key, kv.fingerprint.encode(), block_checksum(payload), len(payload), len(layout))
    return fields + layout


def checksum_of(head: bytes, key: int, kv: KVCaches, record_bytes: int | None = None) -> int:
    """The checksum recorded in ``head`` (a record's first bytes) if it is
    block ``key`` of ``kv``'s layout (and, given ``record_bytes``, the
    record is whole); else :data:`UNREADABLE`."""
    layout = layout_text(kv)
    if len(head) < HEADER.size + len(layout):
        return UNREADABLE
    magic, found, fingerprint, checksum, payload, length = HEADER.unpack_from(head)
    whole = record_bytes is None or record_bytes == HEADER.size + length + payload
    ok = (
        magic == MAGIC
        and found == key
        and fingerprint == kv.fingerprint.encode()
        and length == len(layout)
        and head[HEADER.size : HEADER.size + length] == layout
        and payload == kv.bytes_per_block
        and whole
    )
    return int(checksum) if ok else UNREADABLE


def size(kv: KVCaches) -> int:
    """The bytes of a record header with its layout text."""
    return HEADER.size + len(layout_text(kv))
