"""Workloads: requests in arrival order.

* Mooncake JSONL traces: ``hash_ids`` are prefix-chained hashes of 512-token
  blocks. Block ``h`` is mapped to the token ids ``h*512 .. h*512+511`` (cut at
  ``input_length``), so equal hashes give equal tokens and any block size
  works: a 16-token block is a slice of one trace block. A record's optional
  ``session`` (or ``session_id``), ``tenant`` and ``cache_salt`` are kept on
  the request (tenant-aware policies, the prefix cache's namespaces).
* Azure CSV traces: lengths only; every prompt is distinct (no sharing).
* The built-in generator: multi-tenant chat sessions with a shared system
  prompt per tenant and multi-turn growth. Seeded; needs no files. Its
  ``[workload]`` keys are :class:`HintedSettings`: the sessions' shape, and
  the client hints they send.
* Any other ``source`` names a ``sagellm.workloads`` entry point of an
  installed package: an object ``load(settings)`` yielding requests, whose
  ``Settings`` (if it has one) is the attrs class of the ``[workload]`` keys
  it reads (``settings.options``).

Every loader streams (a trace is never held whole) and checks that arrivals do
not go backwards. A line that cannot be read is a :class:`TraceError` naming
the file and line.
"""

from __future__ import annotations

import csv
import hashlib
import heapq
import json
import math
import random
import re
from array import array
from collections.abc import Iterator
from datetime import datetime
from itertools import islice
from typing import Any

import attrs

from sagellm_core import registry
from sagellm_core.config import MAX_TOKENS, WORKLOAD_GROUP, WorkloadSettings
from sagellm_core.errors import ConfigError, SagellmError, TraceError
from sagellm_core.types import TOKEN_ARRAY_TYPECODE, KVHints, Request

#: Token ids of synthetic (unshared) text start here, above the id space of
#: trace blocks and generator vocabularies, so they never collide.
_UNIQUE_BASE = 1 << 48
#: A Mooncake line longer than this is refused before it is parsed.
MAX_LINE_CHARS = 1 << 24


#: Timestamps of the shape the Azure traces use, which ``fromisoformat`` reads
#: exactly as ``strptime`` does, a hundred times faster.
_ISO_STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}", re.ASCII)


def _timestamp(stamp: str) -> datetime:
    """``stamp`` read with ``%Y-%m-%d %H:%M:%S.%f``; a ValueError (``strptime``'s
    own message) if it cannot be."""
    if _ISO_STAMP.fullmatch(stamp):
        try:
            return datetime.fromisoformat(stamp)
        except ValueError:
            pass  # out of range (a 13th month): strptime says so in its words
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f")


def _token_array(ids: Any) -> array:
    """A token array from a 1-d numpy int64 array, in one copy."""
    tokens = array(TOKEN_ARRAY_TYPECODE)
    with memoryview(ids) as view, view.cast("B") as raw:
        tokens.frombytes(raw)
    return tokens


def _tokens(start: int, count: int) -> array:
    """The ids ``start .. start + count - 1``, built by numpy: an int per
    token from ``range`` was a tenth of a timed replay of the Azure trace."""
    import numpy as np  # imported when a trace is read, not when the core is (`sagellm --version` stays quick)

    return _token_array(np.arange(start, start + count, dtype=np.int64))


def load(settings: WorkloadSettings) -> Iterator[Request]:
    if settings.source == "mooncake":
        requests = _readable(mooncake(settings.path, settings.trace_block_tokens), settings.path)
    elif settings.source == "azure":
        requests = _readable(azure(settings.path, seed=settings.seed), settings.path)
    elif settings.source == "generator":  # built in here; its entry point declares its keys
        requests = generate(settings)
    else:
        requests = iter(_installed(settings.source)(settings))
    if (settings.session_from, settings.session_to) != (0.0, 1.0):
        low, high = settings.session_from, settings.session_to
        requests = (r for r in requests if low <= session_draw(r) < high)
    requests = islice(requests, settings.max_requests)
    if settings.time_scale != 1.0:
        scale = settings.time_scale
        requests = (attrs.evolve(r, arrival_s=r.arrival_s * scale) for r in requests)
    if settings.ttft_slo_s is not None:
        slo = settings.ttft_slo_s
        requests = (attrs.evolve(r, deadline_s=r.arrival_s + slo) for r in requests)
    return _in_order(requests, settings.path or settings.source)


