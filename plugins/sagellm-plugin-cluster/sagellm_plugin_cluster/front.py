"""The OpenAI-compatible front of a served cluster: each request routed by
the cluster file's ``sagellm.router`` plugin (the core's ``Router``) and
forwarded to the instance it names, streaming included. A request routed
to a prefill instance is prefilled there first, its blocks pulled by the
decode instance the router names (:meth:`Front.hand_over`), then forwarded
to that decode instance: a pull that fails or expires leaves the decode
instance to compute the prompt (counted in ``transfers``), never a wrong
token.

The router sees each instance's load as the front counts it (the prompt
tokens not in the instance's device cache, by the index when the request
was routed there, of requests sent there and not yet answered with a
first token; the requests past their first token and their tokens) and
the prompt's blocks cached there, from the front's :class:`~.index.KVIndex`:
fed by polling each instance's ``/kv/events`` (a background task, every
instance at once, and again once a request there ends), degraded and
replayed as the index does.

A prompt's token ids and block keys are computed in the front
(:class:`PromptKeys`): the instances' tokenizer and the instances'
``[prefix_cache]`` plugin's own ``sagellm_block_keys``, through the core's
plugin host, so the keys are the ones the instances publish (the cluster
file checks that every instance has the same model and prefix cache). A
front built with ``ask_instances`` asks an instance instead (``/tokenize``,
``/kv/keys``), which answers on its engine thread, behind the step it is
computing: the way to measure what that costs. A body the front cannot tokenize (a chat template that refuses its
messages, a prompt that is neither text nor token ids) is routed by load
alone, and the instance answers it, its error included.

Each hand-over's keys on the transfers' store (which the front hosts) are
deleted by the sides that read them last; what a side that died, or a
pull that never came, leaves there is swept by the front once the lease's
deadline has passed (``lease_s`` after the hand-over ended, plus
:data:`SWEEP_GRACE_S`): no key outlives its transfer by more than that.

A non-streaming request counts as prefill work until it ends: the front
sees its first token only in a stream. Every request ends forwarded
(with the instance's own answer, an error included) or failed at the
front (a body that is no JSON object, an instance that did not answer, a
client that went away), counted in ``/kv/stats``, with the time the front
took to route each request (``route_ms``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from attrs import define, field
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sagellm_core.config import Settings
from sagellm_core.counters import Counters
from sagellm_core.drivers.router import Router
from sagellm_core.errors import SagellmError
from sagellm_core.ledger import BlockLedger
from sagellm_core.plugin_host import PluginHost
from sagellm_core.registry import GROUPS
from sagellm_core.types import InstanceLoad, KVHints, Request

from .clusterfile import link_name
from .index import KVIndex
from .transports import store_key

#: Seconds between the background polls of every instance's KV events.
POLL_INTERVAL_S = 0.05
#: Seconds a forwarded request may take in all.
FORWARD_TIMEOUT_S = 600.0
#: Seconds an idle connection to an instance is kept for reuse: below
#: uvicorn's 5 s keep-alive, after which the instance closes it (a request
#: sent on a connection as the instance closes it fails unanswered).
KEEPALIVE_S = 2.0
#: The messages of the latest requests failed at the front, kept for ``/kv/stats``.
ERRORS_KEPT = 20
#: The routing times kept for ``/kv/stats`` (the latest ones).
ROUTE_TIMES_KEPT = 10_000
#: The header an instance reads a request's tenant from (the server's).
TENANT_HEADER = "x-sagellm-tenant"
#: Seconds past a lease's deadline before the front sweeps what its
#: transfer left on the store: the prefill side's poll of a lease it ends.
SWEEP_GRACE_S = 2.0


def transfer_keys(link: str, request_id: str) -> tuple[str, str, str]:
    """The store keys of one transfer (:mod:`.transports`): its lease's,
    its leased block ids' (in-place), and its answers' prefix (gloo)."""
    return (
        store_key(link, f"lease/{request_id}"),
        store_key(link, f"blocks/{request_id}"),
        store_key(link, f"answer/{request_id}/"),
    )


def sweep(store: Any, link: str, request_id: str) -> int:
    """Delete what one transfer left on ``store``; how many keys."""
    lease, blocks, answers = transfer_keys(link, request_id)
    left = [k for k in store.list_keys() if k in (lease, blocks) or k.startswith(answers)]
    for key in left:
        store.delete_key(key)
    return len(left)


class PromptKeys:
    """A prompt's token ids and block keys as an instance computes them:
    ``tokenizer`` is the instances' (a Hugging Face tokenizer: ``encode``,
    ``apply_chat_template``), and the keys are the ``[prefix_cache]``
    plugin of ``settings`` (an instance's config) answering the core's
    ``sagellm_block_keys`` hook, through a plugin host that loads that
    plugin alone. Its cache stays empty, so each key is the plugin's chain
    over the prompt's content (and namespace: tenant, ``cache_salt``)."""

    def __init__(self, tokenizer: Any, settings: Settings):
        self.tokenizer = tokenizer
        self.block_size = settings.block_size
        others = [section for section in GROUPS if section != "prefix_cache"]
        self.host = PluginHost(
            settings, BlockLedger(settings.num_blocks), Counters(), hook_timing=False, engine_owns=others
        )

    @classmethod
    def of_instance(cls, settings: Settings) -> PromptKeys:
        """For the instances of ``settings`` (a torch engine's config): its
        model's tokenizer, loaded as the engine loads it (no weights)."""
        from sagellm_plugin_torch import models

        return cls(models.load_tokenizer(settings.engine.params.get("model", models.DEFAULT_MODEL)), settings)

    def token_ids(self, body: dict[str, Any], chat: bool) -> list[int] | None:
        """The prompt's ids as the instance's ``/v1/completions`` or
        ``/v1/chat/completions`` encodes them; ``None`` for a body it would
        refuse (the instance answers it)."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return None
            try:
                from sagellm_plugin_server.protocol import ChatMessage

                parsed = [ChatMessage.model_validate(m).for_template() for m in messages]
                ids = self.tokenizer.apply_chat_template(parsed, add_generation_prompt=True, tokenize=True)
            except Exception:  # noqa: BLE001 - refused messages, or a template that refuses them
                return None
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, list) and all(type(t) is int and 0 <= t < 1 << 63 for t in prompt):
            return prompt
        return None

    def keys(self, request: Request) -> list[int]:
        """The block keys of ``request``'s full prompt blocks."""
        full = request.num_prompt_tokens // self.block_size
        return list(self.host.block_keys(request, 0, full)) if full else []


@define
class Member:
    """An instance as the front counts it."""

    instance_id: str
    role: str
    url: str
    #: The instance's process.
    pid: int
    prefill_tokens: int = 0
    decode_requests: int = 0
    decode_tokens: int = 0
    #: The number of the next KV event batch to ask for.
    next_batch: int = 0
    routed: int = 0
    failed: int = 0
    lock: asyncio.Lock = field(factory=asyncio.Lock)

    def load(self, index: KVIndex, keys: Sequence[int]) -> InstanceLoad:
        cached, lower = index.lookup(self.instance_id, keys) if keys else (0, 0)
        return InstanceLoad(
            self.instance_id, self.role, self.prefill_tokens, self.decode_requests, self.decode_tokens, cached, lower
        )


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "code": status}}, status_code=status)


