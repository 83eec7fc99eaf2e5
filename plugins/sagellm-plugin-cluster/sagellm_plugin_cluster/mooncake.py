"""KV read in place over the Mooncake Transfer Engine
(``mooncake-transfer-engine-non-cuda``; TCP on loopback here, RDMA where a
machine has it): the protocol of :mod:`.inplace`, the reads one
``batch_transfer_sync_read`` of the pull's byte ranges.

Each process registers its KV tensor with one ``TransferEngine`` (P2P
handshake: no metadata server). The engine's read blocks, and gives up
only after ``MC_TCP_PROGRESS_TIMEOUT_SEC`` without progress (30 s unless
set), so it runs on a thread, with a deadline of its own
(:data:`READ_TIMEOUT_S`, from its start): a read still running then, or at
the pull's deadline if that comes first, ends the pull (``failed``, or
``expired``) and the prompt is computed; its landing's blocks stay held
until the thread returns (:meth:`.inplace.DecodePuller.reap`, on the
instance's engine thread while any is parked). The engine's progress
timeout (``MC_TCP_PROGRESS_TIMEOUT_SEC``) is set to the read's deadline
where the environment does not set it, so that a read of a peer that
stopped answering returns, and its landing is let go, soon after
(``tests/test_inplace_transfer.py`` stops a real peer to show it)."""

from __future__ import annotations

import math
import os
import threading
from typing import Any

from . import inplace
from .inplace import Local, Peer
from .kv_tensors import TransportError

#: How this process's engine moves bytes (it listens on the instance's
#: transport address, which its session names to the peers).
PROTOCOL = "tcp"
#: A read's deadline of its own, in seconds from its start.
READ_TIMEOUT_S = 5.0


class ThreadRead:
    """A blocking read on a thread of its own."""

    def __init__(self, read: Any, name: str) -> None:
        self._result: list[int] = []
        self._thread = threading.Thread(target=lambda: self._result.append(read()), name=name, daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float) -> bool | None:
        self._thread.join(timeout_s)
        return None if self._thread.is_alive() else self._result == [0]

    def cancel(self) -> bool:
        """A blocking read cannot be stopped from outside: True once it has
        returned (the engine's progress timeout bounds it)."""
        return not self._thread.is_alive()

    @property
    def error(self) -> str:
        """What the engine returned, where the read failed."""
        return f"Mooncake Transfer Engine: the read returned {self._result[0]}" if self._result[:1] != [0] else ""


class MooncakeMemory(inplace.Memory):
    kind = "mooncake"
    read_timeout_s = READ_TIMEOUT_S

    def _register(self, tensor: Any, host: str) -> tuple[str, bytes, Any]:
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(math.ceil(READ_TIMEOUT_S)))
        from mooncake.engine import TransferEngine

        engine = TransferEngine()
        if engine.initialize(host, "P2PHANDSHAKE", PROTOCOL, "") != 0:
            raise TransportError(f"Mooncake Transfer Engine: initialize({host!r}, {PROTOCOL!r}) failed")
        if engine.register_memory(tensor.data_ptr(), tensor.nbytes) != 0:
            raise TransportError(f"Mooncake Transfer Engine: registering {tensor.nbytes} B of KV failed")
        return f"{host}:{engine.get_rpc_port()}", b"", engine

    def start_read(self, local: Local, peer: Peer, segments: list[tuple[int, int, int]]) -> ThreadRead:
        engine = self.handle(local)
        sources = [peer.address + src for src, _, _ in segments]
        targets = [local.address + dst for _, dst, _ in segments]
        lengths = [length for _, _, length in segments]
        return ThreadRead(
            lambda: engine.batch_transfer_sync_read(peer.session, targets, sources, lengths), "mooncake-read"
        )


#: One per process: the KV tensor is registered once, whatever the links.
MEMORY = MooncakeMemory()


class PrefillServer(inplace.PrefillServer):
    memory = MEMORY


class DecodePuller(inplace.DecodePuller):
    memory = MEMORY
