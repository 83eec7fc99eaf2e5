"""``response_format`` through llguidance (the ``[structured]`` extra): a
JSON schema, or any JSON object, compiled into a grammar that masks the
tokens a request may produce next.

Each choice gets its own matcher, a
:class:`~sagellm_plugin_torch.sampling.TokenConstraint`: the sampler asks it
for the allowed-token bitmask before each token and tells it the token
chosen, on the engine's thread. Once the grammar is complete only the
end-of-sequence token is allowed, so the request ends with ``stop``.
Output is compact JSON (no free whitespace between tokens): a model cannot
wander in whitespace until ``max_tokens``.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from .protocol import ResponseFormat

EXTRA = "pip install 'sagellm-plugin-server[structured]'"


class StructuredOutputError(ValueError):
    """A ``response_format`` this server cannot serve: one line, naming why."""


class Grammars:
    """Compiles ``response_format``s for one tokenizer; the llguidance
    tokenizer is built on first use (a fraction of a second for a
    50,000-token vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltokenizer: Any = None

    def constraints(self, response_format: ResponseFormat, count: int) -> list[GrammarConstraint]:
        """A constraint per choice; raises StructuredOutputError."""
        try:
            import llguidance
            import llguidance.hf
        except ImportError:
            raise StructuredOutputError(
                f"response_format {response_format.type!r} needs llguidance, which is not installed: {EXTRA}"
            ) from None
        if self._lltokenizer is None:
            try:
                self._lltokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
            except Exception as exc:  # noqa: BLE001 - a tokenizer llguidance cannot read (a word-level one)
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise StructuredOutputError(
                    f"response_format: llguidance cannot read this model's tokenizer: {first}"
                ) from None
        if response_format.json_schema is not None:
            schema: dict[str, Any] = response_format.json_schema.schema_
            where = "response_format.json_schema.schema"
        else:
            schema, where = {"type": "object"}, "response_format"
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": False}
            )
        except ValueError as exc:
            raise StructuredOutputError(f"{where}: {exc}") from None
        problem = llguidance.LLMatcher.validate_grammar(grammar, self._lltokenizer)
        if problem:
            raise StructuredOutputError(f"{where}: {problem.splitlines()[0]}")
        return [GrammarConstraint(llguidance.LLMatcher(self._lltokenizer, grammar, log_level=0)) for _ in range(count)]


class GrammarConstraint:
    """One choice's llguidance matcher as the sampler's token constraint."""

    def __init__(self, matcher):
        self.matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept(self, token_id: int) -> None:
        self.matcher.consume_token(token_id)