def _readable(requests: Iterator[Request], path: str) -> Iterator[Request]:
    """A trace's bytes that are not text, or a CSV row the reader refuses
    (an over-long field, a NUL byte): one line, not a traceback."""
    count = 0
    try:
        for request in requests:
            count += 1
            yield request
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text after request {count} ({exc.reason}); a trace is text") from None
    except csv.Error as exc:
        raise TraceError(f"{path}: after request {count}: {exc}") from None


def session_draw(request: Request) -> float:
    """A stable draw in [0, 1) for the request's session (its own id when it
    has none): every turn of a conversation draws the same, in any process."""
    key = (request.session_id or request.request_id).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") / 2**64


def _installed(source: str):
    where = f"[workload] source = {source!r}"
    entry = registry.find(WORKLOAD_GROUP, source, where)
    if entry is None:
        raise ConfigError(f"{where}: no such {WORKLOAD_GROUP} entry point is installed")
    try:
        load = entry.load()
    except (Exception, SystemExit) as exc:
        raise ConfigError(f"{where} ({entry.value}) failed to import: {type(exc).__name__}: {exc}") from exc

    def guarded(settings: WorkloadSettings) -> Iterator[Request]:
        # The plugin's errors are its own: one line naming it, not a traceback.
        try:
            for request in load(settings):
                if not isinstance(request, Request):
                    raise TraceError(f"{where} ({entry.value}) yielded {type(request).__name__}, not a Request")
                if not isinstance(request.session_id, (str, type(None))):  # sessions are drawn by their name
                    raise TraceError(
                        f"{where} ({entry.value}) yielded request {request.request_id!r} whose session_id is"
                        f" {request.session_id!r}, not a string"
                    )
                yield request
        except SagellmError:
            raise
        except (Exception, SystemExit) as exc:
            raise TraceError(f"{where} ({entry.value}) raised: {type(exc).__name__}: {exc}") from exc

    return guarded


def _in_order(requests: Iterator[Request], where: str) -> Iterator[Request]:
    """Check each request as it is read (a workload plugin's too): a Request,
    a prompt, an output length, a finite arrival (after ``time_scale``), in
    arrival order."""
    last = float("-inf")
    for index, request in enumerate(requests):
        problem = _problem(request)
        if problem is not None:
            name = getattr(request, "request_id", None)
            raise TraceError(f"{where}: request {index + 1} ({name}): {problem}")
        if request.arrival_s < last:
            raise TraceError(
                f"{where}: request {index + 1} ({request.request_id}) arrives at {request.arrival_s}s,"
                f" before the previous one ({last}s); traces must be in arrival order"
            )
        last = request.arrival_s
        yield request


def _problem(request: Any) -> str | None:
    if not isinstance(request, Request):
        return f"{type(request).__name__} is not a Request"
    out, arrival = request.output_tokens, request.arrival_s
    if not isinstance(out, int) or isinstance(out, bool) or not 0 < out <= MAX_TOKENS:
        return f"output_tokens = {out!r}: a positive integer, at most {MAX_TOKENS:,}"
    if not 0 < request.num_prompt_tokens <= MAX_TOKENS:
        return f"a {request.num_prompt_tokens:,}-token prompt: from 1 to {MAX_TOKENS:,} tokens"
    if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or not math.isfinite(arrival):
        return f"arrival_s = {arrival!r}: finite seconds (time_scale may overflow it)"
    if not isinstance(request.request_id, str):
        return f"request_id = {request.request_id!r}: a string"
    return None


