"""KV read in place: the decode side reads the leased blocks straight
from the prefill side's registered KV tensor into its own, with a library
that reads remote memory (the Mooncake Transfer Engine, :mod:`.mooncake`;
NIXL, :mod:`.nixl`: each a :class:`Memory`).

Each process registers its engine's KV tensor once, whatever its links. A
pull is one batch of reads, one per layer slab and run of consecutive block
ids on both sides (:func:`.kv_tensors.segments`): no copy out, no staging
buffer. So the prefill side holds the lease until the decode side says the
read completed, or until the deadline; who ends it is settled by the
store's compare-and-set on the lease's key, so a read the deadline overtook
is never used.

The exchange, per request (``kv/<link>/`` keys):

1. prefill: once per link, ``peer`` = ``<kind> <session> <address> <slabs>
   <blocks> <chunk bytes> <layout fingerprint> [<handshake, hex>]``; after
   the prefill, ``blocks/<rid>`` = the leased block ids, then
   ``lease/<rid>`` = ``offer <blocks> <bytes per block>``;
2. decode: claims it by compare-and-set to ``read <start> <count>
   <epoch>``; the prefill side ends an unclaimed or claimed lease at its
   deadline by compare-and-set to ``expired``;
3. decode: reads the blocks into its landing, then compare-and-sets the
   claim to ``done`` (the prefill side lets the blocks go) and caches them;
   if ``expired`` won instead, the bytes read may be of blocks reused since:
   the landing is freed unwritten and the prompt computed. A read that
   fails sets ``failed``.

Each key is deleted by the side that reads it last: ``blocks/<rid>`` and a
lease's key that holds the decode side's last word (``done``,
``declined``, ``failed``) by the prefill side as the lease ends; a lease's
key that holds the prefill side's (``none``, ``expired``) by the decode
side once it has read it.

``<epoch>`` is the decode process's turn on the link (a counter in the
store, taken as it starts): a decode process that restarts finds the
claims its predecessor left (a lease claimed and never confirmed) and takes
them over by compare-and-set, reading the blocks the lease still holds;
the predecessor's confirmation, should it still come, loses.

A read still running at the decode side's deadline, or at the read's own
(a peer that stopped without closing its connection), is not waited for:
the pull ends ``EXPIRED`` or ``FAILED`` there, and the read is cancelled
where its library can (NIXL); one that cannot be cancelled (Mooncake's
blocking read) is *parked*: its landing's blocks stay held until the read
has ended, so that bytes arriving late never land in blocks given to
another request. A parked landing is freed as soon as its read ends, by
:meth:`DecodePuller.reap`, which the instance calls on its engine thread
every :data:`REAP_POLL_S` while any is parked (not only at the next
pull); its read is bounded by the library's own timeout (Mooncake's
progress timeout, set to the read's deadline), so the landing is freed by
the read's deadline plus :data:`REAP_SLACK_S`. A read that breaks that
bound keeps its landing (never freed under a running write) and is
counted (``reads_past_bound``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import attrs

from sagellm_core.runtime import Runtime
from sagellm_core.types import Request

from .kv_tensors import BlockLayout, KVTensors, TransportError, segments
from .transfer import Landing, Leases, TransferCounts, TransferStatus
from .transports import Faults, OfferReader, parse_offer, span, store_key

# Faults (tests), per request id. Prefill side: ``expire`` (the lease's
# deadline is its grant), ``expire-claimed`` (the deadline passes once the
# decode side has claimed the lease), ``exit-after-offer`` (once every earlier lease
# has ended, the process offers this one and exits), ``stop-after-offer`` (the
# same, but the process stops itself, SIGSTOP: a peer that no longer answers
# and keeps its connections open). Decode side: ``error``
# (the read asks for addresses past the peer's registered memory, which the
# peer's engine refuses), ``late`` (claims only once the offer is gone, or
# at its deadline), ``confirm-late`` (after the read, confirms only once
# the claim is gone, or at its deadline), ``exit-after-claim``,
# ``stall`` (the read is still running, whatever it does, until
# ``STALL_S`` after it started: a peer that stopped answering).

#: How long a ``stall`` fault holds a read.
STALL_S = 1.0
#: How long past its read's own deadline a parked landing may still be
#: held: the library's timeout granularity (Mooncake counts its progress
#: timeout in whole seconds) and the reaper's period.
REAP_SLACK_S = 2.0
#: Seconds between two reaps of parked landings, on the engine's thread.
REAP_POLL_S = 0.05


class _Stalled:
    """A read held as running until ``until`` (monotonic seconds), then itself."""

    def __init__(self, read: Read, until: float) -> None:
        self.read, self.until = read, until

    def wait(self, timeout_s: float) -> bool | None:
        left = self.until - time.monotonic()
        if left > timeout_s:
            time.sleep(max(0.0, timeout_s))
            return None
        time.sleep(max(0.0, left))
        return self.read.wait(max(0.0, timeout_s - max(0.0, left)))

    def cancel(self) -> bool:
        return time.monotonic() >= self.until and self.read.cancel()


@attrs.define(eq=False)
class Parked:
    """A read that outlived its pull, and the landing it may still write."""

    read: Read
    landing: Landing
    #: When its landing must be free: the read's deadline plus :data:`REAP_SLACK_S`.
    free_by: float
    past_bound: bool = False


@attrs.frozen
class Peer:
    """The other side's registered KV tensor, as its description says."""

    session: str
    address: int
    layout: BlockLayout
    fingerprint: str
    #: What a library needs to reach the peer beyond its session (NIXL's agent metadata).
    handshake: bytes = b""

    @property
    def nbytes(self) -> int:
        return self.layout.outer * self.layout.num_blocks * self.layout.chunk_bytes


