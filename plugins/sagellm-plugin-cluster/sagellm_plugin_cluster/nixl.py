"""KV read in place over NIXL (``nixl-cu12``: NVIDIA's transfer library,
its UCX backend on host memory; loopback here, RDMA or NVLink where a
machine has them): the protocol of :mod:`.inplace`, the reads one NIXL
``READ`` transfer of the pull's byte ranges.

Each process runs one NIXL agent with its KV tensor registered (``DRAM``);
the agent's metadata travels in the link's ``peer`` description, and the
decode side adds the prefill side's agent from it once. A transfer is
polled (``check_xfer_state``) until it ends or the pull's deadline passes:
then it is cancelled (its handle released, which NIXL cancels), and its
landing freed with the pull; a read NIXL cannot cancel is parked.

UCX reaches a peer by network device, not by address: an instance whose
transport address is not loopback has its agent's UCX use the device that
holds that address (``UCX_NET_DEVICES``, where the environment does not set
it; :func:`interface_of`), so its agent's metadata names that device's
address. A loopback address (any of 127.0.0.0/8) leaves UCX's choice alone:
such an instance is reached from this machine only, by a peer on loopback
or on one of the machine's other addresses, and UCX's TCP refuses to join a
loopback device to a non-loopback one ("local loopback remote
non-loopback"; its shared-memory transports are not offered to NIXL, which
asks for peer failure handling), so an agent held to ``lo`` could not reach
a peer on ``eth0`` of the same machine, nor the reverse. On one machine
UCX reads the bytes by cross-memory attach (``cma``), its messages over TCP.

The agent's progress thread (it answers the peers' reads of this
process's memory over UCX's TCP) waits on UCX's events between two rounds,
for at most :data:`PROGRESS_WAIT_US`: NIXL's Python API starts it with no
wait at all (``pthrDelay = 0``), and then it spins, one core busy for
the life of the process, every instance's, idle or not (on a 2-core machine
the two processes of one prefill/decode pair took both cores from their own
engines). NIXL's Python API has no parameter for it: :func:`new_agent`
gives the wait to the agent's configuration as the agent is made.

Adding a peer's agent that UCX cannot reach fails (``NIXL_ERR_BACKEND``);
the pull then fails, its reason naming this agent's devices, and the agent
is added again at the next pull.

``nixl-cu12`` is the wheel imported, not the ``nixl`` meta-package (which
requires both ``nixl-cu12`` and ``nixl-cu13`` and picks one by torch's CUDA
version): the UCX backend reads host memory whatever the build, and one
wheel is half the download."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import time
from typing import Any

from . import inplace
from .inplace import Local, Peer
from .kv_tensors import TransportError

#: Seconds between two looks at a running transfer.
POLL_S = 0.0002
#: Microseconds the agent's progress thread waits for UCX's next event
#: before it progresses the workers anyway (NIXL's ``pthrDelay``): an event
#: wakes it at once, so a read does not wait for it.
PROGRESS_WAIT_US = 10_000


class NixlRead:
    """A posted ``READ`` transfer; its handle released once it has ended."""

    def __init__(self, agent: Any, handle: Any) -> None:
        self.agent, self.handle = agent, handle
        self.state = agent.transfer(handle)
        self._ended: bool | None = None

    def wait(self, timeout_s: float) -> bool | None:
        deadline = time.monotonic() + timeout_s
        while self._ended is None:
            state = self.agent.check_xfer_state(self.handle) if self.state == "PROC" else self.state
            self.state = state
            if state != "PROC":
                self._ended = state == "DONE"
                self.agent.release_xfer_handle(self.handle)
                break
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)
        return self._ended

    @property
    def error(self) -> str:
        """The transfer's state, where it ended in error."""
        return f"NIXL: the read ended in state {self.state}" if self._ended is False else ""

    def cancel(self) -> bool:
        """Release the transfer's handle, which NIXL cancels if it still
        runs; False if NIXL cannot (the handle is kept, and asked again)."""
        if self._ended is None:
            try:
                self.agent.release_xfer_handle(self.handle)
            except Exception:  # NIXL raises its own nixl*Error types: not cancelled
                return False
            self._ended = False
        return True


