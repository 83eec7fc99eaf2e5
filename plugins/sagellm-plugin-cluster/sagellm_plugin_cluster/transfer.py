"""The KV transfer contract between a prefill and a decode instance, apart
from any transport.

The decode side pulls; the prefill side holds the prompt's blocks under a
lease until the pull has copied them out, or until the lease's deadline.
Every transfer ends in one terminal state (:class:`TransferStatus`), and a
decode side whose transfer did not end ``DONE`` computes the prompt itself:
counted, never a wrong token, never a block held after the end on either
side.

Both ends hold blocks the way every other holder does, as a request admitted
by their instance's runtime, so the runtime's ``check_invariants`` sees them:

* a **lease** (prefill side) is a request for the prompt's first ``k`` full
  blocks plus one token: its admission locks the ``k`` cached blocks (and
  takes one block for the token, never computed); ending it releases both.
* a **landing** (decode side) is a request for the same tokens: its
  admission locks the decode instance's own cached prefix and allocates the
  rest; a pull writes the other instance's blocks into them, and
  :meth:`Landing.land` inserts them into the prefix cache and lets go, so
  the request that follows finds them as a cache hit. :meth:`Landing.abandon`
  frees them unwritten.

Leases and landings are admissions of their own in their runtime's counters
(request ids ending in ``#lease`` and ``#land``), never finished requests.
"""

from __future__ import annotations

import enum
from typing import Protocol

import attrs

from sagellm_core.runtime import Runtime
from sagellm_core.types import Request, SequenceState


class TransferStatus(enum.Enum):
    PENDING = "pending"
    #: The blocks arrived (or the decode side already held them all).
    DONE = "done"
    #: The transport failed, the peer died or refused: recompute.
    FAILED = "failed"
    #: A deadline passed first (the lease's, or the decode side's): recompute.
    EXPIRED = "expired"


TERMINAL = frozenset({TransferStatus.DONE, TransferStatus.FAILED, TransferStatus.EXPIRED})


class KVSource(Protocol):
    """Something outside an instance that can provide a prompt's KV: a
    prefill instance holding a lease on it is one."""

    def num_blocks_available(self, request: Request) -> int:
        """How many of ``request``'s first full blocks this source can
        provide now (0: none)."""
        ...


def full_blocks(request: Request, block_size: int) -> int:
    """The prompt's full blocks that a cache hit may cover: all but the
    last token is the most a prefix match gives (at least one token is
    computed, as in vLLM)."""
    return (request.num_prompt_tokens - 1) // block_size


def _holder(request: Request, num_blocks: int, block_size: int, suffix: str) -> Request:
    return Request(
        f"{request.request_id}#{suffix}",
        request.prompt_token_ids[: num_blocks * block_size + 1],
        1,
        tenant=request.tenant,
        cache_salt=request.cache_salt,
    )


def _admit(rt: Runtime, holder: Request) -> SequenceState | None:
    state = rt.arrive(holder)
    if rt.admit(state, holder.num_prompt_tokens) == 0:
        return None
    return state


@attrs.define(eq=False)
class Lease:
    request_id: str
    #: The prompt's first ``num_blocks`` blocks, in order, as the pool's ids.
    block_ids: tuple[int, ...]
    deadline_s: float
    status: TransferStatus = TransferStatus.PENDING
    _state: SequenceState | None = None


class Leases:
    """The prefill side's leases: granted after a prefill, ended (:meth:`end`)
    once a pull has copied the blocks out, or at the deadline by the
    transport that watches it. A :class:`KVSource` of the leased blocks."""

    def __init__(self, rt: Runtime, lease_s: float):
        if lease_s <= 0:
            raise ValueError(f"lease_s {lease_s}: must be positive")
        self.rt = rt
        self.lease_s = lease_s
        self.open: dict[str, Lease] = {}
        self.ended: dict[TransferStatus, int] = {s: 0 for s in TERMINAL}

    def grant(self, request: Request, now_s: float) -> Lease | None:
        """Hold the cached full blocks of ``request``'s prompt until
        ``now_s + lease_s``; ``None`` when there are none to hold (nothing
        cached, or no block free for the lease's one token)."""
        rid = request.request_id
        if rid in self.open:
            raise ValueError(f"request {rid!r}: already leased")
        k = full_blocks(request, self.rt.block_size)
        if k == 0:
            return None
        state = _admit(self.rt, _holder(request, k, self.rt.block_size, "lease"))
        if state is None:
            return None
        held = state.block_ids[: len(state.block_ids) - len(state.private_block_ids)]
        if not held:  # evicted before the lease: nothing to offer
            self.rt.release(state)
            return None
        lease = Lease(rid, tuple(held), now_s + self.lease_s, state=state)
        self.open[rid] = lease
        return lease

    def end(self, request_id: str, status: TransferStatus) -> None:
        """End the lease in ``status``: its blocks are let go. Only after the
        pull has copied them out may a ``DONE`` end come."""
        if status not in TERMINAL:
            raise ValueError(f"lease {request_id!r}: {status} is not terminal")
        lease = self.open.pop(request_id)
        lease.status = status
        assert lease._state is not None
        self.rt.release(lease._state)
        lease._state = None
        self.ended[status] += 1

    def num_blocks_available(self, request: Request) -> int:
        lease = self.open.get(request.request_id)
        return len(lease.block_ids) if lease is not None else 0


@attrs.define(eq=False)
class Landing:
    """Where a pull lands on the decode side: blocks ``[start, start +
    len(block_ids))`` of the prompt go into ``block_ids``."""

    rt: Runtime
    request_id: str
    start: int
    block_ids: tuple[int, ...]
    _state: SequenceState | None
    _num_blocks: int

    @classmethod
    def open(cls, rt: Runtime, request: Request, num_blocks: int) -> Landing | None:
        """Make room for the prompt's first ``num_blocks`` full blocks, taking
        what this instance has cached; ``None`` when memory does not allow."""
        num_blocks = min(num_blocks, full_blocks(request, rt.block_size))
        if num_blocks <= 0:
            return None
        state = _admit(rt, _holder(request, num_blocks, rt.block_size, "land"))
        if state is None:
            return None
        start = len(state.block_ids) - len(state.private_block_ids)
        return cls(rt, request.request_id, start, tuple(state.block_ids[start:num_blocks]), state, num_blocks)

    def land(self) -> None:
        """The pull wrote every block: cache them and let go."""
        state = self._take()
        state.num_computed_tokens = self._num_blocks * self.rt.block_size
        self.rt.cache(state)
        self.rt.release(state)

    def abandon(self) -> None:
        """The pull did not complete: free the blocks unwritten."""
        self.rt.release(self._take())

    def _take(self) -> SequenceState:
        state, self._state = self._state, None
        if state is None:
            raise ValueError(f"landing of {self.request_id!r} already ended")
        return state


@attrs.define
class TransferCounts:
    """The decode side's transfers by how they ended, and the prompt tokens
    it computed because one did not end ``DONE``."""

    done: int = 0
    failed: int = 0
    expired: int = 0
    blocks: int = 0
    recomputed_tokens: int = 0

    def count(self, status: TransferStatus, num_blocks: int, recomputed_tokens: int) -> None:
        if status is TransferStatus.DONE:
            self.done += 1
            self.blocks += num_blocks
        elif status is TransferStatus.FAILED:
            self.failed += 1
        elif status is TransferStatus.EXPIRED:
            self.expired += 1
        else:
            raise ValueError(f"{status} is not terminal")
        self.recomputed_tokens += recomputed_tokens
