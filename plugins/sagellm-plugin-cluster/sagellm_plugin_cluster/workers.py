"""A prefill and a decode instance of a live engine (the torch engine), each
in a process of its own, handing KV over a link of one of the transports
(:mod:`.transports`: gloo, Mooncake, NIXL): what the fault-injection tests
run, and the transfer benchmark's engines.

Each worker builds its engine from a sagellm config through the engine
layer (``build_engine``, ``LiveEngine.start``), serves its requests one at
a time, and reports to the front through the front's store (written at
once, so that what a worker reported survives its death): each request's
outputs as it ends (``result/<link>/<request id>``), then its transfer
counts and whether its runtime's accounting is whole (``check_invariants``,
``report/<link>/<role>``), or the error that ended it."""

from __future__ import annotations

import datetime
import json
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch.distributed as dist

from sagellm_core import config as config_mod
from sagellm_core.drivers.engines import LiveEngine, build_engine
from sagellm_core.drivers.step_engine import Engine
from sagellm_core.errors import ConfigError, RequestError
from sagellm_core.runtime import Runtime
from sagellm_core.types import Request

from . import transports
from .kv_tensors import KVTensors
from .transports import Faults

POLL_S = 0.002
#: The longest a decode worker waits, after its last request, for the
#: landings of reads still running: past every read's bound, so that one
#: still held then is a read its library did not end.
PARKED_WAIT_S = 30.0


def start_engine(config_path: str) -> tuple[Runtime, KVTensors, Engine]:
    """The config's live engine on a runtime of its own, with the KV tensor
    it announces."""
    settings = config_mod.load(config_path)
    plugin, _ = build_engine(settings)
    if not isinstance(plugin, LiveEngine):
        raise ConfigError(f"{config_path}: engine {settings.engine.name!r} serves no live requests")
    rt = Runtime(settings, engine_owns=frozenset(plugin.owns))
    kv = KVTensors()
    rt.host.pm.register(kv, name="cluster:kv-tensors")
    return rt, kv, plugin.start(rt)


def generate(engine: Engine, request: Request, between: Callable[[], object] = lambda: None) -> list[int]:
    """Serve ``request`` alone; its generated token ids. ``between`` is
    called after each step (a decode side's reaping of parked landings)."""
    engine.add_request(request)
    tokens: list[int] = []
    while engine.has_work():
        between()
        for out in engine.step():
            if out.finish_reason == "rejected":
                raise RequestError(f"request {out.request_id}: rejected")
            if out.token_id is not None:
                tokens.append(out.token_id)
    return tokens


def connect(port: int, timeout_s: float, host: str = "127.0.0.1") -> dist.TCPStore:
    """A client of the front's store (on loopback unless ``host`` says otherwise)."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _put(store: dist.Store, key: str, value: dict[str, Any]) -> None:
    store.set(key, json.dumps(value))


def _report(store: dist.Store, link: str, role: str, rt: Runtime, **fields: Any) -> None:
    try:
        rt.check_invariants()
        whole = "ok"
    except AssertionError as exc:
        whole = str(exc)
    _put(store, f"report/{link}/{role}", {**fields, "invariants": whole, "in_flight": rt.in_flight})


def run_prefill(
    config_path: str,
    port: int,
    link: str,
    requests: Sequence[Request],
    *,
    lease_s: float,
    send_timeout_s: float,
    faults: Faults | None = None,
    transport: str = transports.DEFAULT,
    host: str = "127.0.0.1",
) -> None:
    """Prefill each request (one output token, discarded), lease and offer
    its blocks, and serve pulls until every lease has ended; its transport
    bound to ``host``."""
    store = connect(port, 30)
    try:
        prefill_side, _ = transports.load(transport)
        rt, kv, engine = start_engine(config_path)
        server = prefill_side(
            rt, kv, store, link, lease_s=lease_s, send_timeout_s=send_timeout_s, faults=faults, host=host
        )
        for request in requests:
            generate(engine, attrs.evolve(request, output_tokens=1))
            server.offer(request, time.monotonic())
            server.poll(time.monotonic())
        while server.busy:
            server.poll(time.monotonic())
            time.sleep(POLL_S)
        leases = {status.value: n for status, n in server.leases.ended.items()}
        _report(store, link, "prefill", rt, leases=leases, **server.figures())
    except BaseException:
        _put(store, f"report/{link}/prefill", {"error": traceback.format_exc()})
        raise


def run_decode(
    config_path: str,
    port: int,
    link: str,
    requests: Sequence[Request],
    *,
    pull_timeout_s: float,
    handoff_timeout_s: float = 120.0,
    faults: Faults | None = None,
    transport: str = transports.DEFAULT,
    host: str = "127.0.0.1",
) -> None:
    """Once the prefill side has answered for a request (within
    ``handoff_timeout_s``, the front's wait), pull its prompt blocks (within ``pull_timeout_s``), then
    generate it: the prompt's tail, or the whole prompt where the pull did
    not end done. Each request's outputs are reported as it ends."""
    store = connect(port, 30)
    try:
        _, decode_side = transports.load(transport)
        rt, kv, engine = start_engine(config_path)
        puller = decode_side(rt, kv, store, link, faults=faults, host=host)
        reap = getattr(puller, "reap", lambda: 0)  # in-place transports: landings of reads still running
        for request in requests:
            puller.wait_for_offer(request, handoff_timeout_s)
            start = time.monotonic()
            status = puller.pull(request, pull_timeout_s)
            pull_s = time.monotonic() - start
            tokens = generate(engine, request, reap)
            _put(
                store,
                f"result/{link}/{request.request_id}",
                {"status": status.value, "reason": getattr(puller, "reason", ""), "pull_s": pull_s, "tokens": tokens},
            )
        # No pull follows: a parked landing is freed once its read ends, which
        # its library bounds (inplace.REAP_SLACK_S past the read's deadline).
        until = time.monotonic() + PARKED_WAIT_S
        while reap() and time.monotonic() < until:
            time.sleep(POLL_S)
        parked = {"parked": getattr(puller, "parked", 0), "reads_past_bound": getattr(puller, "reads_past_bound", 0)}
        _report(store, link, "decode", rt, counts=attrs.asdict(puller.counts), **parked)
    except BaseException:
        _put(store, f"report/{link}/decode", {"error": traceback.format_exc()})
        raise
