"""KV transfers between processes: the contract of :mod:`.transfer` over
``torch.distributed``'s gloo backend (CPU tensors, TCP).

Control never goes over gloo: a gloo operation that times out closes its
pair and every later operation on the group fails, so a lease request
that waits would kill the group. The control messages are keys of a
``TCPStore`` (hosted by the long-lived front, so that neither peer takes it
down by dying); gloo carries only the blocks of a pull both sides agreed
on, from a standing group of the two ranks (prefill 0,
decode 1). After any failure the decode side takes a new epoch (a counter
in the store) and both sides build a new group under it: a broken group is
never used again.

The exchange, per request (``kv/<link>/`` keys):

1. prefill: after the prefill, ``lease/<rid>`` = ``offer <blocks> <bytes per block>``;
2. decode: claims it by compare-and-set to ``pull <start> <count> <epoch>``,
   ``start`` being the blocks it already holds; the prefill side ends an
   unclaimed lease at its deadline by compare-and-set to ``expired``, so
   exactly one of the two wins;
3. prefill: answers ``answer/<rid>/<epoch>`` = ``sending <messages>`` (or
   ``failed``), sends, and ends the lease once the send has returned
   (``done``, or ``failed`` if it failed);
4. decode: receives into its landing's blocks and caches them, or on any
   error or its deadline abandons the landing and computes the prompt.

Each side's gloo device binds the address its instance advertises
(``host``: loopback by default, the node's address across machines), and
gloo's own rendezvous publishes it under ``group/<epoch>/`` on the store,
where the other side finds it; the decode side deletes an epoch's
rendezvous keys once it leaves that epoch.

Each key is deleted by the side that reads it last: a lease's key that
holds ``declined`` by the prefill side as it reads it, one that holds a
claim once the send has returned (a failed one leaves ``failed`` there, for
a decode process that restarted to find); one that holds the prefill side's
last word (``none``, ``expired``, ``failed``) by the decode side once read;
an answer by the decode side once read, or by the prefill side when its
send failed.

A pull goes as few large copies: a small one as one message, its blocks
gathered into a buffer each side keeps between pulls (received there, then
copied into the landing's blocks); one whose share of each layer slab is
at least ``SLAB_MESSAGE_BYTES`` as one message per slab (``<messages>`` is
the KV tensor's slab count), sent straight from the prefill side's KV
tensor and received straight into the landing's blocks wherever a side's
blocks are one run of ids, through the kept buffer otherwise.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from sagellm_core.runtime import Runtime
from sagellm_core.types import Request

from .kv_tensors import KVTensors, TransportError
from .transfer import Landing, Leases, TransferCounts, TransferStatus
from .transports import Faults, OfferReader, parse_offer, span, store_key

# Faults (tests), per request id: ``error`` (copying out raises),
# ``exit-before-send`` (the prefill process exits after answering, before
# sending), ``exit-after-claim`` (the decode process exits after claiming),
# ``expire`` (the prefill side's lease ends at its first watch),
# ``late`` (the decode side claims only once the offer is gone, or at its
# deadline).


#: A pull whose share of each slab is at least this is sent as one message
#: per slab, from the KV tensor itself where its blocks are one run; a
#: smaller one as one message, gathered (each message costs a round of
#: gloo's protocol: 60 of one block each took 10 to 15 ms here, against
#: 0.3 to 1.3 ms for the block's bytes as one).
SLAB_MESSAGE_BYTES = 1 << 20


def message_count(kv: KVTensors, num_blocks: int) -> int:
    """How many messages carry a pull of ``num_blocks``: one, or one per slab."""
    return kv.outer if num_blocks * kv.bytes_per_block >= SLAB_MESSAGE_BYTES * kv.outer else 1


def outgoing(kv: KVTensors, block_ids: tuple[int, ...]) -> list[torch.Tensor]:
    """The messages that carry ``block_ids`` (:func:`message_count`): views
    of the KV tensor itself where there is one per slab and the ids are one
    run, else views of the kept send buffer, the blocks gathered into it."""
    count = len(block_ids)
    if message_count(kv, count) == 1:
        return [kv.read(block_ids)]
    found = kv.slabs(block_ids)
    return found if found is not None else list(kv.read(block_ids).view(kv.outer, count, -1).unbind(0))


def incoming(kv: KVTensors, block_ids: tuple[int, ...], messages: int) -> tuple[list[torch.Tensor], bool]:
    """Where ``messages`` that carry blocks into ``block_ids`` are received,
    and whether that is the KV tensor itself; if not, the kept receive
    buffer, which :func:`land` copies into the blocks.

    Receiving into the landing's blocks is safe on failure: gloo closes
    every pair of the group before a timed-out wait throws (and a pair
    that fails is closed), so no byte arrives after the wait has ended,
    and the landing is abandoned unwritten."""
    count = len(block_ids)
    if messages == 1:
        return [kv.empty(count)], False
    if messages != kv.outer:
        raise TransportError(f"{messages} messages for a KV tensor of {kv.outer} slabs")
    found = kv.slabs(block_ids)
    if found is not None:
        return found, True
    return list(kv.empty(count).view(messages, count, -1).unbind(0)), False


def land(kv: KVTensors, block_ids: tuple[int, ...], in_place: bool) -> None:
    """After every message of :func:`incoming` has arrived: the blocks."""
    if not in_place:
        kv.write(block_ids, kv.empty(len(block_ids)))


def parse_answer(value: str) -> int | None:
    """``sending <messages>`` as its number; ``None`` for anything else (``failed``)."""
    match value.split():
        case ["sending", messages] if messages.isdigit() and int(messages) > 0:
            return int(messages)
    return None


def parse_claim(value: str) -> tuple[int, int, int] | None:
    """``pull <start> <count> <epoch>`` as its three numbers; ``None`` for
    anything else."""
    match value.split():
        case ["pull", start, count, epoch] if start.isdigit() and count.isdigit() and epoch.isdigit():
            return int(start), int(count), int(epoch)
    return None


def group_prefix(link: str, epoch: int) -> str:
    """Where the group of ``epoch`` on ``link`` meets: gloo's rendezvous keys."""
    return store_key(link, f"group/{epoch}/")


