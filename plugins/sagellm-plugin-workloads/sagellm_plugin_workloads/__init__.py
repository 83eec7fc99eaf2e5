"""Workloads that stress what real serving sees and the chat generator and
the public traces lack: agentic tool-use sessions, RAG over a shared corpus,
a mix of tenants with different patterns, bursts, and a noisy neighbour.

Each is a ``sagellm.workloads`` entry point, seeded, needing no files. They
read the ``[workload]`` keys of the built-in generator (their ``Settings``
is its :class:`~sagellm_core.replay.workloads.GeneratorSettings`), each as
its README says (``tenants``, ``sessions_per_tenant``, ``turns``,
``system_prompt_tokens``, ``user_tokens``, ``output_tokens``,
``session_rate``, ``think_time_s``), and ``seed``. Text is distinct token ids
(``Text``): equal content is the same ids, so what is shared is exactly what
the workload says is shared, and output tokens are given (an engine that
caches output sees the next turn extend it).

With ``hints = true`` each request carries the client hints
(``Request.kv_hints``) that its application would know to send
(:class:`Hinter`): a session's last request releases its conversation, and
the others pin the prefix their tenant's sessions share (the system prompt,
the tool prompt, the instruction) and, for agents, retain their context for
three times the tool's mean latency. ``hints_wrong`` of them say the
opposite of the truth about whether the session goes on, ``hints_missing``
are not sent; the hints draw from a random stream of their own, so the
requests are the same with or without them.
"""

from __future__ import annotations

import heapq
import random
from array import array
from collections.abc import Callable, Iterator
from itertools import accumulate

import attrs

from sagellm_core.config import MAX_TOKENS, WorkloadSettings
from sagellm_core.replay.workloads import GeneratorSettings, HintedSettings, Hinter
from sagellm_core.types import TOKEN_ARRAY_TYPECODE, KVHints, Request

#: Token ids start here: above the generator's vocabulary and the trace
#: loaders' ids, though each run replays one workload anyway.
BASE_TOKEN = 1 << 40