@attrs.frozen
class Local:
    """This process's registered KV tensor."""

    kind: str
    session: str
    address: int
    layout: BlockLayout
    fingerprint: str
    handshake: bytes
    #: Kept alive here: the library serves reads of its memory for as long as the process runs.
    tensor: Any
    #: The address peers reach it at.
    host: str = "127.0.0.1"

    def describe(self) -> str:
        layout = self.layout
        text = (
            f"{self.kind} {self.session} {self.address} {layout.outer} {layout.num_blocks}"
            f" {layout.chunk_bytes} {self.fingerprint}"
        )
        return f"{text} {self.handshake.hex()}" if self.handshake else text


def parse_peer(value: str, kind: str) -> Peer | None:
    """A ``kind`` peer's description; ``None`` for anything else."""
    parts = value.split()
    if len(parts) not in (7, 8) or parts[0] != kind or not all(n.isdigit() for n in parts[2:6]):
        return None
    address, outer, blocks, chunk = map(int, parts[2:6])
    try:
        handshake = bytes.fromhex(parts[7]) if len(parts) == 8 else b""
    except ValueError:
        return None
    if outer > 0 and blocks > 0 and chunk > 0:
        return Peer(parts[1], address, BlockLayout(outer, blocks, chunk), parts[6], handshake)
    return None


class Read(Protocol):
    """A read under way. One may also say what its library reported where
    it failed (``error``: a string, empty otherwise), which the pull's
    reason then gives."""

    def wait(self, timeout_s: float) -> bool | None:
        """Whether the read completed (``False``: it failed), waiting up to
        ``timeout_s``; ``None`` while it runs. Once it has ended, its
        resources are released."""
        ...

    def cancel(self) -> bool:
        """Stop the read if it still runs: True once no byte of it can
        land any more (it ended, or its library cancelled it)."""
        ...


class Memory:
    """A library that registers a process's KV tensor and reads a peer's: a
    subclass per library gives :meth:`_register` and :meth:`start_read`."""

    kind: str
    #: A read's deadline of its own, from its start (``None``: the pull's
    #: alone): a read still running then ends its pull ``FAILED``.
    read_timeout_s: float | None = None

    def __init__(self) -> None:
        self._registered: dict[tuple[int, int], Local] = {}
        #: The library's object behind each registration (an engine, an agent), by its session.
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()

    def register(self, kv: KVTensors, host: str) -> Local:
        """This process's registration of ``kv``'s tensor, made once per
        tensor, reachable at ``host`` (an address of this machine)."""
        tensor = kv.tensor
        key = (tensor.data_ptr(), tensor.nbytes)
        with self._lock:
            found = self._registered.get(key)
            if found is None:
                layout = kv.layout()
                session, handshake, handle = self._register(tensor, host)
                found = Local(self.kind, session, tensor.data_ptr(), layout, kv.fingerprint, handshake, tensor, host)
                self._registered[key] = found
                self._handles[session] = handle
            elif found.host != host:
                raise TransportError(f"{self.kind}: KV registered at {found.host}, asked again at {host}")
        return found

    def handle(self, local: Local) -> Any:
        return self._handles[local.session]

    def _register(self, tensor: Any, host: str) -> tuple[str, bytes, Any]:
        """Register ``tensor`` with the library, reachable at ``host``: the
        session a peer reaches it by, the handshake bytes a peer needs, and
        the library's object."""
        raise NotImplementedError

    def start_read(self, local: Local, peer: Peer, segments: list[tuple[int, int, int]]) -> Read:
        """Start reading each ``(peer offset, local offset, bytes)`` of ``segments``."""
        raise NotImplementedError


