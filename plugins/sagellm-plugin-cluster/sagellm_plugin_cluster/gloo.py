"""KV transfers between processes: the contract of :mod:`.transfer` over
``torch.distributed``'s gloo backend (CPU tensors, TCP).

Control never goes over gloo: a gloo operation that times out closes its
pair and every later operation on the group fails, so a lease request
that waits would kill the group. The control messages are keys of a
``TCPStore`` (hosted by the long-lived front, so that neither peer takes it
down by dying); gloo carries only the blocks of a pull both sides agreed
on, as one tensor, from a standing group of the two ranks (prefill 0,
decode 1). After any failure the decode side takes a new epoch (a counter
in the store) and both sides build a new group under it: a broken group is
never used again.

The exchange, per request (``kv/<link>/`` keys):

1. prefill: after the prefill, ``lease/<rid>`` = ``offer <blocks> <bytes per block>``;
2. decode: claims it by compare-and-set to ``pull <start> <count> <epoch>``,
   ``start`` being the blocks it already holds; the prefill side ends an
   unclaimed lease at its deadline by compare-and-set to ``expired``, so
   exactly one of the two wins;
3. prefill: copies the blocks out, ends the lease (its blocks are free from
   here on: the copy is what is sent), answers ``answer/<rid>/<epoch>`` =
   ``sending`` (or ``failed``), and sends;
4. decode: receives into its landing's blocks and caches them, or on any
   error or its deadline abandons the landing and computes the prompt.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from sagellm_core import hookimpl
from sagellm_core.runtime import Runtime
from sagellm_core.types import KVCaches, Request

from .transfer import Landing, Leases, TransferCounts, TransferStatus

#: Fault injection for tests, per request id: ``error`` (copying out raises),
#: ``exit-before-send`` (the prefill process exits after answering, before
#: sending), ``exit-after-claim`` (the decode process exits after claiming),
#: ``expire`` (the prefill side's lease ends at its first watch),
#: ``late`` (the decode side claims only once the offer is gone, or at its
#: deadline).
Faults = Mapping[str, str]


class TransportError(RuntimeError):
    """A transfer that could not be carried out (the peer, the group, the data)."""


class KVTensors:
    """The engine's KV tensor, as the runtime announces it
    (``sagellm_kv_caches_allocated``): register before the engine starts."""

    def __init__(self) -> None:
        self.caches: KVCaches | None = None

    @hookimpl
    def sagellm_kv_caches_allocated(self, kv_caches: KVCaches) -> None:
        self.caches = kv_caches

    def _kv(self) -> KVCaches:
        if self.caches is None:
            raise TransportError("the engine announced no KV tensor (sagellm_kv_caches_allocated)")
        return self.caches

    @property
    def bytes_per_block(self) -> int:
        return self._kv().bytes_per_block

    def read(self, block_ids: tuple[int, ...]) -> torch.Tensor:
        """The blocks, copied into one contiguous tensor (one large copy)."""
        kv = self._kv()
        index = torch.tensor(block_ids, device=kv.tensor.device)
        # Indexing gathers along the block dimension in one pass; index_select
        # along it was several times slower on the CPU (torch 2.13).
        return kv.tensor[(slice(None),) * kv.block_dim + (index,)].cpu()

    def empty(self, num_blocks: int) -> torch.Tensor:
        kv = self._kv()
        shape = list(kv.tensor.shape)
        shape[kv.block_dim] = num_blocks
        return torch.empty(shape, dtype=kv.tensor.dtype)

    def write(self, block_ids: tuple[int, ...], data: torch.Tensor) -> None:
        kv = self._kv()
        index = torch.tensor(block_ids, device=kv.tensor.device)
        kv.tensor.index_copy_(kv.block_dim, index, data.to(kv.tensor.device))


def parse_offer(value: str) -> tuple[int, int] | None:
    """``offer <blocks> <bytes per block>`` as its two numbers; ``None`` for
    anything else (``none``, ``expired``, a claim, garbage)."""
    match value.split():
        case ["offer", blocks, size] if blocks.isdigit() and size.isdigit() and int(blocks) > 0:
            return int(blocks), int(size)
    return None


def parse_claim(value: str) -> tuple[int, int, int] | None:
    """``pull <start> <count> <epoch>`` as its three numbers; ``None`` for
    anything else."""
    match value.split():
        case ["pull", start, count, epoch] if start.isdigit() and count.isdigit() and epoch.isdigit():
            return int(start), int(count), int(epoch)
    return None


def _key(link: str, what: str) -> str:
    return f"kv/{link}/{what}"


def _span(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


class _Pair:
    """The two ranks' gloo group of one epoch."""

    def __init__(self, store: dist.Store, link: str, rank: int) -> None:
        self.store, self.link, self.rank = store, link, rank
        self.epoch: int | None = None
        self.group: dist.ProcessGroupGloo | None = None

    def of(self, epoch: int, timeout_s: float) -> dist.ProcessGroupGloo:
        """The group of ``epoch``, built (both ranks must) the first time."""
        if self.group is None or self.epoch != epoch:
            self.group = None
            self.epoch = epoch
            prefix = dist.PrefixStore(_key(self.link, f"group/{epoch}/"), self.store)
            try:
                self.group = dist.ProcessGroupGloo(prefix, self.rank, 2, _span(timeout_s))
            except Exception as exc:  # gloo raises RuntimeError and DistStoreError
                raise TransportError(f"gloo group of epoch {epoch}: {exc}") from exc
        return self.group

    def drop(self) -> None:
        """A failed operation closed the pair: the epoch is not used again."""
        self.group = None


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
    ) -> None:
        self.leases = Leases(rt, lease_s)
        self.kv, self.store, self.link = kv, store, link
        self.send_timeout_s = send_timeout_s
        self.faults = dict(faults or {})
        self._pair = _Pair(store, link, 0)
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
        self.store.set(_key(self.link, f"lease/{rid}"), value)
        return 0 if lease is None else len(lease.block_ids)

    def poll(self, now_s: float) -> None:
        """Serve the pulls that claimed a lease; end unclaimed ones past
        their deadline."""
        for rid, offered in list(self._offers.items()):
            key = _key(self.link, f"lease/{rid}")
            value = self.store.get(key).decode()
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
                self.leases.end(rid, TransferStatus.DONE if value == "declined" else TransferStatus.FAILED)

    def _serve(self, rid: str, start: int, count: int, epoch: int) -> None:
        lease = self.leases.open[rid]
        answer = _key(self.link, f"answer/{rid}/{epoch}")
        try:
            if not 0 <= start < start + count <= len(lease.block_ids):
                raise TransportError(f"pull of blocks [{start}, {start + count}) of a lease of {len(lease.block_ids)}")
            if epoch in self._broken:
                raise TransportError(f"epoch {epoch}'s group failed")
            if self.faults.get(rid) == "error":
                raise TransportError("injected transport error")
            data = self.kv.read(lease.block_ids[start : start + count])
        except (RuntimeError, IndexError):  # TransportError, or torch's copy failing: the lease still ends
            self.leases.end(rid, TransferStatus.FAILED)
            self.store.set(answer, "failed")
            return
        # Copied out: the blocks are free from here on, whatever the send does.
        self.leases.end(rid, TransferStatus.DONE)
        self.store.set(answer, "sending")
        self.sends += 1
        try:
            group = self._pair.of(epoch, self.send_timeout_s)
            if self.faults.get(rid) == "exit-before-send":
                os._exit(17)
            group.send([data], 1, 0).wait(_span(self.send_timeout_s))
        except Exception:  # the pair is closed (a timeout, a dead peer): gloo's errors are RuntimeErrors
            self.send_failures += 1
            self._broken.add(epoch)
            self._pair.drop()

    @property
    def busy(self) -> bool:
        return bool(self._offers)


