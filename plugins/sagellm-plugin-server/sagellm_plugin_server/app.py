"""The HTTP face of the torch engine: OpenAI's completions and chat
completions (streamed as server-sent events, or whole; ``n`` choices,
log-probabilities, penalties, ``response_format``), vLLM's ``/tokenize`` and
``/detokenize``, models, health, Prometheus metrics, and sagellm's KV stats."""

from __future__ import annotations

import contextlib
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from sagellm_plugin_torch.engine import StepOutput
from sagellm_plugin_torch.sampling import SamplingParams, TokenLogprobs
from starlette.exceptions import HTTPException as StarletteHTTPException

from sagellm_core.errors import RequestError
from sagellm_core.types import Request

from .engine_thread import EngineThread, QueueFull
from .hints import HintError, PinLedger, resolve
from .metrics import ServerMetrics, kv_stats
from .protocol import ChatMessage, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, error
from .structured import Grammars, StructuredOutputError

#: The header a tenant can be named by (else the body's ``user``).
TENANT_HEADER = "x-sagellm-tenant"


class Detokenizer:
    """Generated ids to text, incrementally: a delta is held back while the
    text ends inside a multi-byte character; stop strings end the text."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""
        self.stopped = False

    def add(self, token_id: int | None) -> str:
        if token_id is not None:
            self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.stop:
            at = text.find(stop)
            if at >= 0:
                text, self.stopped = text[:at], True
        if text.endswith("\ufffd") and not self.stopped:
            return ""
        self.text = text
        delta, self.sent = text[self.sent :], len(text)
        return delta


class Choice:
    """One of a request's ``n`` choices, as its tokens arrive."""

    def __init__(self, index: int, request_id: str, detokenizer: Detokenizer):
        self.index = index
        self.request_id = request_id
        self.detok = detokenizer
        #: ``(token id, offset of its text, its log-probabilities)`` per token, where asked.
        self.logprobs: list[tuple[int, int, TokenLogprobs]] = []
        #: How many of :attr:`logprobs` a stream has sent.
        self.logprobs_sent = 0
        self.finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, out: StepOutput) -> str:
        """Take the engine's output; return the new text."""
        offset = len(self.detok.text)
        delta = self.detok.add(out.token_id)
        if out.token_id is not None and out.logprobs is not None:
            self.logprobs.append((out.token_id, offset, out.logprobs))
        if self.detok.stopped:
            self.finish_reason = "stop"
        elif out.finished:
            self.finish_reason = out.finish_reason
        return delta

    def unsent_logprobs(self) -> list[tuple[int, int, TokenLogprobs]]:
        entries, self.logprobs_sent = self.logprobs[self.logprobs_sent :], len(self.logprobs)
        return entries


