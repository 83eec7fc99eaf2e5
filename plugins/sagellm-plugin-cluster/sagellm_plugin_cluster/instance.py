"""One instance of a served cluster, in a process of its own: ``sagellm
serve``'s app on the instance's config (the server plugin's
``build_server``), with its KV events published, and two routes the front
reads:

* ``GET /kv/events?start=N``: the instance's KV event batches from number
  ``N`` on (:mod:`.events`, vLLM's wire format, hex-encoded), and the number
  of the next one; ``batches`` is ``null`` when batch ``N`` is no longer kept.
* ``POST /kv/keys`` ``{"token_ids": [...], "cache_salt": null}``: the block
  keys of that prompt as this instance's prefix cache computes them, which
  the front looks up in its index.

Both run on the engine's thread (``EngineThread.call``), where the block
observations arrive, so that a batch is never cut mid-event.

A prefill or decode instance also joins the front's store (``--store-port``)
for its links (``--links``, one per prefill-decode pair, as
:mod:`.clusterfile` names them), over the cluster file's transport
(``--transport``, :mod:`.transports`), bound on ``--transport-host`` (the
address it serves on unless the cluster file names another), and answers:

* prefill: ``POST /kv/prefill`` ``{"request_id", "token_ids", "link"}``:
  computes the prompt (one output token, discarded), leases its blocks and
  offers them on the link (the transport's ``PrefillServer``); the leases are
  served from a task that polls while any is open;
* decode: ``POST /kv/pull`` ``{"request_id", "token_ids", "link",
  "timeout_s"}``: pulls the prompt's blocks into its cache
  (the transport's ``DecodePuller``), ending done, failed or expired within
  the deadline, answering its status and, where it did not end done, its
  ``reason``; the request itself then comes as any other, and computes
  what the pull did not bring;
* both: ``GET /kv/transfers``: the leases ended (prefill) and the pulls
  by outcome (decode, with the last pull that did not end done,
  ``last_failure``: its request id, status and reason; with an in-place
  transport, also the landings still held for reads that outlived their
  pull, ``parked``, which a task frees on the engine thread as their reads
  end, and ``reads_past_bound``).

The lease and the pull run on the engine's thread (they allocate and free
blocks): a transfer holds that instance's steps for its length, bounded by
its deadline.

Run as ``python -m sagellm_plugin_cluster.instance --config FILE --host H
--port N`` (the launcher, :mod:`.launcher`, has its placement do it)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import attrs
from pydantic import BaseModel
from sagellm_plugin_server.engine_thread import QueueFull
from sagellm_plugin_server.protocol import error

from sagellm_core import config as config_mod
from sagellm_core.errors import RequestError, SagellmError
from sagellm_core.types import Request

from . import transports
from .events import KVEventPublisher
from .kv_tensors import KVTensors
from .transfer import TransferStatus

#: Seconds between two polls of a prefill instance's open leases.
LEASE_POLL_S = 0.005
#: Seconds between two reaps of a decode instance's parked landings.
REAP_POLL_S = 0.05


class KeysRequest(BaseModel):
    token_ids: list[int]
    cache_salt: str | None = None


class TransferRequest(BaseModel):
    request_id: str
    token_ids: list[int]
    link: str
    timeout_s: float = 10.0


@attrs.frozen
class Transfers:
    """How a prefill or decode instance reaches its peers."""

    role: str
    store_port: int
    links: tuple[str, ...]
    lease_s: float
    send_timeout_s: float
    transport: str = transports.DEFAULT
    #: Where the front's store is (its machine's address as the placement sees it).
    store_host: str = "127.0.0.1"
    #: The address this instance's transport binds and advertises to its peers.
    host: str = "127.0.0.1"


def build_instance(settings, transfers: Transfers | None = None):  # type: ignore[no-untyped-def]
    """(app, engine thread) for an instance's config; the thread is not started."""
    from sagellm_plugin_server.commands import build_server

    # The front reads the batches back (replay); nothing is pushed.
    publisher = KVEventPublisher(settings.block_size, lambda seq, payload: None)
    kv = KVTensors()
    app, thread, _ = build_server(settings, plugins=[publisher, kv])
    rt = thread.core.rt
    if transfers is not None:
        _add_transfer_routes(app, thread, kv, transfers)

    @app.get("/kv/events")
    async def events(start: int = 0) -> dict[str, Any]:
        def read() -> dict[str, Any]:
            publisher.flush(time.time())
            batches = publisher.replay(start)
            listed = None if batches is None else [[seq, payload.hex()] for seq, payload in batches]
            return {"batches": listed, "next": publisher.next_seq}

        return await thread.call(read)  # type: ignore[no-any-return]

    @app.post("/kv/keys")
    async def keys(body: KeysRequest) -> dict[str, Any]:
        request = Request("keys", body.token_ids, 1, cache_salt=body.cache_salt)
        full = len(body.token_ids) // rt.block_size
        found = await thread.call(lambda: rt.host.block_keys(request, 0, full) if full else ())
        return {"keys": list(found)}

    return app, thread


def _add_transfer_routes(app, thread, kv: KVTensors, transfers: Transfers) -> None:  # type: ignore[no-untyped-def]
    from .workers import connect

    store = connect(transfers.store_port, 30, transfers.store_host)
    if transfers.role == "prefill":
        _add_prefill_routes(app, thread, kv, store, transfers)
    else:
        _add_decode_routes(app, thread, kv, store, transfers)