class _Pair:
    """The two ranks' gloo group of one epoch, its device bound to ``host``."""

    def __init__(self, store: dist.Store, link: str, rank: int, host: str) -> None:
        self.store, self.link, self.rank, self.host = store, link, rank, host
        self.epoch: int | None = None
        self.group: dist.ProcessGroupGloo | None = None

    def of(self, epoch: int, timeout_s: float) -> dist.ProcessGroupGloo:
        """The group of ``epoch``, built (both ranks must) the first time."""
        if self.group is None or self.epoch != epoch:
            self.group = None
            self.epoch = epoch
            prefix = dist.PrefixStore(group_prefix(self.link, epoch), self.store)
            try:
                options = dist.ProcessGroupGloo._Options()
                options._timeout = span(timeout_s)
                # Bound to this instance's address; gloo's rendezvous publishes it.
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
                self.group = dist.ProcessGroupGloo(prefix, self.rank, 2, options)
            except Exception as exc:  # gloo raises RuntimeError and DistStoreError
                raise TransportError(f"gloo group of epoch {epoch} on {self.host}: {exc}") from exc
        return self.group

    def drop(self) -> None:
        """A failed operation closed the pair: the epoch is not used again."""
        self.group = None


def forget_epoch(store: dist.Store, link: str, epoch: int) -> None:
    """Delete the rendezvous keys of ``epoch``'s group on ``link`` (left
    behind); a store that fails now keeps them."""
    prefix = group_prefix(link, epoch)
    try:
        for key in store.list_keys() if hasattr(store, "list_keys") else ():
            if key.startswith(prefix):
                store.delete_key(key)
    except Exception:  # the store's errors are RuntimeErrors of its own
        pass