def build_app(engine: EngineThread, model_name: str, metrics: ServerMetrics, pins: PinLedger) -> FastAPI:
    core = engine.core
    tokenizer = core.tokenizer
    vocab_size = core.runner.vocab_size
    grammars = Grammars(tokenizer, vocab_size)
    app = FastAPI(title="sagellm", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": str(exc), "loc": ()}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "extra_forbidden":
            message = "this server does not support this field"
        else:
            message = str(first.get("msg")).removeprefix("Value error, ")
        return error(400, f"{where}: {message}" if where else message, param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException) -> JSONResponse:
        return error(
            exc.status_code,
            str(exc.detail),
            kind="not_found_error" if exc.status_code == 404 else "invalid_request_error",
        )

    def tenant_of(http: HTTPRequest, user: str | None) -> str:
        return http.headers.get(TENANT_HEADER) or user or "default"

    def check_model(name: str | None) -> JSONResponse | None:
        if name is not None and name != model_name:
            return error(
                404,
                f"The model `{name}` does not exist; this server serves `{model_name}`.",
                kind="not_found_error",
                param="model",
                code="model_not_found",
            )
        return None

    def check_ids(ids: list[int], param: str) -> JSONResponse | None:
        if any(not 0 <= t < vocab_size for t in ids):
            return error(400, f"token ids must lie in [0, {vocab_size})", param=param)
        return None

    def chat_ids(messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """The messages through the model's chat template; ValueError if it refuses them."""
        try:
            ids = tokenizer.apply_chat_template(
                [m.for_template() for m in messages], add_generation_prompt=add_generation_prompt, tokenize=True
            )
        except Exception as exc:  # noqa: BLE001 - a template that refuses these messages
            raise ValueError(f"the chat template refused the messages: {str(exc).splitlines()[0]}") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    @functools.lru_cache(maxsize=1 << 17)
    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    async def serve(
        body: CompletionRequest | ChatRequest,
        http: HTTPRequest,
        prompt: list[int],
        max_tokens: int | None,
        *,
        chat: bool,
        logprobs: int | None,
        echo: str = "",
    ):
        if not prompt:
            return error(400, "the prompt is empty", param="prompt" if not chat else "messages")
        if body.n > engine.max_waiting:
            return error(400, f"n = {body.n}: more than [server] max_waiting ({engine.max_waiting})", param="n")
        try:
            hints = resolve(
                body.kv_hints.given() if body.kv_hints else {}, body.prompt_cache_key, http.headers, len(prompt)
            )
        except HintError as exc:
            return error(400, str(exc), param=exc.param)
        prefetch = hints is not None and hints.prefetch
        if prefetch:
            # The runtime loads a store's blocks onto the device only into an
            # admitted request's blocks, and caches them once it has computed
            # a token: a prefetch is the prompt's stores' prefetch started at
            # once, then a one-token admission that loads them, whose token
            # is not an answer.
            for name, asked in (("n", body.n > 1), ("stream", body.stream)):
                if asked:
                    return error(400, f"kv_hints.prefetch answers no text: {name} is not taken with it", param=name)
            max_tokens = 1
        if max_tokens is None:
            max_tokens = core.max_model_len - len(prompt)
            if max_tokens < 1:
                return error(
                    400,
                    f"the prompt has {len(prompt)} tokens; max_model_len is {core.max_model_len}",
                    param="messages" if chat else "prompt",
                )
        constraints: list[Any] = [None] * body.n
        if body.response_format is not None and body.response_format.type != "text":
            try:
                constraints = list(grammars.constraints(body.response_format, body.n))
            except StructuredOutputError as exc:
                return error(400, str(exc), param="response_format")
        kind = "chatcmpl" if chat else "cmpl"
        rid = f"{kind}-{uuid.uuid4().hex}"
        tenant = tenant_of(http, body.user)
        try:
            undo_pin = pins.take(tenant, prompt, hints) if hints is not None else None
        except HintError as exc:
            return error(400, str(exc), param=exc.param)
        session = hints.cache_key if hints is not None else None
        group = []
        for i in range(body.n):
            request = Request(
                rid if body.n == 1 else f"{rid}-{i}",
                prompt,
                max_tokens,
                tenant=tenant,
                session_id=session,
                kv_hints=hints,
            )
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(body.top_k, 0),
                min_p=body.min_p,
                seed=None if body.seed is None else body.seed + i,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logprobs=logprobs,
                constraint=constraints[i],
            )
            group.append((request, sampling))
        try:
            outputs = await engine.submit(group, prefetch=prefetch)
        except (RequestError, QueueFull) as exc:
            if undo_pin is not None:
                undo_pin()
            if isinstance(exc, QueueFull):
                return error(429, f"server busy: {exc}", kind="rate_limit_error")
            return error(400, str(exc), param="max_tokens" if "output tokens" in str(exc) else "prompt")
        metrics.params_n.observe(body.n)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        choices = [Choice(i, request.request_id, Detokenizer(tokenizer, stops)) for i, (request, _) in enumerate(group)]
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                stream(rid, created, outputs, choices, len(prompt), chat, include_usage, echo),
                media_type="text/event-stream",
            )
        async with contextlib.aclosing(progress(outputs, choices)) as events:
            async for _ in events:
                pass
        answers = []
        for c in choices:
            if prefetch:  # the token it sampled is not an answer
                c.detok, c.logprobs = Detokenizer(tokenizer, []), []
            answer: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason}
            answer["logprobs"] = format_logprobs(c.logprobs, chat, len(echo)) if logprobs is not None else None
            if chat:
                answer["message"] = {"role": "assistant", "content": c.detok.text}
            else:
                answer["text"] = echo + c.detok.text
            answers.append(answer)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model_name,
            "choices": answers,
            "usage": usage(len(prompt), sum(len(c.detok.ids) for c in choices)),
        }

    async def progress(outputs, choices: list[Choice]) -> AsyncIterator[tuple[Choice, str]]:
        """Each output of the group's requests as ``(choice, new text)``,
        until every choice is done; a choice whose stop string appears is
        aborted, and so is every unfinished one if the caller goes away
        (closes this generator)."""
        by_id = {c.request_id: c for c in choices}
        try:
            while not all(c.done for c in choices):
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                choice = by_id[out.request_id]
                if choice.done:
                    continue  # queued before its stop string's abort
                delta = choice.add(out)
                if choice.done and not out.finished:
                    engine.abort_nowait(choice.request_id)
                yield choice, delta
        finally:
            for c in choices:
                if not c.done:  # the client went away: free its blocks now
                    engine.abort_nowait(c.request_id)

    def format_logprobs(entries: list[tuple[int, int, TokenLogprobs]], chat: bool, base: int) -> dict[str, Any]:
        """OpenAI's log-probabilities of ``entries``: chat's ``content``
        list, or the completions API's four parallel lists (offsets from
        ``base``, the echoed prompt's length)."""
        if chat:

            def one(token_id: int, logprob: float) -> dict[str, Any]:
                text = token_text(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

            content = [
                {**one(t, lp.logprob), "top_logprobs": [one(top, v) for top, v in lp.top]} for t, _, lp in entries
            ]
            return {"content": content, "refusal": None}
        tops = []
        for t, _, lp in entries:
            top = {token_text(top_id): v for top_id, v in lp.top}
            top.setdefault(token_text(t), lp.logprob)
            tops.append(top)
        return {
            "tokens": [token_text(t) for t, _, _ in entries],
            "token_logprobs": [lp.logprob for _, _, lp in entries],
            "top_logprobs": tops,
            "text_offset": [base + offset for _, offset, _ in entries],
        }

    async def stream(rid, created, outputs, choices, prompt_tokens, chat, include_usage, echo) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: Choice, delta: str | None, first: bool = False) -> str:
            entries = choice.unsent_logprobs()
            logprobs = format_logprobs(entries, chat, len(echo)) if entries else None
            reason = None if first else choice.finish_reason
            body: dict[str, Any] = {"index": choice.index, "finish_reason": reason, "logprobs": logprobs}
            if chat:
                body["delta"] = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta else {})
            else:
                body["text"] = delta or ""
            data = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [body]}
            return f"data: {json.dumps(data)}\n\n"

        for c in choices:
            if chat:
                yield chunk(c, None, first=True)
            elif echo:
                yield chunk(c, echo, first=True)
        async with contextlib.aclosing(progress(outputs, choices)) as events:
            async for choice, delta in events:
                if delta or choice.done:
                    yield chunk(choice, delta)
        if include_usage:
            data = {
                "id": rid,
                "object": kind,
                "created": created,
                "model": model_name,
                "choices": [],
                "usage": usage(prompt_tokens, sum(len(c.detok.ids) for c in choices)),
            }
            yield f"data: {json.dumps(data)}\n\n"
        yield "data: [DONE]\n\n"

    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        bad = check_model(body.model)
        if bad:
            return bad
        prompt = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        bad = check_ids(prompt, "prompt")
        if bad:
            return bad
        if body.echo and body.logprobs is not None:
            return error(
                400,
                "echo with logprobs needs the prompt's log-probabilities, which this server does not compute",
                param="echo",
            )
        echo = "" if not body.echo else body.prompt if isinstance(body.prompt, str) else tokenizer.decode(prompt)
        return await serve(body, http, prompt, body.max_tokens, chat=False, logprobs=body.logprobs, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HTTPRequest):
        bad = check_model(body.model)
        if bad:
            return bad
        try:
            prompt = chat_ids(body.messages)
        except ValueError as exc:
            return error(400, str(exc), param="messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await serve(
            body, http, prompt, body.max_completion_tokens or body.max_tokens, chat=True, logprobs=logprobs
        )

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's: a prompt as ``/v1/completions`` encodes it, or messages as
        ``/v1/chat/completions`` renders them."""
        bad = check_model(body.model)
        if bad:
            return bad
        if body.messages is not None:
            if body.add_special_tokens:
                return error(
                    400,
                    "add_special_tokens applies to a prompt; the chat template places messages' own",
                    param="add_special_tokens",
                )
            try:
                ids = chat_ids(body.messages, body.add_generation_prompt)
            except ValueError as exc:
                return error(400, str(exc), param="messages")
        else:
            assert body.prompt is not None
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        return {
            "count": len(ids),
            "max_model_len": core.max_model_len,
            "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        bad = check_model(body.model) or check_ids(body.tokens, "tokens")
        if bad:
            return bad
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "sagellm",
                    "max_model_len": core.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health():
        if engine.error is not None or not engine.alive:
            return error(503, f"engine stopped: {engine.error!r}", kind="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        snapshot = await engine.call(lambda: metrics.snapshot(core))
        return PlainTextResponse(metrics.render(snapshot), media_type="text/plain; version=0.0.4")

    @app.get("/kv/stats")
    async def stats(check_invariants: bool = False):
        """``?check_invariants=true`` also runs the runtime's block-accounting
        check (O(blocks), for tests and operators chasing a leak)."""

        def read() -> dict[str, Any]:
            result = kv_stats(core)
            if check_invariants:
                try:
                    core.rt.check_invariants()
                    result["invariants"] = "ok"
                except AssertionError as exc:
                    result["invariants"] = f"violated: {exc}"
            return result

        return await engine.call(read)

    @app.post("/kv/reset_prefix_cache")
    async def reset_prefix_cache():
        evicted = await engine.call(core.rt.reset_prefix_cache)
        return {"evicted_blocks": evicted}

    return app