class DecodePuller:
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
    ) -> None:
        self.rt, self.kv, self.store, self.link = rt, kv, store, link
        self.faults = dict(faults or {})
        self.clock = clock
        self.counts = TransferCounts()
        self._landing: Landing | None = None
        self._claimed = False
        self._pair = _Pair(store, link, 1)
        self.epoch = self._next_epoch()

    def _next_epoch(self) -> int:
        return int(self.store.add(_key(self.link, "epoch"), 1))

    def num_blocks_available(self, request: Request) -> int:
        """The blocks of ``request``'s prompt the prefill side offers now (0:
        no offer, or it is claimed or ended): this side as a ``KVSource``."""
        key = _key(self.link, f"lease/{request.request_id}")
        offer = parse_offer(self.store.get(key).decode()) if self.store.check([key]) else None
        return offer[0] if offer is not None else 0

    def wait_for_offer(self, request: Request, timeout_s: float) -> bool:
        """Wait until the prefill side has answered for ``request`` (an offer
        or none): the hand-over a front makes before the decode side's pull
        starts its deadline. False after ``timeout_s``."""
        try:
            self.store.wait([_key(self.link, f"lease/{request.request_id}")], _span(timeout_s))
        except Exception:  # the store's timeout is a DistStoreError
            return False
        return True

    def pull(self, request: Request, timeout_s: float) -> TransferStatus:
        """Pull ``request``'s prompt blocks into this instance's prefix
        cache, ending in a terminal state within ``timeout_s``; counted."""
        deadline = self.clock() + timeout_s
        self._landing, self._claimed = None, False
        try:
            status, num_blocks = self._pull(request, deadline)
        except Exception:  # gloo and the store raise RuntimeErrors of their own: the pull failed
            status, num_blocks = (TransferStatus.EXPIRED if self.clock() >= deadline else TransferStatus.FAILED), 0
        if status is not TransferStatus.DONE:
            if self._landing is not None:
                self._landing.abandon()
            if self._claimed:  # the pair may be mid-message: it is never used again
                self._pair.drop()
                self.epoch = self._next_epoch()
        self._landing = None
        recomputed = 0 if status is TransferStatus.DONE else request.num_prompt_tokens
        self.counts.count(status, num_blocks, recomputed)
        return status

    def _pull(self, request: Request, deadline: float) -> tuple[TransferStatus, int]:
        rid = request.request_id
        key = _key(self.link, f"lease/{rid}")
        self.store.wait([key], _span(deadline - self.clock()))
        offered = self.store.get(key).decode()
        if offered == "none":  # nothing to lend (a short prompt, or its blocks evicted before the lease)
            return TransferStatus.DONE, 0
        offer = parse_offer(offered)
        if offer is None:
            return (TransferStatus.EXPIRED if offered == "expired" else TransferStatus.FAILED), 0
        num_blocks, bytes_per_block = offer
        if bytes_per_block != self.kv.bytes_per_block:  # another model or layout: its bytes are not our KV
            self.store.compare_set(key, offered, "declined")
            return TransferStatus.FAILED, 0
        landing = self._landing = Landing.open(self.rt, request, num_blocks)
        if landing is None or not landing.block_ids:
            self.store.compare_set(key, offered, "declined")
            if landing is None:
                return TransferStatus.FAILED, 0
            self._landing = None
            landing.land()
            return TransferStatus.DONE, 0
        if self.faults.get(rid) == "late":
            while self.store.get(key).decode() == offered and self.clock() < deadline:
                time.sleep(0.005)
        count, epoch = len(landing.block_ids), self.epoch
        claim = f"pull {landing.start} {count} {epoch}"
        if self.store.compare_set(key, offered, claim).decode() != claim:
            return TransferStatus.EXPIRED, 0
        self._claimed = True
        if self.faults.get(rid) == "exit-after-claim":
            os._exit(17)
        answer = _key(self.link, f"answer/{rid}/{epoch}")
        self.store.wait([answer], _span(deadline - self.clock()))
        if self.store.get(answer).decode() != "sending":
            return TransferStatus.FAILED, 0
        data = self.kv.empty(count)
        group = self._pair.of(epoch, deadline - self.clock())
        group.recv([data], 0, 0).wait(_span(deadline - self.clock()))
        self.kv.write(landing.block_ids, data)
        self._landing = None
        landing.land()
        return TransferStatus.DONE, count