def mooncake(path: str, trace_block_tokens: int = 512) -> Iterator[Request]:
    """The requests of a Mooncake-format trace (JSON lines: ``timestamp`` in
    ms, ``input_length``, ``output_length``, ``hash_ids`` of its
    ``trace_block_tokens``-token blocks). Token ``i`` of block ``h`` is
    ``(h << 32) | i``: equal blocks have equal ids, every position its own,
    and a prompt's ids are built by numpy, not a Python int per token (that was
    a third of a cache-only replay's time)."""
    import numpy as np  # imported when a trace is read, not when the core is (`sagellm --version` stays quick)

    positions = np.arange(0, dtype=np.uint64)  # the low halves of a block's ids, grown as prompts need
    # The ids are computed into this buffer, kept from prompt to prompt (not a
    # new array per prompt), and copied out once into the prompt's array.
    scratch = np.empty(0, dtype=np.uint64)
    try:
        fh = open(path, encoding="utf-8-sig")
    except OSError as exc:
        raise TraceError(f"{path}: cannot open trace: {exc.strerror}") from None
    with fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            if len(line) > MAX_LINE_CHARS:  # a MAX_TOKENS prompt's hash ids fit in far less
                raise TraceError(f"{where}: a {len(line):,}-character line; at most {MAX_LINE_CHARS:,}")
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not a JSON object: {exc.msg}") from None
            except RecursionError:
                raise TraceError(f"{where}: not a JSON object: nested too deeply") from None
            if not isinstance(row, dict):
                raise TraceError(f"{where}: not a JSON object")
            for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                if key not in row:
                    raise TraceError(f"{where}: missing key {key!r}")
            length, output, hashes = row["input_length"], row["output_length"], row["hash_ids"]
            # bool is an int to Python; true is not a length to a reader.
            for key, value in (("input_length", length), ("output_length", output)):
                if not (isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_TOKENS):
                    raise TraceError(f"{where}: {key} = {value!r}: a positive integer, at most {MAX_TOKENS:,}")
            stamp = row["timestamp"]
            if not isinstance(stamp, (int, float)) or isinstance(stamp, bool) or not math.isfinite(stamp):
                raise TraceError(f"{where}: timestamp = {stamp!r}: finite milliseconds")
            top = 1 << 32  # the high half of a token id
            # Integers that are not bools (JSON has no other int types), in range.
            if not (
                isinstance(hashes, list)
                and set(map(type, hashes)) <= {int}
                and (not hashes or (min(hashes) >= 0 and max(hashes) < top))
            ):
                raise TraceError(f"{where}: hash_ids: a list of integers from 0 to {top - 1:,}")
            if len(hashes) != -(-length // trace_block_tokens):
                raise TraceError(
                    f"{where}: {len(hashes)} hash_ids for input_length {length};"
                    f" {trace_block_tokens}-token blocks need {-(-length // trace_block_tokens)}"
                )
            labels = {}
            for key, field_name in (
                ("session", "session_id"),
                ("session_id", "session_id"),
                ("tenant", "tenant"),
                ("cache_salt", "cache_salt"),
            ):
                value = row.get(key)
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, (str, int)):
                    raise TraceError(f"{where}: {key} = {value!r}: a string or an integer")
                labels[field_name] = str(value)
            # One row of ids per block, the last only as far as the prompt goes.
            width = min(trace_block_tokens, length)
            if len(positions) < width:
                positions = np.arange(width, dtype=np.uint64)
            size = len(hashes) * width  # under twice the prompt's length
            if len(scratch) < size:
                scratch = np.empty(max(size, 2 * len(scratch)), dtype=np.uint64)
            rows = scratch[:size].reshape(len(hashes), width)
            np.bitwise_or(np.asarray(hashes, dtype=np.uint64)[:, None] << np.uint64(32), positions[:width], out=rows)
            tokens = _token_array(scratch[:length])
            yield Request(
                request_id=f"mooncake-{lineno}",
                prompt_token_ids=tokens,
                output_tokens=output,
                arrival_s=row["timestamp"] / 1000.0,
                **labels,
            )


