"""What a predictor can know of a request before it runs: cheap numeric
features from the request and from what the engine observed of earlier
requests of the same conversation, prefix and tenant.

Conversation history is learned from ``sagellm_request_finished``: a chat
turn's predecessor in its session has finished by the time the next turn
arrives, so its true output length is known. That is the strongest cheap
signal on ShareGPT (the previous reply's length alone gives MAE 120 tokens
on later turns, against 144 for the median). A prompt that nearly repeats
an earlier one is answered from that one's reply (:mod:`.near_duplicates`)."""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict

from attrs import define, field

from sagellm_core.types import Request

from .near_duplicates import NearDuplicates

#: Names of :meth:`History.features`' values, in order.
FEATURE_NAMES = (
    "bias",
    "log_prompt_tokens",
    "log_new_tokens",
    "turn",
    "has_previous",
    "log_previous_output",
    "log_mean_output",
    "log_max_output",
    "log_prefix_mean_output",
    "has_prefix_history",
    "log_tenant_mean_output",
    "log_text_chars",
    "log_message_mean_output",
    "has_message_history",
)


@define
class _Session:
    outputs: list[int] = field(factory=list)
    #: Prompt plus output tokens of the last finished turn: the next turn's
    #: prompt repeats them, so what it adds is the new message.
    last_context_tokens: int = 0


@define
class _Mean:
    """A running mean of log output lengths."""

    total: float = 0.0
    count: int = 0

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


def log_tokens(n: float) -> float:
    return math.log1p(max(0.0, n))


class History:
    """Observed output lengths by session, by prefix (the first ``block_size``
    prompt tokens), by message (the tokens a turn adds to its conversation:
    the same question asked again tends to get an answer of the same
    length; on ShareGPT many turns repeat an earlier turn's message) and by tenant, bounded to the ``max_sessions`` and
    ``max_prefixes`` most recently used; and the reply lengths of the
    ``max_prefixes`` newest prompts, for :meth:`near_duplicate` (none where
    ``duplicate_similarity`` is over 1)."""

    def __init__(
        self,
        block_size: int = 16,
        max_sessions: int = 100_000,
        max_prefixes: int = 100_000,
        duplicate_similarity: float = 0.95,
    ):
        self.block_size = block_size
        self.max_sessions = max_sessions
        self.max_prefixes = max_prefixes
        self.duplicate_similarity = duplicate_similarity
        self.prompts = NearDuplicates(max_prefixes) if duplicate_similarity <= 1 else None
        #: Signatures of predicted requests until they finish: hashing the
        #: prompt once serves both the lookup and the memory.
        self._signatures = PendingFeatures()
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        self.prefixes: OrderedDict[bytes, _Mean] = OrderedDict()
        self.messages: OrderedDict[bytes, _Mean] = OrderedDict()
        self.tenants: dict[str, _Mean] = {}

    def _prefix_key(self, request: Request) -> bytes:
        return request.prompt_token_ids[: self.block_size].tobytes()

    def _session(self, request: Request) -> _Session | None:
        return self.sessions.get(request.session_id) if request.session_id is not None else None

    @staticmethod
    def _new_tokens(request: Request, session: _Session | None) -> int:
        prompt = request.num_prompt_tokens
        return prompt - session.last_context_tokens if session and session.last_context_tokens < prompt else prompt

    def _message_key(self, request: Request, new: int) -> bytes:
        tail = request.prompt_token_ids[request.num_prompt_tokens - new :].tobytes()
        return hashlib.blake2b(tail, digest_size=16).digest()

    def features(self, request: Request) -> list[float]:
        session = self._session(request)
        outputs = session.outputs if session else []
        prompt = request.num_prompt_tokens
        new = self._new_tokens(request, session)
        prefix = self.prefixes.get(self._prefix_key(request))
        message = self.messages.get(self._message_key(request, new))
        tenant = self.tenants.get(request.tenant)
        logs = [log_tokens(o) for o in outputs]
        return [
            1.0,
            log_tokens(prompt) / 8,
            log_tokens(new) / 8,
            min(len(outputs), 20) / 20,
            1.0 if outputs else 0.0,
            logs[-1] / 7 if logs else 0.0,
            sum(logs) / len(logs) / 7 if logs else 0.0,
            max(logs) / 7 if logs else 0.0,
            prefix.mean / 7 if prefix else 0.0,
            1.0 if prefix else 0.0,
            tenant.mean / 7 if tenant else 0.0,
            math.log1p(len(request.prompt_text)) / 10 if request.prompt_text else 0.0,
            message.mean / 7 if message else 0.0,
            1.0 if message else 0.0,
        ]

    def near_duplicate(self, request: Request) -> float | None:
        """The log reply length of the most similar earlier prompt, if its
        similarity reaches ``duplicate_similarity``."""
        if self.prompts is None:
            return None
        signature = self._signatures[request.request_id] = self.prompts.signature(request.prompt_token_ids)
        found = self.prompts.nearest(signature)
        return found[1] if found is not None and found[0] >= self.duplicate_similarity else None

    def observe(self, request: Request, output_tokens: int) -> None:
        value = log_tokens(output_tokens)
        if self.prompts is not None:
            signature = self._signatures.pop(request.request_id, None)
            if signature is None:  # finished without a prediction (evaluation's training turns)
                signature = self.prompts.signature(request.prompt_token_ids)
            self.prompts.add(signature, value)
        _remember(
            self.messages,
            self._message_key(request, self._new_tokens(request, self._session(request))),
            value,
            self.max_prefixes,
        )
        _remember(self.prefixes, self._prefix_key(request), value, self.max_prefixes)
        if request.session_id is not None:
            session = self.sessions.pop(request.session_id, None) or _Session()
            session.outputs.append(output_tokens)
            session.last_context_tokens = request.num_prompt_tokens + output_tokens
            self.sessions[request.session_id] = session
            if len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        self.tenants.setdefault(request.tenant, _Mean()).add(value)


def _remember(means: OrderedDict[bytes, _Mean], key: bytes, value: float, limit: int) -> None:
    mean = means.pop(key, None) or _Mean()
    mean.add(value)
    means[key] = mean  # most recently used last
    if len(means) > limit:
        means.popitem(last=False)


class PendingFeatures(OrderedDict):
    """What a predictor saw of each request at arrival, until it finishes;
    the oldest entries go beyond ``limit`` (requests rejected or dropped
    never finish)."""

    def __init__(self, limit: int = 100_000):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if len(self) > self.limit:
            self.popitem(last=False)