class Front:
    """The routing and forwarding behind :func:`build_front`'s routes."""

    def __init__(
        self,
        members: Sequence[Member],
        router: Router,
        keys: PromptKeys,
        pull_timeout_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        ask_instances: bool = False,
        store: Any = None,
        lease_s: float = 30.0,
    ):
        """``keys``: the prompts' token ids and block keys, computed here
        (asked of an instance with ``ask_instances``); ``transport``: how
        the front reaches the instances (httpx's own by default);
        ``store``: the transfers' store (a ``TCPStore``), swept of what
        each transfer left ``lease_s`` + :data:`SWEEP_GRACE_S` after it."""
        self.members = list(members)
        self.router = router
        self.keys = keys
        self.ask_instances = ask_instances
        #: Prompts whose ids and keys an instance gave (``ask_instances``).
        self.keys_asked = 0
        #: Seconds each of the latest requests took to route (its keys included).
        self.route_s: deque[float] = deque(maxlen=ROUTE_TIMES_KEPT)
        self.pull_timeout_s = pull_timeout_s
        #: Pulls by how they ended.
        self.transfers: dict[str, int] = {"done": 0, "failed": 0, "expired": 0}
        self.index = KVIndex([m.instance_id for m in members])
        self.by_id = {m.instance_id: m for m in members}
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(FORWARD_TIMEOUT_S, connect=5.0),
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S),
            transport=transport,
        )
        #: The latest messages of requests failed at the front with a 502.
        self.errors: deque[str] = deque(maxlen=ERRORS_KEPT)
        #: Requests answered by an instance (its error included), and failed at the front.
        self.counts = {"forwarded": 0, "failed": 0}
        self._background: set[asyncio.Task[None]] = set()
        self.store = store
        self.lease_s = lease_s
        #: Transfers to sweep: (when, link, request id), in order of when.
        self.sweeps: deque[tuple[float, str, str]] = deque()
        #: Keys the sweeps deleted (left by a side that died, or a pull that never came).
        self.swept = 0

    async def poll(self, member: Member) -> None:
        """Apply ``member``'s KV event batches published since the last poll."""
        async with member.lock:  # one poll at a time per instance: batches arrive in order
            answer = (await self.client.get(f"{member.url}/kv/events", params={"start": member.next_batch})).json()
            batches = answer["batches"]
            if batches is None:  # no longer kept: the index starts the entry again
                self.index.replay(member.instance_id, None)
            else:
                for seq, payload in batches:
                    self.index.receive(member.instance_id, seq, bytes.fromhex(payload))
            member.next_batch = answer["next"]

    async def quiet_poll(self, member: Member) -> None:
        """:meth:`poll`, an instance that does not answer or answers
        nonsense left for the next poll (the background task must live on)."""
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            await self.poll(member)

    def poll_soon(self, member: Member) -> None:
        """Poll ``member`` now, in the background: a request there ended,
        and the next one routed should see the blocks it left."""
        task = asyncio.create_task(self.quiet_poll(member))
        self._background.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._background.discard)

    async def poll_forever(self) -> None:
        while True:
            # Every instance at once: one busy with a long step delays only its own events.
            await asyncio.gather(*(self.quiet_poll(member) for member in self.members))
            if self.sweeps:
                with contextlib.suppress(Exception):  # a store that fails now: the next poll sweeps
                    await self.sweep_due(time.monotonic())
            await asyncio.sleep(POLL_INTERVAL_S)

    async def route(
        self, body: dict[str, Any], chat: bool, tenant: str = "default"
    ) -> tuple[Request, Member, Member | None, int]:
        """The request as the router sees it, the member that computes its
        prompt, the decode member its KV goes to (``None``: colocated), and
        the prompt tokens not in the first member's device cache (by the
        index): the prefill work it queues there."""
        started = time.perf_counter()
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        if not self.ask_instances:
            ids = self.keys.token_ids(body, chat) or []
            keys = self.keys.keys(Request("keys", ids, 1, tenant=tenant, cache_salt=salt)) if ids else []
        else:
            if chat:
                asked = {"messages": body.get("messages"), "add_generation_prompt": True}
            else:
                asked = {"prompt": body.get("prompt")}
            ids, keys = await self.prompt_keys({**asked, "model": body.get("model")}, _salt(body))
        cache_key = body.get("prompt_cache_key")
        # A key the instance will refuse (empty, too long) is its to answer: routing ignores it.
        valid = isinstance(cache_key, str) and 0 < len(cache_key) <= 256
        hints = KVHints(cache_key=cache_key) if valid else None
        # Only routing reads it (the instance checks the body): anything but a count is the default.
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            max_tokens = 16
        request = Request(uuid.uuid4().hex, ids, max_tokens, kv_hints=hints)
        loads = [m.load(self.index, keys) for m in self.members]
        decision = self.router.route(request, loads, time.monotonic())
        decode = decision.decode_instance_id
        cached = next(load.cached_blocks for load in loads if load.instance_id == decision.instance_id)
        # At least one prompt token is computed wherever it goes (the cache leaves one).
        work = max(request.num_prompt_tokens - cached * self.keys.block_size, min(request.num_prompt_tokens, 1))
        self.route_s.append(time.perf_counter() - started)
        member = self.by_id[decision.instance_id]
        return request, member, None if decode is None else self.by_id[decode], work

    async def prompt_keys(self, asked: dict[str, Any], salt: dict[str, Any]) -> tuple[list[int], list[int]]:
        """The prompt's token ids and block keys, from the first member that
        answers (every member has the same model and prefix cache)."""
        failure: httpx.HTTPError | None = None
        for member in self.members:
            try:
                tokenized = await self.client.post(f"{member.url}/tokenize", json=asked)
                if tokenized.status_code != 200:
                    raise _Answered(tokenized)
                ids = tokenized.json()["tokens"]
                keys = await self.client.post(f"{member.url}/kv/keys", json={"token_ids": ids, **salt})
                if keys.status_code != 200:
                    raise _Answered(keys)
                self.keys_asked += 1
                return ids, keys.json()["keys"]
            except httpx.HTTPError as exc:
                failure = exc
        assert failure is not None
        raise failure

    async def hand_over(self, prefill: Member, decode: Member, request: Request) -> str:
        """Prefill ``request`` on ``prefill`` and have ``decode`` pull its
        blocks; the pull's end (``done``, ``failed``, ``expired``), counted.
        Whatever it is, the decode member then serves the request: what was
        not pulled, it computes."""
        ids = list(request.prompt_token_ids)
        asked = {
            "request_id": request.request_id,
            "token_ids": ids,
            "link": link_name(prefill.instance_id, decode.instance_id),
        }
        prefill.prefill_tokens += len(ids)
        try:
            offered = await self.client.post(f"{prefill.url}/kv/prefill", json=asked)
            if offered.status_code != 200:
                status = "failed"
            else:
                pulled = await self.client.post(
                    f"{decode.url}/kv/pull", json={**asked, "timeout_s": self.pull_timeout_s}
                )
                status = pulled.json()["status"] if pulled.status_code == 200 else "failed"
        except (httpx.HTTPError, ValueError, KeyError):  # no answer, or not one: the decode side computes
            status = "failed"
        finally:
            prefill.prefill_tokens -= len(ids)
            if self.store is not None:
                due = time.monotonic() + self.lease_s + SWEEP_GRACE_S
                self.sweeps.append((due, asked["link"], request.request_id))
        self.transfers[status] = self.transfers.get(status, 0) + 1
        return status

    async def sweep_due(self, now: float) -> None:
        """Sweep the transfers whose leases' deadlines have passed."""
        while self.sweeps and self.sweeps[0][0] <= now:
            _, link, rid = self.sweeps.popleft()
            self.swept += await asyncio.to_thread(sweep, self.store, link, rid)

    async def forward(self, http: HTTPRequest, path: str, chat: bool) -> Response:
        """Route the request and relay the chosen instance's answer."""
        raw = await http.body()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            self.counts["failed"] += 1
            return _error(400, f"the request body: {exc}")
        tenant = http.headers.get(TENANT_HEADER) or body.get("user")
        try:
            request, member, decode, work = await self.route(
                body, chat, tenant if isinstance(tenant, str) else "default"
            )
        except _Answered as answered:  # the instance refused the prompt: its own error
            self.counts["failed"] += 1
            return Response(answered.response.content, answered.response.status_code, media_type="application/json")
        except (httpx.HTTPError, SagellmError) as exc:
            self.counts["failed"] += 1
            self.errors.append(f"routing failed: {type(exc).__name__}: {exc}")
            return _error(502, self.errors[-1])
        member.routed += 1
        prompt_tokens = request.num_prompt_tokens
        if decode is not None:
            await self.hand_over(member, decode, request)
            member, work = decode, prompt_tokens
        member.prefill_tokens += work
        headers = {k: v for k, v in http.headers.items() if k.lower() in ("authorization", "x-request-id")}
        upstream = self.client.build_request(
            "POST", f"{member.url}{path}", content=raw, headers={**headers, "content-type": "application/json"}
        )
        try:
            answer = await self.client.send(upstream, stream=bool(body.get("stream")))
        except httpx.HTTPError as exc:
            member.prefill_tokens -= work
            return self.failed(member, exc)
        except BaseException:  # the client went away (the handler is cancelled): its load ends here too
            member.prefill_tokens -= work
            self.counts["failed"] += 1
            raise
        if not body.get("stream"):
            member.prefill_tokens -= work
            self.counts["forwarded"] += 1
            self.poll_soon(member)
            return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
        kind = answer.headers.get("content-type", "text/event-stream")
        return StreamingResponse(self.relay(member, answer, work, prompt_tokens), answer.status_code, media_type=kind)

    async def relay(
        self, member: Member, upstream: httpx.Response, work: int, prompt_tokens: int
    ) -> AsyncIterator[bytes]:
        """A stream's chunks as they come; its first moves the request from
        the member's prefill load (``work`` tokens) to its decode load (its
        ``prompt_tokens`` in KV)."""
        decoding, tail = False, b""
        try:
            async for chunk in upstream.aiter_bytes():  # decoded: the relay sends no content-encoding
                if not decoding:
                    decoding = True
                    member.prefill_tokens -= work
                    member.decode_requests += 1
                    member.decode_tokens += prompt_tokens
                tail = (tail + chunk)[-32:]
                yield chunk
            self.counts["forwarded"] += 1
        except httpx.HTTPError:
            self.counts["failed"] += 1
            member.failed += 1
        except BaseException:
            # The client went away: after the stream's end ([DONE], which a
            # client may close on before the instance's own end reaches
            # here) the answer was whole; before it, closing the upstream
            # aborts the request there.
            self.counts["forwarded" if tail.rstrip().endswith(b"data: [DONE]") else "failed"] += 1
            raise
        finally:
            await upstream.aclose()
            if decoding:
                member.decode_requests -= 1
                member.decode_tokens -= prompt_tokens
            else:
                member.prefill_tokens -= work
            self.poll_soon(member)

    def failed(self, member: Member, exc: httpx.HTTPError) -> JSONResponse:
        self.counts["failed"] += 1
        member.failed += 1
        self.errors.append(f"instance {member.instance_id} did not answer: {type(exc).__name__}: {exc}")
        return _error(502, self.errors[-1])

    async def health(self) -> list[str]:
        """The members that do not answer ``/health`` with 200."""
        down = []
        for member in self.members:
            try:
                ok = (await self.client.get(f"{member.url}/health", timeout=5)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(member.instance_id)
        return down

    async def stats(self, check_invariants: bool) -> dict[str, Any]:
        instances = {}
        for member in self.members:
            counted = {"role": member.role, "pid": member.pid, "routed": member.routed, "failed": member.failed}
            try:
                params = {"check_invariants": check_invariants}
                answer = (await self.client.get(f"{member.url}/kv/stats", params=params)).json()
                if member.role != "colocated":
                    answer["transfers"] = (await self.client.get(f"{member.url}/kv/transfers")).json()
            except httpx.HTTPError as exc:
                answer = {"error": f"did not answer: {type(exc).__name__}: {exc}"}
            instances[member.instance_id] = {**answer, **counted}
        index = self.index
        return {
            "router": self.router.plugin_name,
            "requests": dict(self.counts),
            "transfers": dict(self.transfers),
            "index": {"exact": index.exact, "applied": index.applied, "gaps": index.gaps, "resets": index.resets},
            "route_ms": self.route_times(),
            "store": await asyncio.to_thread(self.store_figures),
            "keys_asked": self.keys_asked,
            "errors": list(self.errors),
            "instances": instances,
        }

    def store_figures(self) -> dict[str, int]:
        """The transfers' store: its keys of transfers (leases, block ids,
        answers), those waiting for a sweep, and the keys swept so far."""
        if self.store is None:
            return {}
        held = sum(1 for k in self.store.list_keys() if any(f"/{w}/" in k for w in ("lease", "blocks", "answer")))
        return {"transfer_keys": held, "to_sweep": len(self.sweeps), "swept": self.swept}

    def route_times(self) -> dict[str, float | int]:
        """The latest requests' routing times, in milliseconds: how many, median, 99th percentile, longest."""
        times = sorted(self.route_s)
        if not times:
            return {"count": 0}
        n = len(times)
        return {
            "count": n,
            "p50": 1e3 * times[(n - 1) // 2],
            "p99": 1e3 * times[min(n - 1, int(0.99 * n))],
            "max": 1e3 * times[-1],
        }


def build_front(
    members: Sequence[Member],
    router: Router,
    keys: PromptKeys,
    pull_timeout_s: float = 10.0,
    transport: httpx.AsyncBaseTransport | None = None,
    ask_instances: bool = False,
    store: Any = None,
    lease_s: float = 30.0,
) -> FastAPI:
    """The front's app over ``members`` (instances that answer ``/health``),
    computing the prompts' keys with ``keys``; ``app.state.front`` is its
    :class:`Front`."""
    front = Front(members, router, keys, pull_timeout_s, transport, ask_instances, store, lease_s)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(front.poll_forever())
        try:
            yield
        finally:
            task.cancel()
            await front.client.aclose()

    app = FastAPI(title="sagellm cluster", lifespan=lifespan)
    app.state.front = front

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest) -> Response:
        return await front.forward(http, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest) -> Response:
        return await front.forward(http, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        answer = await front.client.get(f"{members[0].url}/v1/models")
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> JSONResponse:
        down = await front.health()
        if down:
            return _error(503, f"instances not healthy: {', '.join(down)}")
        return JSONResponse({"status": "ok", "instances": len(members)})

    @app.get("/kv/stats")
    async def stats(check_invariants: bool = False) -> dict[str, Any]:
        """Each instance's ``/kv/stats`` with what the front routed there,
        the front's counts and its index."""
        return await front.stats(check_invariants)

    return app


class _Answered(Exception):
    """An instance answered the front's own call with an error: the client gets it as it is."""

    def __init__(self, response: httpx.Response):
        super().__init__(response.text)
        self.response = response


def _salt(body: dict[str, Any]) -> dict[str, Any]:
    salt = body.get("cache_salt")
    return {"cache_salt": salt} if isinstance(salt, str) else {}
