"""The OpenAI request bodies the server accepts, and its error bodies.

Unknown fields are refused (400), as OpenAI's API does, rather than ignored:
a client that sets ``best_of`` or ``logprobs`` learns that this server does
not do it instead of getting an answer computed without it.
"""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    #: OpenAI's default for completions.
    max_tokens: int | None = Field(default=16, ge=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def error(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> JSONResponse:
    """OpenAI's error body."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)