def parse_read(value: str) -> tuple[int, int, int] | None:
    """``read <start> <count> <epoch>`` as its three numbers; ``None`` for anything else."""
    match value.split():
        case ["read", start, count, epoch] if start.isdigit() and count.isdigit() and epoch.isdigit():
            return int(start), int(count), int(epoch)
    return None


def parse_ids(value: str, count: int, num_blocks: int) -> tuple[int, ...] | None:
    """``count`` comma-separated block ids below ``num_blocks``; ``None`` otherwise."""
    parts = value.split(",")
    if len(parts) != count or not all(p.isdigit() for p in parts):
        return None
    ids = tuple(map(int, parts))
    return ids if all(i < num_blocks for i in ids) else None


def _unlike(peer: Peer | None, ids: tuple[int, ...] | None) -> str:
    """Why an offer cannot be read into this instance."""
    if peer is None:
        return "no peer described on the link"
    if ids is None:
        return "the lease's block ids missing or not the peer's"
    return "the peer's blocks are of another size, model or layout"


class PrefillServer:
    """The prefill side of one link: leases, offered in place; each held
    until the decode side confirms its read, or its deadline."""

    #: The library that serves the reads (a subclass per transport).
    memory: Memory

    def __init__(
        self,
        rt: Runtime,
        kv: KVTensors,
        store: Any,
        link: str,
        *,
        lease_s: float,
        send_timeout_s: float,
        faults: Faults | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        del send_timeout_s  # nothing is sent: the decode side reads
        self.leases = Leases(rt, lease_s)
        self.kv, self.store, self.link, self.host = kv, store, link, host
        self.faults = dict(faults or {})
        self._offers: dict[str, str] = {}
        self._published = False
        #: Leases the deadline ended while the decode side had claimed them.
        self.expired_claimed = 0

    def offer(self, request: Request, now_s: float) -> int:
        """Lease ``request``'s cached prompt blocks and offer them; the
        blocks offered (0: nothing to offer, the decode side computes)."""
        rid = request.request_id
        exit_after = self.faults.get(rid) in ("exit-after-offer", "stop-after-offer")
        while exit_after and self.busy:
            self.poll(time.monotonic())
            time.sleep(0.002)
        lease = self.leases.grant(request, now_s)
        value = "none"
        if lease is not None:
            if not self._published:
                self.store.set(store_key(self.link, "peer"), self.memory.register(self.kv, self.host).describe())
                self._published = True
            self.store.set(store_key(self.link, f"blocks/{rid}"), ",".join(map(str, lease.block_ids)))
            value = f"offer {len(lease.block_ids)} {self.kv.bytes_per_block}"
            self._offers[rid] = value
            if self.faults.get(rid) == "expire":
                lease.deadline_s = now_s
        self.store.set(store_key(self.link, f"lease/{rid}"), value)
        if exit_after and self.faults.get(rid) == "stop-after-offer":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif exit_after:
            os._exit(17)
        return 0 if lease is None else len(lease.block_ids)

    def poll(self, now_s: float) -> None:
        """End the leases the decode side confirmed or gave up, and those
        past their deadline, claimed or not."""
        for rid, offered in list(self._offers.items()):
            key = store_key(self.link, f"lease/{rid}")
            # A key gone is one the front swept (its transfer long over): nobody claims it now.
            value = self.store.get(key).decode() if self.store.check([key]) else "failed"
            if value == offered or parse_read(value) is not None:
                claimed_now = value != offered and self.faults.get(rid) == "expire-claimed"
                if now_s <= self.leases.open[rid].deadline_s and not claimed_now:
                    continue
                # A claim may land between the read and the swap: swap what is there.
                while value == offered or parse_read(value) is not None:
                    claimed = value != offered
                    value = self.store.compare_set(key, value, "expired").decode()
                    if value == "expired":
                        self.expired_claimed += claimed
                        break
            del self._offers[rid]
            self.store.delete_key(store_key(self.link, f"blocks/{rid}"))
            if value == "expired":  # kept for the decode side, which deletes it once read
                self.leases.end(rid, TransferStatus.EXPIRED)
            else:  # done (read), declined (not needed), failed or a value no decode side writes
                self.store.delete_key(key)  # the decode side's last word: nobody reads it again
                self.leases.end(rid, TransferStatus.DONE if value in ("done", "declined") else TransferStatus.FAILED)

    @property
    def busy(self) -> bool:
        return bool(self._offers)

    def figures(self) -> dict[str, int]:
        return {"expired_claimed": self.expired_claimed}


class DecodePuller(OfferReader):
    """The decode side of one link: reads a prompt's blocks in place from
    the prefill side's memory into a landing; a pull that does not end
    ``DONE`` leaves nothing held once its read has returned."""

    #: The library that reads (a subclass per transport).
    memory: Memory

    def __init__(
        self,
        rt: Runtime,
        kv: KVTensors,
        store: Any,
        link: str,
        *,
        faults: Faults | None = None,
        clock: Callable[[], float] = time.monotonic,
        host: str = "127.0.0.1",
    ) -> None:
        self.rt, self.kv, self.store, self.link, self.host = rt, kv, store, link, host
        self.faults = dict(faults or {})
        self.clock = clock
        self.counts = TransferCounts()
        #: Why the last pull did not end ``DONE`` (``""`` when it did): what failed, or which deadline passed.
        self.reason = ""
        self._read_error = ""
        self._landing: Landing | None = None
        self._claim: str | None = None
        #: Reads that outlived their pull, and their landings (:meth:`reap`).
        self._parked: list[Parked] = []
        #: Parked reads still running past their bound (their landings kept).
        self.reads_past_bound = 0
        #: This process's turn on the link: a decode process that restarts
        #: takes a higher one, and takes over the claims of lower ones.
        self.epoch = int(self.store.add(store_key(self.link, "epoch"), 1))

    def reap(self) -> int:
        """Free the landings of parked reads that have ended, or that are
        past their bound and can be cancelled; how many are still held.
        Called on the engine's thread (it frees blocks)."""
        now = time.monotonic()
        for parked in list(self._parked):
            ended = parked.read.wait(0.0) is not None
            if not ended and now >= parked.free_by:
                ended = parked.read.cancel()
                if not ended and not parked.past_bound:
                    parked.past_bound = True
                    self.reads_past_bound += 1
            if ended:
                self._parked.remove(parked)
                parked.landing.abandon()
        return len(self._parked)

    @property
    def parked(self) -> int:
        """Landings held for reads that outlived their pull."""
        return len(self._parked)

    def pull(self, request: Request, timeout_s: float) -> TransferStatus:
        """Pull ``request``'s prompt blocks into this instance's prefix
        cache, ending in a terminal state within ``timeout_s``; counted."""
        deadline = self.clock() + timeout_s
        self.reap()
        self._landing, self._claim, self.reason = None, None, ""
        key = store_key(self.link, f"lease/{request.request_id}")
        try:
            status, num_blocks = self._pull(request, key, deadline)
        except Exception as exc:  # the store raises RuntimeErrors of its own; the engine, TransportError
            status, num_blocks = (TransferStatus.EXPIRED if self.clock() >= deadline else TransferStatus.FAILED), 0
            self.reason = f"{type(exc).__name__}: {exc}"
        if status is TransferStatus.DONE:
            self.reason = ""
        elif not self.reason:
            self.reason = status.value
        if status is not TransferStatus.DONE:
            if self._landing is not None:
                self._landing.abandon()
            if self._claim is not None:  # the prefill side may let the blocks go now
                try:
                    self.store.compare_set(key, self._claim, "failed")
                except Exception:  # the store is gone: the lease's deadline ends it
                    pass
        self._landing, self._claim = None, None
        recomputed = 0 if status is TransferStatus.DONE else request.num_prompt_tokens
        self.counts.count(status, num_blocks, recomputed)
        return status

    def _peer(self) -> Peer | None:
        key = store_key(self.link, "peer")
        return parse_peer(self.store.get(key).decode(), self.memory.kind) if self.store.check([key]) else None

    def _pull(self, request: Request, key: str, deadline: float) -> tuple[TransferStatus, int]:
        rid = request.request_id
        self.store.wait([key], span(deadline - self.clock()))
        offered = self.store.get(key).decode()
        if offered in ("none", "expired"):  # the prefill side's last word: nobody reads it again
            self.store.delete_key(key)
        if offered == "none":  # nothing to lend (a short prompt, or its blocks evicted before the lease)
            return TransferStatus.DONE, 0
        offer = parse_offer(offered)
        taken = parse_read(offered)
        if offer is None and taken is not None and taken[2] < self.epoch:
            # Claimed by this link's decode process before this one, which is
            # gone: the lease still holds the blocks, and this process takes
            # the claim over (the earlier one's confirmation could not win).
            offer = (0, self.kv.bytes_per_block)
        if offer is None:
            if offered == "expired":
                return self._ended(TransferStatus.EXPIRED, "the lease expired before its claim")
            return self._ended(TransferStatus.FAILED, f"no offer on the lease's key ({offered!r})")
        num_blocks, bytes_per_block = offer
        peer = self._peer()
        blocks_key = store_key(self.link, f"blocks/{rid}")
        ids = None
        if peer is not None and self.store.check([blocks_key]):
            listed = self.store.get(blocks_key).decode()
            num_blocks = num_blocks or len(listed.split(","))
            ids = parse_ids(listed, num_blocks, peer.layout.num_blocks)
        if (
            ids is None
            or peer is None
            or bytes_per_block != self.kv.bytes_per_block
            or peer.fingerprint != self.kv.fingerprint  # another model or layout: its bytes are not our KV
        ):
            why = _unlike(peer, ids)
            return self._ended(TransferStatus.FAILED if self.decline(key, offered) else TransferStatus.EXPIRED, why)
        landing = self._landing = Landing.open(self.rt, request, num_blocks)
        if landing is None or not landing.block_ids:
            declined = self.decline(key, offered)
            if landing is None:
                return self._ended(TransferStatus.FAILED if declined else TransferStatus.EXPIRED, "no room to land")
            self._landing = None  # this instance holds every block: the lease's outcome does not matter
            landing.land()
            return TransferStatus.DONE, 0
        fault = self.faults.get(rid)
        if fault == "late":
            while self.store.get(key).decode() == offered and self.clock() < deadline:
                time.sleep(0.005)
        count = len(landing.block_ids)
        claim = f"read {landing.start} {count} {self.epoch}"
        if self.store.compare_set(key, offered, claim).decode() != claim:
            self.decline(key, offered)  # the value is "expired" (read, deleted) or a newer claim
            return self._ended(TransferStatus.EXPIRED, "the lease ended before its claim")
        self._claim = claim
        if fault == "exit-after-claim":
            os._exit(17)
        read, overdue = self._read(peer, ids[landing.start : landing.start + count], landing, deadline, fault)
        if read is None:  # still reading at a deadline: cancelled (abandoned), or parked (reap)
            if self._parked and self._parked[-1].landing is landing:
                self._landing = None
            which = "the read's own deadline" if overdue else "the pull's deadline"
            return self._ended(
                TransferStatus.FAILED if overdue else TransferStatus.EXPIRED, f"still reading at {which}"
            )
        if not read:
            return self._ended(
                TransferStatus.FAILED, self._read_error or f"{self.memory.kind}: the read ended in error"
            )
        if fault == "confirm-late":
            while self.store.get(key).decode() == claim and self.clock() < deadline:
                time.sleep(0.005)
        if self.store.compare_set(key, claim, "done").decode() != "done":
            # The deadline ended the lease first (or a later decode process took
            # the claim over): the blocks read may have been reused since.
            self._claim = None
            self.decline(key, claim)  # deletes "expired", read
            return self._ended(TransferStatus.EXPIRED, "the lease ended before the read was confirmed")
        self._claim = None
        self._landing = None
        landing.land()
        return TransferStatus.DONE, count

    def _ended(self, status: TransferStatus, why: str) -> tuple[TransferStatus, int]:
        self.reason = why
        return status, 0

    def _read(
        self, peer: Peer, src_ids: tuple[int, ...], landing: Landing, deadline: float, fault: str | None
    ) -> tuple[bool | None, bool]:
        """Read ``src_ids`` of the peer's tensor into the landing's blocks,
        as one batch: whether it completed (``None``: still reading at the
        pull's deadline or the read's own, :attr:`Memory.read_timeout_s`,
        then cancelled, or parked with its landing where it cannot be), and
        whether the read's own deadline was the one that passed."""
        local = self.memory.register(self.kv, self.host)
        found = segments(peer.layout, src_ids, local.layout, landing.block_ids)
        if fault == "error":
            found = [(src + peer.nbytes, dst, length) for src, dst, length in found]
        started = time.monotonic()
        read = self.memory.start_read(local, peer, found)
        if fault == "stall":
            read = _Stalled(read, started + STALL_S)
        limit, overdue = deadline - self.clock(), False
        if self.memory.read_timeout_s is not None and self.memory.read_timeout_s < limit:
            limit, overdue = self.memory.read_timeout_s, True
        done = read.wait(max(0.0, limit))
        self._read_error = getattr(read, "error", "") if done is False else ""
        if done is None:
            bound = self.memory.read_timeout_s if self.memory.read_timeout_s is not None else limit
            if not read.cancel():  # still running: its landing waits for it; else abandoned with the pull
                self._parked.append(Parked(read, landing, started + bound + REAP_SLACK_S))
        return done, overdue
