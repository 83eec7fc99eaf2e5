"""Each request's last block, so that a pool grows a request in place into
the free block right after it (``runs``, ``buddy``)."""

from __future__ import annotations

from collections.abc import Iterable


class RequestTails:
    """Request id -> the last block it was given, and back."""

    __slots__ = ("_tail", "_owner")

    def __init__(self) -> None:
        self._tail: dict[str, int] = {}
        self._owner: dict[int, str] = {}

    def of(self, request_id: str) -> int | None:
        """``request_id``'s last block (``None``: it holds none here)."""
        return self._tail.get(request_id)

    def is_tail(self, block_id: int) -> bool:
        """Whether ``block_id`` is some request's last block."""
        return block_id in self._owner

    def set(self, request_id: str, block_id: int) -> None:
        old = self._tail.get(request_id)
        if old is not None:
            self._owner.pop(old, None)
        self._tail[request_id] = block_id
        self._owner[block_id] = request_id

    def forget(self, block_ids: Iterable[int]) -> list[str]:
        """``block_ids`` were freed: a request whose last block is among them
        has none. Returns those requests."""
        gone = []
        for block_id in sorted(self._owner.keys() & block_ids):  # (the membership tests in C, not per block here)
            request_id = self._owner.pop(block_id)
            del self._tail[request_id]
            gone.append(request_id)
        return gone