class NixlMemory(inplace.Memory):
    kind = "nixl"

    def __init__(self) -> None:
        super().__init__()
        #: The peers' agents added, by their metadata: a restarted peer is a new agent.
        self._peers: dict[bytes, str] = {}

    def _register(self, tensor: Any, host: str) -> tuple[str, bytes, Any]:
        if not is_loopback(host) and "UCX_NET_DEVICES" not in os.environ:
            device = interface_of(host)
            if device is None:
                raise TransportError(f"NIXL: no network device of this machine holds {host}")
            os.environ["UCX_NET_DEVICES"] = device  # read by UCX as the agent starts

        name = f"sagellm-{os.getpid()}-{len(self._handles)}"
        agent = new_agent(name)
        try:
            agent.register_memory([(tensor.data_ptr(), tensor.nbytes, 0, "")], "DRAM")
        except Exception as exc:  # NIXL raises its own nixl*Error types
            raise TransportError(f"NIXL: registering {tensor.nbytes} B of KV failed: {exc}") from exc
        return name, agent.get_agent_metadata(), agent

    def start_read(self, local: Local, peer: Peer, segments: list[tuple[int, int, int]]) -> NixlRead:
        agent = self.handle(local)
        with self._lock:
            remote = self._peers.get(peer.handshake)
            if remote is None:
                try:
                    remote = agent.add_remote_agent(peer.handshake)
                except Exception as exc:  # NIXL raises its own nixl*Error types
                    devices = os.environ.get("UCX_NET_DEVICES", "all")
                    raise TransportError(
                        f"NIXL: adding the peer's agent failed ({exc}; this agent's UCX_NET_DEVICES={devices}:"
                        " UCX logs whether it found no transport from them to the peer's devices)"
                    ) from exc
                self._peers[peer.handshake] = remote
        if isinstance(remote, bytes):
            remote = remote.decode()
        targets = agent.get_xfer_descs([(local.address + dst, length, 0) for _, dst, length in segments], "DRAM")
        sources = agent.get_xfer_descs([(peer.address + src, length, 0) for src, _, length in segments], "DRAM")
        try:
            handle = agent.initialize_xfer("READ", targets, sources, remote)
        except Exception as exc:  # NIXL raises its own nixl*Error types
            raise TransportError(f"NIXL: preparing the read of {len(segments)} ranges failed ({exc})") from exc
        return NixlRead(agent, handle)


def new_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend and a progress thread that waits
    on UCX's events (:data:`PROGRESS_WAIT_US`).

    ``nixl_agent`` builds its native configuration itself and sets
    ``pthrDelay = 0`` in it; for the one call that makes the agent, its
    module's bindings are seen through :class:`_WaitingBindings`, which
    sets the wait on that configuration. Called under the memory's lock
    (:meth:`.inplace.Memory.register`): one agent is made at a time."""
    from nixl_cu12 import _api

    config = _api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=["UCX"])
    bindings = _api.nixlBind
    _api.nixlBind = _WaitingBindings(bindings)
    try:
        agent = _api.nixl_agent(name, config)
    finally:
        _api.nixlBind = bindings
    return agent


class _WaitingBindings:
    """NIXL's native bindings, but an agent made through them gets the
    progress thread's wait (:data:`PROGRESS_WAIT_US`)."""

    def __init__(self, bindings: Any) -> None:
        self._bindings = bindings

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 (the bindings' name)
        config.pthrDelay = PROGRESS_WAIT_US
        return self._bindings.nixlAgent(name, config)


_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name is resolved first) is a loopback address."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def interface_of(host: str) -> str | None:
    """The network device of this machine whose IPv4 network holds ``host``
    (a name is resolved first); ``None`` if none does."""
    try:
        address = ipaddress.IPv4Address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            packed = struct.pack("256s", name.encode()[:15])
            try:
                own = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, packed)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(probe.fileno(), _SIOCGIFNETMASK, packed)[20:24])
            except OSError:  # no IPv4 address on it
                continue
            if address in ipaddress.IPv4Network(f"{own}/{mask}", strict=False):
                return name
    return None


#: One per process: the KV tensor is registered once, whatever the links.
MEMORY = NixlMemory()


class PrefillServer(inplace.PrefillServer):
    memory = MEMORY


class DecodePuller(inplace.DecodePuller):
    memory = MEMORY