def _add_prefill_routes(app, thread, kv: KVTensors, store, transfers: Transfers) -> None:  # type: ignore[no-untyped-def]
    from sagellm_plugin_torch.sampling import SamplingParams

    rt = thread.core.rt
    prefill_side, _ = transports.load(transfers.transport)
    servers = {
        link: prefill_side(
            rt, kv, store, link, lease_s=transfers.lease_s, send_timeout_s=transfers.send_timeout_s, host=transfers.host
        )
        for link in transfers.links
    }
    polling: list[asyncio.Task[None]] = []

    async def serve_leases() -> None:
        def poll() -> bool:
            now = time.monotonic()
            for server in servers.values():
                server.poll(now)
            return any(server.busy for server in servers.values())

        while await thread.call(poll):
            await asyncio.sleep(LEASE_POLL_S)

    @app.post("/kv/prefill")
    async def prefill(body: TransferRequest) -> Any:
        server = servers.get(body.link)
        if server is None:
            return error(400, f"link {body.link!r}: this instance serves {', '.join(servers)}", param="link")
        request = Request(body.request_id, body.token_ids, 1)
        try:
            outputs = await thread.submit([(request, SamplingParams(max_tokens=1))])
        except (RequestError, QueueFull) as exc:
            return error(503, f"prefill of {body.request_id}: {exc}", kind="server_error")
        while True:
            out = await outputs.get()
            if isinstance(out, BaseException):
                return error(500, f"prefill of {body.request_id}: engine stopped: {out!r}", kind="server_error")
            if out.finished:
                break
        if out.finish_reason == "rejected":
            return error(503, f"prefill of {body.request_id}: rejected", kind="server_error")
        offered = await thread.call(lambda: server.offer(request, time.monotonic()))
        if not polling or polling[-1].done():
            polling.append(asyncio.create_task(serve_leases()))
            del polling[:-1]
        return {"offered_blocks": offered}

    @app.get("/kv/transfers")
    async def leases() -> dict[str, Any]:
        def read() -> dict[str, Any]:
            ended: dict[str, int] = {}
            for server in servers.values():
                for status, n in server.leases.ended.items():
                    ended[status.value] = ended.get(status.value, 0) + n
            figures: dict[str, int] = {}
            for server in servers.values():
                for name, n in server.figures().items():
                    figures[name] = figures.get(name, 0) + n
            return {"leases_ended": ended, **figures}

        return await thread.call(read)  # type: ignore[no-any-return]


def _add_decode_routes(app, thread, kv: KVTensors, store, transfers: Transfers) -> None:  # type: ignore[no-untyped-def]
    rt = thread.core.rt
    _, decode_side = transports.load(transfers.transport)
    pullers = {link: decode_side(rt, kv, store, link, host=transfers.host) for link in transfers.links}
    # Landings held for reads that outlived their pull (in-place transports):
    # freed on the engine's thread as soon as their reads end, not at the next pull.
    reapers = [p for p in pullers.values() if hasattr(p, "reap")]
    reaping: list[asyncio.Task[None]] = []
    #: The last pull that did not end done: its request, status and reason.
    last_failure: dict[str, str] = {}

    async def reap_parked() -> None:
        while await thread.call(lambda: sum(p.reap() for p in reapers)):
            await asyncio.sleep(REAP_POLL_S)

    @app.post("/kv/pull")
    async def pull(body: TransferRequest) -> Any:
        puller = pullers.get(body.link)
        if puller is None:
            return error(400, f"link {body.link!r}: this instance serves {', '.join(pullers)}", param="link")
        request = Request(body.request_id, body.token_ids, 1)
        status, reason = await thread.call(
            lambda: (puller.pull(request, body.timeout_s), getattr(puller, "reason", ""))
        )
        if getattr(puller, "parked", 0) and (not reaping or reaping[-1].done()):
            reaping.append(asyncio.create_task(reap_parked()))
            del reaping[:-1]
        if status is not TransferStatus.DONE:
            last_failure.update(request_id=body.request_id, status=status.value, reason=reason)
        return {"status": status.value, "reason": reason}

    @app.get("/kv/transfers")
    async def pulls() -> dict[str, Any]:
        def read() -> dict[str, Any]:
            counts = [attrs.asdict(p.counts) for p in pullers.values()]
            summed = {key: sum(c[key] for c in counts) for key in counts[0]} if counts else {}
            if reapers:  # landings held for reads still running, and those past their bound
                summed["parked"] = sum(p.parked for p in reapers)
                summed["reads_past_bound"] = sum(p.reads_past_bound for p in reapers)
            return {**summed, "last_failure": dict(last_failure) or None}

        return await thread.call(read)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sagellm_plugin_cluster.instance", description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="the address to serve on (its placement's pick)")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--role", default="colocated", choices=["colocated", "prefill", "decode"])
    parser.add_argument("--store-port", type=int, help="the front's store (prefill and decode instances)")
    parser.add_argument("--store-host", default="127.0.0.1", help="the address of the front's store")
    parser.add_argument("--links", default="", help="this instance's links, comma-separated")
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--send-timeout-s", type=float, default=10.0)
    parser.add_argument("--transport", default=transports.DEFAULT, help="a sagellm.cluster_transport plugin")
    parser.add_argument(
        "--transport-host", help="the address the transport binds and advertises to its peers (default: --host)"
    )
    args = parser.parse_args(argv)
    import uvicorn

    transfers = None
    if args.role != "colocated":
        links = tuple(link for link in args.links.split(",") if link)
        transfers = Transfers(
            args.role,
            args.store_port,
            links,
            args.lease_s,
            args.send_timeout_s,
            args.transport,
            args.store_host,
            args.transport_host or args.host,
        )
    try:
        app, thread = build_instance(config_mod.load(args.config), transfers)
    except SagellmError as exc:
        print(f"sagellm: error: {exc}", file=sys.stderr)
        return 1
    thread.start()
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        thread.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