class Text:
    """Distinct text: every call returns ids never returned before."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.next_id = BASE_TOKEN

    def take(self, count: int) -> array:
        ids = array(TOKEN_ARRAY_TYPECODE, range(self.next_id, self.next_id + count))
        self.next_id += count
        return ids

    def about(self, mean: int) -> array:
        """Lognormal length with this mean (sigma 0.6, as the generator's)."""
        return self.take(max(1, int(self.rng.lognormvariate(0.0, 0.6) * mean * 0.835)))


class Session:
    """One user's (or agent's) requests: the context so far and what comes next."""

    __slots__ = ("name", "tenant", "context", "turn", "turns", "extra")

    def __init__(self, name: str, tenant: str, context: array, turns: int, extra: object = None):
        self.name, self.tenant, self.context, self.turns, self.extra = name, tenant, context, turns, extra
        self.turn = 0


#: A session's next request and when the one after it comes (None: it ends).
Step = Callable[[Session, float], tuple[Request, float | None]]


def run_sessions(starts: list[tuple[float, Session]], step: Step) -> Iterator[Request]:
    """Requests of interleaved sessions in arrival order."""
    heap = [(t, i, i) for i, (t, _) in enumerate(starts)]
    heapq.heapify(heap)
    sessions = [session for _, session in starts]
    order = len(heap)
    while heap:
        t, _, i = heapq.heappop(heap)
        request, nxt = step(sessions[i], t)
        yield request
        if nxt is not None:
            order += 1
            heapq.heappush(heap, (max(nxt, t), order, i))


def poisson_starts(rng: random.Random, count: int, rate: float, t0: float = 0.0) -> list[float]:
    t, times = t0, []
    for _ in range(count):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        times.append(t)
    return times


def zipf_weights(n: int, s: float) -> list[float]:
    return list(accumulate(1.0 / (k + 1) ** s for k in range(n)))


def turn_request(session: Session, t: float, new_input: array, reply: array, hints: KVHints | None = None) -> Request:
    """The session's next request: its context plus the new input; the reply
    (and the input) join the context for the turn after it."""
    prompt = session.context + new_input
    session.context = prompt + reply
    request = Request(
        request_id=f"{session.name}-turn{session.turn}",
        prompt_token_ids=prompt,
        output_tokens=len(reply),
        arrival_s=t,
        tenant=session.tenant,
        session_id=session.name,
        output_token_ids=reply,
        kv_hints=hints,
    )
    session.turn += 1
    return request


# ----------------------------------------------------------------- patterns --


def chat_sessions(
    s: GeneratorSettings, rng: random.Random, text: Text, tenant: str, count: int, hint: Hinter
) -> Iterator[Request]:
    """Multi-turn chat on one shared system prompt, as the built-in generator:
    ``turns`` turns a session (uniform from 1 to 2 × turns), ``think_time_s``
    between them. Hints: the system prompt pinned until the last turn,
    which releases the conversation."""
    system = text.take(s.system_prompt_tokens)
    going_on = KVHints(pin=len(system))
    starts = [
        (t, Session(f"{tenant}-chat{i}", tenant, system, rng.randint(1, 2 * s.turns)))
        for i, t in enumerate(poisson_starts(rng, count, s.session_rate))
    ]

    return run_sessions(starts, conversation(s, rng, text, hint, going_on))


def conversation(
    s: GeneratorSettings, rng: random.Random, text: Text, hint: Hinter, going_on: KVHints | None = None
) -> Step:
    """A conversation's turns: a user message (``user_tokens``) and a reply
    (``output_tokens``) each, ``think_time_s`` (and a second) apart; the
    hints ``hint`` sends, ``going_on`` until the last turn."""

    def step(session: Session, t: float) -> tuple[Request, float | None]:
        hints = hint(session.turn + 1 >= session.turns, going_on)
        request = turn_request(session, t, text.about(s.user_tokens), text.about(s.output_tokens), hints)
        more = session.turn < session.turns
        return request, t + 1.0 + rng.expovariate(1.0 / s.think_time_s) if more else None

    return step


def agent_sessions(
    s: GeneratorSettings, rng: random.Random, text: Text, tenants: list[str], count: int, hint: Hinter
) -> Iterator[Request]:
    """Tool-use agents: each tenant's agents share a long tool prompt (four
    system prompts long); a session is a task and from 2 × turns to 6 × turns
    short steps, each a tool call (a quarter of ``output_tokens``) whose
    result (half of ``user_tokens``) the next step reads after the tool's
    latency (a fifth of ``think_time_s``). Tool sets are used Zipf(1).
    Hints: the tool prompt pinned and the context retained for three mean
    latencies until the last step, which releases the task."""
    tools = [text.take(4 * s.system_prompt_tokens) for _ in tenants]
    cumulative = zipf_weights(len(tenants), 1.0)
    starts = []
    for i, t in enumerate(poisson_starts(rng, count, s.session_rate)):
        k = rng.choices(range(len(tenants)), cum_weights=cumulative)[0]
        task = text.about(s.user_tokens)
        steps = rng.randint(2 * s.turns, 6 * s.turns)
        starts.append((t, Session(f"{tenants[k]}-agent{i}", tenants[k], tools[k] + task, steps, len(tools[k]))))
    latency = max(s.think_time_s / 5.0, 1e-3)

    def step(session: Session, t: float) -> tuple[Request, float | None]:
        call = text.about(max(1, s.output_tokens // 4))
        going_on = KVHints(pin=session.extra, retain_s=3 * latency)  # type: ignore[arg-type]
        hints = hint(session.turn + 1 >= session.turns, going_on)
        request = turn_request(session, t, array(TOKEN_ARRAY_TYPECODE), call, hints)
        session.context += text.about(max(1, s.user_tokens // 2))  # the tool's result
        more = session.turn < session.turns
        return request, t + rng.expovariate(1.0 / latency) if more else None

    return run_sessions(starts, step)


def batch_jobs(
    s: GeneratorSettings, rng: random.Random, text: Text, tenant: str, count: int, hint: Hinter
) -> Iterator[Request]:
    """One-shot long documents (summarisation, extraction): a short shared
    instruction and a document of four system prompts' length never seen
    before, submitted in batches of ``sessions_per_tenant`` within a second,
    a batch every ``10 / session_rate`` seconds on average. A scan: its
    blocks are never used again. Hints: each job releases itself."""
    instruction = text.take(128)
    going_on = KVHints(pin=len(instruction))
    t, end, made = 0.0, 0.0, 0
    while made < count:
        # the next batch once the last is in: each is spread over a second
        t = max(t + (rng.expovariate(s.session_rate / 10.0) if s.session_rate > 0 else 0.0), end)
        for j in range(min(s.sessions_per_tenant, count - made)):
            reply = text.about(s.output_tokens)
            yield Request(
                request_id=f"{tenant}-doc{made}",
                prompt_token_ids=instruction + text.about(4 * s.system_prompt_tokens),
                output_tokens=len(reply),
                arrival_s=t + j / s.sessions_per_tenant,
                tenant=tenant,
                output_token_ids=reply,
                kv_hints=hint(True, going_on),
            )
            made += 1
        end = t + 1.0


def _merged(*streams: Iterator[Request]) -> Iterator[Request]:
    return heapq.merge(*streams, key=lambda request: request.arrival_s)


# ---------------------------------------------------------------- workloads --


def agentic(settings: WorkloadSettings) -> Iterator[Request]:
    """``source = "agentic"``: tool-use agent sessions, ``tenants`` tool sets,
    ``tenants × sessions_per_tenant`` sessions (``agent_sessions``)."""
    s: GeneratorSettings = settings.options
    rng = random.Random(settings.seed)
    tenants = [f"tools-{k}" for k in range(s.tenants)]
    return agent_sessions(s, rng, Text(rng), tenants, s.tenants * s.sessions_per_tenant, Hinter(s, settings.seed))


def rag(settings: WorkloadSettings) -> Iterator[Request]:
    """``source = "rag"``: questions over a shared corpus of ``50 × tenants``
    documents (``system_prompt_tokens`` long each) whose popularity is
    Zipf(0.8). A question's prompt is a shared instruction, the three
    retrieved documents (the most relevant first: the popular one, by
    rank), and the question (``user_tokens``); a user asks from 1 to
    ``turns`` questions, each follow-up extending the conversation after
    ``think_time_s``, and there are ``tenants × sessions_per_tenant`` users.
    Hints: the instruction pinned until a user's last question, which
    releases the conversation."""
    s: GeneratorSettings = settings.options
    rng = random.Random(settings.seed)
    hint = Hinter(s, settings.seed)
    text = Text(rng)
    instruction = text.take(256)
    going_on = KVHints(pin=len(instruction))
    docs = [text.about(s.system_prompt_tokens) for _ in range(50 * s.tenants)]
    cumulative = zipf_weights(len(docs), 0.8)
    rank = list(range(len(docs)))
    rng.shuffle(rank)  # popularity is not the order the corpus was written in

    def retrieve() -> array:
        picked: list[int] = []
        while len(picked) < 3:
            k = rng.choices(rank, cum_weights=cumulative)[0]
            if k not in picked:
                picked.append(k)
        picked.sort(key=rank.index)
        return instruction + docs[picked[0]] + docs[picked[1]] + docs[picked[2]]

    users = s.tenants * s.sessions_per_tenant
    starts = [
        (t, Session(f"user{i}", "default", array(TOKEN_ARRAY_TYPECODE), rng.randint(1, s.turns)))
        for i, t in enumerate(poisson_starts(rng, users, s.session_rate))
    ]

    def step(session: Session, t: float) -> tuple[Request, float | None]:
        if session.turn == 0:
            session.context = retrieve()
        hints = hint(session.turn + 1 >= session.turns, going_on)
        request = turn_request(session, t, text.about(s.user_tokens), text.about(s.output_tokens), hints)
        more = session.turn < session.turns
        return request, t + 1.0 + rng.expovariate(1.0 / s.think_time_s) if more else None

    return run_sessions(starts, step)


def tenant_mix(settings: WorkloadSettings) -> Iterator[Request]:
    """``source = "tenant-mix"``: three tenants sharing one cache, each with
    its own pattern and ``sessions_per_tenant × tenants`` sessions or jobs:
    ``chat`` (multi-turn chat on a shared system prompt), ``agents`` (tool-use
    sessions on one tool set) and ``batch`` (one-shot long documents in
    batches, a scan)."""
    s: GeneratorSettings = settings.options
    count = s.sessions_per_tenant * s.tenants
    rngs = [random.Random(settings.seed * 3 + k) for k in range(3)]
    hint = Hinter(s, settings.seed)
    return _merged(
        chat_sessions(s, rngs[0], Text(rngs[0]), "chat", count, hint),
        agent_sessions(s, rngs[1], _offset(Text(rngs[1]), 1), ["agents"], max(1, count // 4), hint),
        batch_jobs(s, rngs[2], _offset(Text(rngs[2]), 2), "batch", count, hint),
    )


def bursts(settings: WorkloadSettings) -> Iterator[Request]:
    """``source = "bursts"``: background chat (``tenants × sessions_per_tenant``
    sessions) and bursts: every ``20 / session_rate`` seconds on average, a
    burst of ``4 × sessions_per_tenant`` requests within two seconds on one
    long shared document (four system prompts), each with its own question
    (an evaluation job, a broadcast, a flash crowd). One burst in five
    re-runs an earlier burst's document; the others never recur. Hints: the
    background chat's, and each burst request releases itself (its
    question; the document, shared, stays)."""
    s: GeneratorSettings = settings.options
    rng = random.Random(settings.seed)
    count = s.tenants * s.sessions_per_tenant
    hint = Hinter(s, settings.seed)
    background = chat_sessions(
        s, random.Random(settings.seed + 1), _offset(Text(random.Random(settings.seed + 2)), 1), "chat", count, hint
    )
    text = Text(rng)
    documents: list[array] = []
    horizon = count / s.session_rate if s.session_rate > 0 else 0.0
    bursts_made: list[Request] = []
    t, b = 0.0, 0
    while t < horizon:
        t += rng.expovariate(s.session_rate / 20.0) if s.session_rate > 0 else horizon
        if documents and rng.random() < 0.2:
            document = rng.choice(documents)
        else:
            document = text.take(4 * s.system_prompt_tokens)
            documents.append(document)
        size = 4 * s.sessions_per_tenant
        for j in range(size):
            reply = text.about(s.output_tokens)
            bursts_made.append(
                Request(
                    request_id=f"burst{b}-{j}",
                    prompt_token_ids=document + text.about(s.user_tokens),
                    output_tokens=len(reply),
                    arrival_s=t + 2.0 * j / size,
                    tenant="burst",
                    output_token_ids=reply,
                    kv_hints=hint(True),
                )
            )
        b += 1
    bursts_made.sort(key=lambda request: request.arrival_s)  # a burst may start inside the last
    return _merged(background, iter(bursts_made))


@attrs.frozen
class NoisySettings(GeneratorSettings):
    """``noisy-neighbour``'s ``[workload]`` keys: the generator's, and the
    noisy tenant's."""

    #: Documents a second the noisy tenant sends (0: the chat tenants alone).
    document_rate: float = 1.0
    #: Mean document length, tokens.
    document_tokens: int = 4096
    #: Questions asked about each document, one a turn.
    document_turns: int = 2

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.document_rate < 0:
            raise ValueError(f"document_rate = {self.document_rate!r}: a rate, at least 0")
        if self.document_turns < 1:
            raise ValueError(f"document_turns = {self.document_turns!r}: a positive integer")
        if not 1 <= self.document_tokens <= MAX_TOKENS:
            raise ValueError(f"document_tokens = {self.document_tokens!r}: from 1 to {MAX_TOKENS:,} tokens")


def noisy_neighbour(settings: WorkloadSettings) -> Iterator[Request]:
    """``source = "noisy-neighbour"``: ``tenants`` chat tenants (``chat-0``,
    ...: multi-turn sessions on each tenant's system prompt, as the
    generator's, ``sessions_per_tenant`` each) and one noisy tenant,
    ``docs``, that sends long documents (``document_tokens``, each new, a
    short shared instruction) at ``document_rate`` a second (Poisson) while
    the chat sessions arrive, each asked about in ``document_turns`` turns
    (a question and a reply of the chat's lengths, ``think_time_s`` apart).
    The chat tenants' requests are the same at any ``document_rate``, so
    ``document_rate = 0`` is them alone."""
    s: NoisySettings = settings.options
    no_hints = Hinter(s, settings.seed)  # the noisy neighbour's source sends none
    chats = [
        chat_sessions(s, rng, _offset(Text(rng), k + 1), f"chat-{k}", s.sessions_per_tenant, no_hints)
        for k, rng in ((k, random.Random(settings.seed * 1009 + k)) for k in range(s.tenants))
    ]
    chat = list(_merged(*chats))
    rng = random.Random(settings.seed * 1009 - 1)
    text = _offset(Text(rng), 0)
    instruction = text.take(64)
    horizon = chat[-1].arrival_s if chat else 0.0
    starts: list[tuple[float, Session]] = []
    t = 0.0
    while s.document_rate > 0 and (t := t + rng.expovariate(s.document_rate)) <= horizon:
        document = instruction + text.about(s.document_tokens)
        starts.append((t, Session(f"docs-{len(starts)}", "docs", document, s.document_turns)))
    return _merged(iter(chat), run_sessions(starts, conversation(s, rng, text, no_hints)))


def _offset(text: Text, k: int) -> Text:
    """Separate id ranges for the streams of one workload."""
    text.next_id = BASE_TOKEN + (k << 36)
    return text


# The [workload] keys each source reads: the generator's, and the hints'.
for _source in (agentic, rag, tenant_mix, bursts):
    _source.Settings = HintedSettings  # type: ignore[attr-defined]
noisy_neighbour.Settings = NoisySettings  # type: ignore[attr-defined]