def azure(path: str, seed: int = 0) -> Iterator[Request]:
    try:
        fh = open(path, encoding="utf-8-sig", newline="")
    except OSError as exc:
        raise TraceError(f"{path}: cannot open trace: {exc.strerror}") from None
    with fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        wanted = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if header is None or [h.strip() for h in header[:3]] != wanted:
            raise TraceError(f"{path}:1: header {header!r}: expected {','.join(wanted)}")
        start = None
        for lineno, row in enumerate(reader, 2):
            where = f"{path}:{lineno}"
            if len(row) < 3:
                raise TraceError(f"{where}: expected 3 columns, got {len(row)}")
            try:
                # Seven fractional digits: one more than %f reads.
                when = _timestamp(row[0].strip()[:26])
                context, generated = int(row[1]), int(row[2])
            except ValueError as exc:
                raise TraceError(f"{where}: {exc}") from None
            if not (0 < context <= MAX_TOKENS and 0 < generated <= MAX_TOKENS):
                raise TraceError(
                    f"{where}: token counts must be positive and at most {MAX_TOKENS:,}, got {context}, {generated}"
                )
            start = when if start is None else start
            yield Request(
                request_id=f"azure-{lineno}",
                prompt_token_ids=_tokens(_UNIQUE_BASE + lineno * (1 << 24), context),
                output_tokens=generated,
                arrival_s=(when - start).total_seconds(),
            )


@attrs.frozen
class GeneratorSettings:
    """The generator's ``[workload]`` keys (``source = "generator"``); the
    ``sagellm-plugin-workloads`` sources read them too."""

    tenants: int = 4
    sessions_per_tenant: int = 12
    #: 0: every tenant has the same number of sessions; s > 0: a session
    #: belongs to tenant k with probability proportional to 1 / (k + 1)^s
    #: (Zipf), so a few tenants bring most of the load.
    tenant_skew: float = 0.0
    turns: int = 4
    system_prompt_tokens: int = 1024
    user_tokens: int = 256
    output_tokens: int = 192
    #: Mean new sessions per second (Poisson arrivals).
    session_rate: float = 2.0
    #: Mean think time between a reply and the next turn, seconds.
    think_time_s: float = 5.0

    def __attrs_post_init__(self) -> None:
        # A ValueError names the key; the config parser adds the file and section.
        for key in ("tenants", "sessions_per_tenant", "turns"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} = {getattr(self, key)!r}: a positive integer")
        for key in ("system_prompt_tokens", "user_tokens", "output_tokens"):
            if getattr(self, key) > MAX_TOKENS:
                raise ValueError(f"{key} = {getattr(self, key)!r}: at most {MAX_TOKENS:,} tokens")
        requests = self.tenants * self.sessions_per_tenant * self.turns  # and system prompts: bounded (class 5)
        if max(requests, self.tenants * self.system_prompt_tokens) > MAX_TOKENS:
            raise ValueError(
                f"tenants x sessions_per_tenant x turns, tenants x system_prompt_tokens: at most {MAX_TOKENS:,}"
            )
        if self.tenant_skew > 8:
            raise ValueError(f"tenant_skew = {self.tenant_skew!r}: at most 8")


@attrs.frozen
class HintedSettings(GeneratorSettings):
    """The ``[workload]`` keys of a source that knows its sessions: the
    generator's, and the client hints its requests carry (:class:`Hinter`)."""

    #: Send the hints the application knows.
    hints: bool = False
    #: The share of the requests whose hints say the opposite about whether
    #: their session goes on.
    hints_wrong: float = 0.0
    #: The share of the requests that send no hints.
    hints_missing: float = 0.0

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key in ("hints_wrong", "hints_missing"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"{key} = {getattr(self, key)!r}: a share, from 0 to 1")
        if self.hints_wrong + self.hints_missing > 1:
            raise ValueError("hints_wrong + hints_missing: at most 1")


RELEASE = KVHints(release=True)


class Hinter:
    """The hints a workload's clients send. The truth is whether the session
    ends with this request (its last turn: ``release``) or goes on (the
    ``going_on`` hints: pins of a shared prefix, retention); a share
    ``hints_wrong`` of the requests state the opposite, ``hints_missing``
    send none. Its draws are its own stream (seeded from the workload's
    seed), so the workload's requests do not depend on them. Options that
    are not :class:`HintedSettings` (or say ``hints = false``) send none."""

    def __init__(self, options: GeneratorSettings, seed: int):
        hinted = isinstance(options, HintedSettings) and options.hints
        self.wrong = options.hints_wrong if hinted else 0.0
        self.missing = options.hints_missing if hinted else 1.0
        self.rng = random.Random(seed * 1_000_003 + 34)

    def __call__(self, ends: bool, going_on: KVHints | None = None) -> KVHints | None:
        if self.missing >= 1.0:
            return None
        draw = self.rng.random()
        if draw < self.missing:
            return None
        if draw < self.missing + self.wrong:
            ends = not ends
        return RELEASE if ends else going_on


