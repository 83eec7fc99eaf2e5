"""The reproducible held-out split: whole conversations (sessions) are held
out by a hash of their id, so no turn of a test conversation is trained on."""

from __future__ import annotations

import hashlib

from sagellm_core.types import Request

TEST_FRACTION = 0.1


def held_out(request: Request, fraction: float = TEST_FRACTION) -> bool:
    key = (request.session_id or request.request_id).encode()
    draw = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") / 2**64
    return draw < fraction
