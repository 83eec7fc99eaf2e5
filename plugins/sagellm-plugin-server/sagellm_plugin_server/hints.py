"""Client KV hints at the API: the body's ``kv_hints`` (and OpenAI's
``prompt_cache_key``), the ``x-sagellm-*`` headers, and the per-tenant pin
budget.

A hint given twice (in the body and in a header, or as ``prompt_cache_key``
and ``kv_hints.cache_key``) must say the same, and a hint the server cannot
take is a 400 naming it: never dropped. The pin budget is the API's: the
blocks each tenant has pinned through this server and not unpinned, at most
``[server] pin_budget_blocks``. (The eviction policy that honours pins
keeps a budget of its own, what the cache grants: the server cannot read a
plugin's state.)
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Callable, Mapping
from typing import Any

from sagellm_core.types import TOKEN_ARRAY_TYPECODE, KVHints


class HintError(ValueError):
    """A hint the server refuses: the message, and the field or header it names."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def _tokens(text: str) -> bool | int:
    lowered = text.strip().lower()
    return lowered == "true" if lowered in ("true", "false") else int(text)


def _flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in ("true", "false", "1", "0"):
        raise ValueError(text)
    return lowered in ("true", "1")


#: Each hint's header, how its text reads, and what it takes.
HEADERS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "retain_s": ("x-sagellm-retain-s", _number, "finite seconds"),
    "pin": ("x-sagellm-pin", _tokens, "true, false or a number of tokens"),
    "unpin": ("x-sagellm-unpin", _tokens, "true, false or a number of tokens"),
    "release": ("x-sagellm-release", _flag, "true or false"),
    "prefetch": ("x-sagellm-prefetch", _flag, "true or false"),
    "cache_key": ("x-sagellm-cache-key", str, "a string"),
}


def resolve(
    body_hints: Mapping[str, Any], prompt_cache_key: str | None, headers: Mapping[str, str], prompt_tokens: int
):
    """The request's :class:`KVHints` (``None`` where it gives none) from the
    body's ``kv_hints`` fields that were set, OpenAI's ``prompt_cache_key``
    and the headers; :class:`HintError` if they disagree or are invalid.
    ``pin`` / ``unpin`` of ``true`` mean the whole prompt."""
    given = dict(body_hints)
    if prompt_cache_key is not None:
        if given.get("cache_key", prompt_cache_key) != prompt_cache_key:
            raise HintError("kv_hints.cache_key and prompt_cache_key differ", "prompt_cache_key")
        given["cache_key"] = prompt_cache_key
    for name, (header, read, accepted) in HEADERS.items():
        text = headers.get(header)
        if text is None:
            continue
        try:
            value = read(text)
        except ValueError:
            raise HintError(f"{header}: {text[:40]!r} is not {accepted}", header) from None
        if name in given and given[name] != value:
            raise HintError(f"{header} and kv_hints.{name} differ", header)
        given[name] = value
    if not given:
        return None
    for name in ("pin", "unpin"):
        if isinstance(given.get(name), bool):
            given[name] = prompt_tokens if given[name] else 0
        value = given.get(name, 0)
        if isinstance(value, int) and value > prompt_tokens:
            raise HintError(
                f"kv_hints.{name} = {given[name]}: the prompt has {prompt_tokens} tokens", f"kv_hints.{name}"
            )
    try:
        return KVHints(**given)
    except ValueError as exc:
        param = str(exc).partition(" ")[0].partition(":")[0]
        raise HintError(str(exc), param) from None


def _prefix_digest(prompt: list[int], num_tokens: int) -> bytes:
    return hashlib.blake2b(array(TOKEN_ARRAY_TYPECODE, prompt[:num_tokens]).tobytes(), digest_size=16).digest()


class PinLedger:
    """What each tenant has pinned through this server: its pinned prefixes
    (by their whole blocks' tokens) and their blocks, until a request of the
    tenant unpins the same prefix. A tenant pinning more than
    ``budget_blocks`` blocks in all is refused; pinning a prefix it has
    pinned already costs nothing more."""

    def __init__(self, budget_blocks: int, block_size: int):
        self.budget_blocks = budget_blocks
        self.block_size = block_size
        self._pins: dict[str, dict[bytes, int]] = {}

    def used(self, tenant: str) -> int:
        return sum(self._pins.get(tenant, {}).values())

    def take(self, tenant: str, prompt: list[int], hints: KVHints) -> Callable[[], None]:
        """Apply ``hints``' pin or unpin for ``tenant``; return what undoes it
        (the request was not accepted after all). :class:`HintError`, with
        nothing changed, past the budget or for an unpin of no pin."""
        size = self.block_size
        mine = self._pins.setdefault(tenant, {})
        if hints.pin:
            blocks = hints.pin // size
            if blocks == 0:
                raise HintError(f"kv_hints.pin = {hints.pin}: less than one {size}-token block", "kv_hints.pin")
            digest = _prefix_digest(prompt, blocks * size)
            if digest in mine:
                return lambda: None
            used = self.used(tenant)
            if used + blocks > self.budget_blocks:
                raise HintError(
                    f"kv_hints.pin: tenant {tenant!r} has {used} of its {self.budget_blocks} pinned blocks"
                    f" ([server] pin_budget_blocks) and this pin needs {blocks}; unpin a prefix first",
                    "kv_hints.pin",
                )
            mine[digest] = blocks
            return lambda: mine.pop(digest, None)  # type: ignore[func-returns-value]
        if hints.unpin:
            digest = _prefix_digest(prompt, hints.unpin // size * size)
            blocks = mine.pop(digest, 0) if hints.unpin >= size else 0
            if not blocks:
                raise HintError(
                    f"kv_hints.unpin = {hints.unpin}: tenant {tenant!r} has no pin on the prompt's first"
                    f" {hints.unpin // size * size} tokens",
                    "kv_hints.unpin",
                )
            return lambda: mine.__setitem__(digest, blocks)
        return lambda: None
