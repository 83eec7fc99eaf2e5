"""The OpenAI request bodies the server accepts (and vLLM's tokenizer
endpoints'), and its error bodies.

Unknown fields are refused (400), as OpenAI's API does, rather than ignored:
a client that sets ``tools`` or ``logit_bias`` learns that this server does
not do it instead of getting an answer computed without it.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from sagellm_plugin_torch.sampling import MAX_LOGPROBS


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


class KVHintsBody(BaseModel):
    """sagellm's ``kv_hints`` extension: the fields of
    :class:`sagellm_core.types.KVHints`, whose checks are the ones applied
    (``hints.resolve``); ``pin`` and ``unpin`` may also be ``true``, the
    whole prompt."""

    model_config = ConfigDict(extra="forbid")
    retain_s: Any = 0.0
    pin: Any = 0
    unpin: Any = 0
    release: Any = False
    prefetch: Any = False
    cache_key: Any = None

    def given(self) -> dict[str, Any]:
        """The fields the client set."""
        return {name: getattr(self, name) for name in self.model_fields_set}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    #: vLLM's extensions: ``top_k`` 0 or -1 keeps every token, ``min_p`` 0 drops none.
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    #: vLLM's and transformers' extension: 1 is none.
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    #: OpenAI's: the request's group, as ``kv_hints.cache_key``.
    prompt_cache_key: str | None = None
    kv_hints: KVHintsBody | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    #: OpenAI's default for completions.
    max_tokens: int | None = Field(default=16, ge=1)
    #: The chosen token's log-probability and this many top ones per token.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    #: The prompt's text before the completion's.
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    #: Text, or a list of content parts of which only text parts are taken
    #: (joined by newlines, as vLLM joins them for text-only templates).
    content: str
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(
                    f"part {i} is of type {kind!r}: this server takes text parts only"
                    if isinstance(part, dict)
                    else f"part {i} is not an object"
                )
            unknown = sorted(set(part) - {"type", "text"})
            if unknown or not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: a text part is {{'type': 'text', 'text': str}}, got keys {sorted(part)}")
            texts.append(part["text"])
        return "\n".join(texts)

    def for_template(self) -> dict[str, str]:
        """The message as the chat template reads it (``developer`` is the
        newer name of ``system``)."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.content, **({"name": self.name} if self.name is not None else {})}


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs = true")
        return top


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a ``prompt``, or ``messages`` through the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def error(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> JSONResponse:
    """OpenAI's error body."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)