def generate(settings: WorkloadSettings) -> Iterator[Request]:
    """Multi-tenant chat sessions. Each tenant has a system prompt shared by
    all its sessions; turn k's prompt is the system prompt, every earlier user
    message and reply, and a new user message, so a session's prefix grows.
    Lengths are lognormal around the configured means; arrivals are a Poisson
    process of sessions plus exponential think times between turns. With
    ``hints = true`` (:class:`HintedSettings`) each turn but a session's last
    pins its tenant's system prompt, and the last releases the session."""
    s: GeneratorSettings = settings.options
    rng = random.Random(settings.seed)
    hint = Hinter(s, settings.seed)
    going_on = KVHints(pin=s.system_prompt_tokens) if s.system_prompt_tokens > 0 else None
    vocab = 32000

    def text(mean: int) -> array:
        n = max(1, int(rng.lognormvariate(0.0, 0.6) * mean * 0.835))
        return array(TOKEN_ARRAY_TYPECODE, (rng.randrange(vocab) for _ in range(n)))

    systems = [
        array(TOKEN_ARRAY_TYPECODE, (rng.randrange(vocab) for _ in range(s.system_prompt_tokens)))
        for _ in range(s.tenants)
    ]
    # (arrival, tie-break, session, turn, context so far)
    heap: list = []
    t = 0.0
    n_sessions = s.tenants * s.sessions_per_tenant
    if s.tenant_skew > 0:  # its own generator: the unskewed sequence stays as it was
        weights = [1.0 / (k + 1) ** s.tenant_skew for k in range(s.tenants)]
        tenant_of = random.Random(settings.seed + 1).choices(range(s.tenants), weights, k=n_sessions)
    else:
        tenant_of = [i % s.tenants for i in range(n_sessions)]
    for i in range(n_sessions):
        t += rng.expovariate(s.session_rate) if s.session_rate > 0 else 0.0
        heapq.heappush(heap, (t, i, i, 0, systems[tenant_of[i]]))
    while heap:
        arrival, _, session, turn, context = heapq.heappop(heap)
        prompt = context + text(s.user_tokens)
        reply = text(s.output_tokens)
        tenant = tenant_of[session]
        yield Request(
            request_id=f"t{tenant}-s{session}-turn{turn}",
            prompt_token_ids=prompt,
            output_tokens=len(reply),
            arrival_s=arrival,
            tenant=f"tenant-{tenant}",
            session_id=f"s{session}",
            output_token_ids=reply,
            kv_hints=hint(turn + 1 >= s.turns, going_on),
        )
        if turn + 1 < s.turns:
            # The next turn is sent after the reply is read; replay cannot know
            # when the reply finishes, so think time runs from arrival.
            nxt = arrival + rng.expovariate(1.0 / s.think_time_s) + 1.0 if s.think_time_s > 0 else arrival
            heapq.heappush(heap, (nxt, session + (turn + 1) * n_sessions, session, turn + 1, prompt + reply))


#: The ``[workload]`` keys the generator reads (its ``sagellm.workloads`` entry point's ``Settings``).
generate.Settings = HintedSettings  # type: ignore[attr-defined]


def count(settings: WorkloadSettings) -> int | None:
    """How many requests ``load`` will yield, for the progress bar."""
    if settings.source == "generator":
        s = settings.options
        total = s.tenants * s.sessions_per_tenant * s.turns
    elif settings.source not in ("mooncake", "azure"):
        return settings.max_requests
    else:
        try:
            with open(settings.path, "rb") as fh:
                total = sum(1 for line in fh if line.strip()) - (settings.source == "azure")
        except OSError:
            return None
    return total if settings.max_requests is None else min(total, settings.max_requests)