class PrefillServer:
    """The prefill side of one link: leases, and answers to pulls."""

    def __init__(
        self,
        rt: Runtime,
        kv: KVTensors,
        store: dist.Store,
        link: str,
        *,
        lease_s: float,
        send_timeout_s: float,
        faults: Faults | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.leases = Leases(rt, lease_s)
        self.kv, self.store, self.link = kv, store, link
        self.send_timeout_s = send_timeout_s
        self.faults = dict(faults or {})
        self._pair = _Pair(store, link, 0, host)
        self._offers: dict[str, str] = {}
        self._broken: set[int] = set()
        self.sends = 0
        self.send_failures = 0

    def offer(self, request: Request, now_s: float) -> int:
        """Lease ``request``'s cached prompt blocks and offer them; the
        blocks offered (0: nothing to offer, the decode side computes)."""
        rid = request.request_id
        lease = self.leases.grant(request, now_s)
        value = "none" if lease is None else f"offer {len(lease.block_ids)} {self.kv.bytes_per_block}"
        if lease is not None:
            self._offers[rid] = value
            if self.faults.get(rid) == "expire":
                lease.deadline_s = now_s
        self.store.set(store_key(self.link, f"lease/{rid}"), value)
        return 0 if lease is None else len(lease.block_ids)

    def poll(self, now_s: float) -> None:
        """Serve the pulls that claimed a lease; end unclaimed ones past
        their deadline."""
        for rid, offered in list(self._offers.items()):
            key = store_key(self.link, f"lease/{rid}")
            # A key gone is one the front swept (its transfer long over): nobody claims it now.
            value = self.store.get(key).decode() if self.store.check([key]) else "failed"
            if value == offered and now_s > self.leases.open[rid].deadline_s:
                value = self.store.compare_set(key, offered, "expired").decode()
                if value == "expired":
                    del self._offers[rid]
                    self.leases.end(rid, TransferStatus.EXPIRED)
                    continue
            if value == offered:
                continue
            del self._offers[rid]
            claim = parse_claim(value)
            if claim is not None:
                self._serve(rid, *claim)
            else:  # declined, or a value no decode side writes: nothing is sent
                self.store.delete_key(key)  # the decode side's last word: nobody reads it again
                self.leases.end(rid, TransferStatus.DONE if value == "declined" else TransferStatus.FAILED)

    def _serve(self, rid: str, start: int, count: int, epoch: int) -> None:
        lease = self.leases.open[rid]
        key, answer = store_key(self.link, f"lease/{rid}"), store_key(self.link, f"answer/{rid}/{epoch}")
        try:
            if not 0 <= start < start + count <= len(lease.block_ids):
                raise TransportError(f"pull of blocks [{start}, {start + count}) of a lease of {len(lease.block_ids)}")
            if epoch in self._broken:
                raise TransportError(f"epoch {epoch}'s group failed")
            if self.faults.get(rid) == "error":
                raise TransportError("injected transport error")
            messages = outgoing(self.kv, lease.block_ids[start : start + count])
        except (RuntimeError, IndexError):  # TransportError, or torch's copy failing: the lease still ends
            self.leases.end(rid, TransferStatus.FAILED)
            self.store.set(key, "failed")  # for a decode process that restarted: read, then deleted
            self.store.set(answer, "failed")
            return
        self.store.set(answer, f"sending {len(messages)}")
        self.sends += 1
        try:
            group = self._pair.of(epoch, self.send_timeout_s)
            if self.faults.get(rid) == "exit-before-send":
                os._exit(17)
            until = time.monotonic() + self.send_timeout_s
            works = [group.send([message], 1, tag) for tag, message in enumerate(messages)]
            for work in works:
                work.wait(span(until - time.monotonic()))
        except Exception:  # the pair is closed (a timeout, a dead peer): gloo's errors are RuntimeErrors
            self.send_failures += 1
            self.store.delete_key(answer)  # the decode side is gone, or gave up: nobody reads it
            # For a decode process that restarted (read, then deleted); where the
            # decode side has read the answer it has deleted the claim: nothing is left.
            self.store.compare_set(key, f"pull {start} {count} {epoch}", "failed")
            self.kv.drop_buffers()
            self._broken.add(epoch)
            self._pair.drop()
            forget_epoch(self.store, self.link, epoch)
            self.leases.end(rid, TransferStatus.FAILED)
            return
        # Sent: the blocks (or their copy) are no longer read, nor is the claim.
        self.store.delete_key(key)
        self.leases.end(rid, TransferStatus.DONE)

    @property
    def busy(self) -> bool:
        return bool(self._offers)

    def figures(self) -> dict[str, int]:
        return {"sends": self.sends, "send_failures": self.send_failures}


class DecodePuller(OfferReader):
    """The decode side of one link: pulls a prompt's blocks before the
    request runs; a pull that does not end ``DONE`` leaves nothing held."""

    def __init__(
        self,
        rt: Runtime,
        kv: KVTensors,
        store: dist.Store,
        link: str,
        *,
        faults: Faults | None = None,
        clock: Callable[[], float] = time.monotonic,
        host: str = "127.0.0.1",
    ) -> None:
        self.rt, self.kv, self.store, self.link = rt, kv, store, link
        self.faults = dict(faults or {})
        self.clock = clock
        self.counts = TransferCounts()
        #: Why the last pull did not end ``DONE`` (``""`` when it did): the error raised, else its status.
        self.reason = ""
        self._landing: Landing | None = None
        self._claimed = False
        self._pair = _Pair(store, link, 1, host)
        self.epoch = self._next_epoch()

    def _next_epoch(self) -> int:
        return int(self.store.add(store_key(self.link, "epoch"), 1))

    def pull(self, request: Request, timeout_s: float) -> TransferStatus:
        """Pull ``request``'s prompt blocks into this instance's prefix
        cache, ending in a terminal state within ``timeout_s``; counted."""
        deadline = self.clock() + timeout_s
        self._landing, self._claimed = None, False
        why = ""
        try:
            status, num_blocks = self._pull(request, deadline)
        except Exception as exc:  # gloo and the store raise RuntimeErrors of their own: the pull failed
            status, num_blocks = (TransferStatus.EXPIRED if self.clock() >= deadline else TransferStatus.FAILED), 0
            why = f"{type(exc).__name__}: {exc}"
        self.reason = "" if status is TransferStatus.DONE else why or status.value
        if status is not TransferStatus.DONE:
            if self._landing is not None:
                self._landing.abandon()
            if self._claimed:  # the pair may be mid-message: it is never used again, nor its buffer
                self._pair.drop()
                self.kv.drop_buffers()
                left, self.epoch = self.epoch, self._next_epoch()
                forget_epoch(self.store, self.link, left)
        self._landing = None
        recomputed = 0 if status is TransferStatus.DONE else request.num_prompt_tokens
        self.counts.count(status, num_blocks, recomputed)
        return status

    def _pull(self, request: Request, deadline: float) -> tuple[TransferStatus, int]:
        rid = request.request_id
        key = store_key(self.link, f"lease/{rid}")
        self.store.wait([key], span(deadline - self.clock()))
        offered = self.store.get(key).decode()
        if offered in ("none", "expired", "failed"):  # the prefill side's last word: nobody reads it again
            self.store.delete_key(key)
        if offered == "none":  # nothing to lend (a short prompt, or its blocks evicted before the lease)
            return TransferStatus.DONE, 0
        offer = parse_offer(offered)
        if offer is None:
            return (TransferStatus.EXPIRED if offered == "expired" else TransferStatus.FAILED), 0
        num_blocks, bytes_per_block = offer
        if bytes_per_block != self.kv.bytes_per_block:  # another model or layout: its bytes are not our KV
            return (TransferStatus.FAILED if self.decline(key, offered) else TransferStatus.EXPIRED), 0
        landing = self._landing = Landing.open(self.rt, request, num_blocks)
        if landing is None or not landing.block_ids:
            declined = self.decline(key, offered)
            if landing is None:
                return (TransferStatus.FAILED if declined else TransferStatus.EXPIRED), 0
            self._landing = None  # this instance holds every block: the lease's outcome does not matter
            landing.land()
            return TransferStatus.DONE, 0
        if self.faults.get(rid) == "late":
            while self.store.get(key).decode() == offered and self.clock() < deadline:
                time.sleep(0.005)
        count, epoch = len(landing.block_ids), self.epoch
        claim = f"pull {landing.start} {count} {epoch}"
        if self.store.compare_set(key, offered, claim).decode() != claim:
            self.decline(key, offered)  # the value is "expired": read, deleted
            return TransferStatus.EXPIRED, 0
        self._claimed = True
        if self.faults.get(rid) == "exit-after-claim":
            os._exit(17)
        answer = store_key(self.link, f"answer/{rid}/{epoch}")
        self.store.wait([answer], span(deadline - self.clock()))
        messages = parse_answer(self.store.get(answer).decode())
        self.store.delete_key(answer)  # read: nobody reads it again
        self.store.delete_key(key)  # the claim, or "failed" (set before the answer): this side is done with it
        if messages is None:
            return TransferStatus.FAILED, 0
        group = self._pair.of(epoch, deadline - self.clock())
        targets, in_place = incoming(self.kv, landing.block_ids, messages)
        works = [group.recv([target], 0, tag) for tag, target in enumerate(targets)]
        for work in works:
            work.wait(span(deadline - self.clock()))
        land(self.kv, landing.block_ids, in_place)
        self._landing = None
        landing.land()
        return TransferStatus.DONE, count
