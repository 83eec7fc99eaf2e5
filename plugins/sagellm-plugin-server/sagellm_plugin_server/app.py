"""The HTTP face of the torch engine: OpenAI's completions and chat
completions (streamed as server-sent events, or whole), models, health,
Prometheus metrics, and sagellm's KV stats."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from sagellm_plugin_torch.engine import SamplingParams, StepOutput
from starlette.exceptions import HTTPException as StarletteHTTPException

from sagellm_core.errors import RequestError
from sagellm_core.types import Request

from .engine_thread import EngineThread, QueueFull
from .metrics import ServerMetrics, kv_stats
from .protocol import ChatRequest, CompletionRequest, error

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


def build_app(engine: EngineThread, model_name: str, metrics: ServerMetrics) -> FastAPI:
    core = engine.core
    tokenizer = core.tokenizer
    app = FastAPI(title="sagellm", docs_url=None, redoc_url=None)
    context_limit = min(core.max_model_len, core.rt.num_blocks * core.rt.block_size)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": str(exc), "loc": ()}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param=where or None)

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

    async def serve(body, http: HTTPRequest, prompt: list[int], max_tokens: int | None, chat: bool):
        if body.n != 1:
            return error(400, f"n = {body.n}: this server returns one choice (n = 1)", param="n")
        if not prompt:
            return error(400, "the prompt is empty", param="prompt" if not chat else "messages")
        if max_tokens is None:
            max_tokens = context_limit - len(prompt)
            if max_tokens < 1:
                return error(
                    400, f"the prompt has {len(prompt)} tokens; the context holds {context_limit}", param="messages"
                )
        kind = "chatcmpl" if chat else "cmpl"
        rid = f"{kind}-{uuid.uuid4().hex}"
        request = Request(rid, prompt, max_tokens, tenant=tenant_of(http, body.user))
        sampling = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed)
        try:
            outputs = await engine.submit(request, sampling)
        except RequestError as exc:
            return error(400, str(exc), param="max_tokens" if "output tokens" in str(exc) else "prompt")
        except QueueFull as exc:
            return error(429, f"server busy: {exc}", kind="rate_limit_error")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                stream(rid, created, outputs, stops, len(prompt), chat, include_usage), media_type="text/event-stream"
            )
        try:
            detok, reason = Detokenizer(tokenizer, stops), None
            async for out in results(rid, outputs):
                detok.add(out.token_id)
                if detok.stopped:
                    engine.abort_nowait(rid)
                    reason = "stop"
                    break
                reason = out.finish_reason
        except BaseException:
            engine.abort_nowait(rid)
            raise
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": detok.text}
        else:
            choice["text"] = detok.text
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model_name,
            "choices": [choice],
            "usage": usage(len(prompt), len(detok.ids)),
        }

    async def results(rid: str, outputs) -> AsyncIterator[StepOutput]:
        while True:
            out = await outputs.get()
            if isinstance(out, BaseException):
                raise out
            yield out
            if out.finished:
                return

    async def stream(rid, created, outputs, stops, prompt_tokens, chat, include_usage) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        detok = Detokenizer(tokenizer, stops)
        finished = False

        def chunk(delta: str | None, reason: str | None, first: bool = False) -> str:
            if chat:
                d: dict[str, Any] = (
                    {"role": "assistant", "content": ""} if first else ({"content": delta} if delta else {})
                )
                choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            body = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice]}
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                yield chunk(None, None, first=True)
            async for out in results(rid, outputs):
                delta = detok.add(out.token_id)
                if detok.stopped:
                    engine.abort_nowait(rid)
                    finished = True
                    yield chunk(delta, "stop")
                    break
                finished = out.finished
                if delta or finished:
                    yield chunk(delta, out.finish_reason if finished else None)
            if include_usage:
                body = {
                    "id": rid,
                    "object": kind,
                    "created": created,
                    "model": model_name,
                    "choices": [],
                    "usage": usage(prompt_tokens, len(detok.ids)),
                }
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away: free its blocks now
                engine.abort_nowait(rid)

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
        if any(not 0 <= t < core.runner.vocab_size for t in prompt):
            return error(400, f"prompt token ids must lie in [0, {core.runner.vocab_size})", param="prompt")
        return await serve(body, http, prompt, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HTTPRequest):
        bad = check_model(body.model)
        if bad:
            return bad
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001 - a template that refuses these messages
            return error(400, f"the chat template refused the messages: {str(exc).splitlines()[0]}", param="messages")
        prompt = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return await serve(body, http, prompt, body.max_completion_tokens or body.max_tokens, chat=True)

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
                    "max_model_len": context_limit,
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
