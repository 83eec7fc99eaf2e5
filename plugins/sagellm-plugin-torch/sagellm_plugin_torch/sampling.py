"""Choosing each sampled row's next token, batched on the logits' device.

One step's sampled rows go through one pass of batched tensor operations,
in the order transformers' ``generate`` applies its logits processors:

1. penalties on the raw logits: ``repetition_penalty`` over the prompt and
   the generated tokens (transformers' ``RepetitionPenaltyLogitsProcessor``:
   a seen token's logit divided by the penalty, multiplied where negative),
   then OpenAI's ``frequency_penalty`` and ``presence_penalty`` over the
   generated tokens (``logit - frequency * count - presence * (count > 0)``);
2. a token constraint (structured output): the tokens it does not allow are
   masked, from a packed bitmask it fills on the host;
3. greedy rows take the argmax; the others are divided by ``temperature``,
   filtered by ``top_k``, ``top_p`` and ``min_p`` (transformers' warpers,
   one sort for all three) and sampled by inverse transform: one uniform
   number per row against the row's cumulative distribution. A row with a
   seed draws its number from its own ``torch.Generator``, so its tokens do
   not depend on what it is batched with; the others draw theirs together
   from the device's generator.

Log-probabilities are the model's own (``log_softmax`` of the raw logits,
before penalties, temperature and filtering; vLLM's default). The chosen
ids and, where asked, their log-probabilities and the top ones come back to
the host in one ``.tolist()``: the step's one synchronisation. The
generated-token counts the penalties read stay on the device, in one
``[rows, vocab]`` table with a row per request that uses them, updated with
the chosen ids before that synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import torch
from attrs import field, frozen, validators

#: The most top log-probabilities a request may ask for (OpenAI's limit).
MAX_LOGPROBS = 20


class TokenConstraint(Protocol):
    """Which tokens a request may produce next (a grammar matcher, say).
    Called on the engine's thread only: ``fill_bitmask`` before each token
    is sampled, ``accept`` with the token chosen."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``: an int32 CPU
        tensor of ``ceil(vocab / 32)`` words, bit ``t % 32`` of word
        ``t // 32`` set where token ``t`` is allowed (llguidance's and
        xgrammar's layout)."""
        ...

    def accept(self, token_id: int) -> None:
        """The token chosen for the request."""
        ...


@frozen
class SamplingParams:
    #: Tokens to generate at most (the request's ``output_tokens``).
    max_tokens: int = 16
    #: 0: greedy.
    temperature: float = field(default=0.0, validator=validators.ge(0.0))
    #: Keep the most probable tokens whose mass reaches ``top_p`` (1: all).
    top_p: float = field(default=1.0, validator=[validators.gt(0.0), validators.le(1.0)])
    #: Keep the ``top_k`` most probable tokens (0: all).
    top_k: int = field(default=0, validator=[validators.instance_of(int), validators.ge(0)])
    #: Drop tokens less probable than ``min_p`` times the most probable one (0: none).
    min_p: float = field(default=0.0, validator=[validators.ge(0.0), validators.le(1.0)])
    seed: int | None = None
    #: OpenAI's penalties over the generated tokens (-2 to 2 in its API).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: transformers' and vLLM's penalty over the prompt and generated tokens (1: none).
    repetition_penalty: float = field(default=1.0, validator=validators.gt(0.0))
    #: Return the chosen token's log-probability and this many top ones (``None``: none).
    logprobs: int | None = field(
        default=None, validator=validators.optional([validators.ge(0), validators.le(MAX_LOGPROBS)])
    )
    #: Restricts the tokens the request may produce (structured output).
    constraint: TokenConstraint | None = field(default=None, eq=False)
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def plain_greedy(self) -> bool:
        """The runner's argmax is the answer: nothing for the sampler to do."""
        return self.temperature <= 0 and not self.penalised and self.logprobs is None and self.constraint is None


@frozen
class TokenLogprobs:
    """The chosen token's log-probability and the most probable tokens'."""

    logprob: float
    #: ``(token_id, logprob)``, most probable first.
    top: tuple[tuple[int, float], ...] = ()


@attrs.define(eq=False)
class SequenceSampling:
    """One request's sampling state, made by :meth:`Sampler.track`."""

    params: SamplingParams
    #: The prompt's token ids (the model's), for the repetition penalty's table row.
    prompt: Sequence[int]
    #: Its row in the penalty table, once it has one.
    slot: int | None = None
    #: Its seeded generator, made on the logits' device when first sampled.
    generator: torch.Generator | None = None


class Sampler:
    """Samples a step's rows (one :class:`SequenceSampling` each) from the
    model's logits. Owned by one engine; not thread-safe."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        # The penalty table: generated-token counts and prompt tokens, a row
        # per tracked request that uses penalties (grown on demand).
        self._counts: torch.Tensor | None = None
        self._prompt_seen: torch.Tensor | None = None
        self._free_slots: list[int] = []

    def track(self, params: SamplingParams, prompt: Sequence[int]) -> SequenceSampling:
        return SequenceSampling(params, prompt)

    def release(self, seq: SequenceSampling) -> None:
        """The request is done: its table row is free for another."""
        if seq.slot is not None:
            self._free_slots.append(seq.slot)
            seq.slot = None

    def sample(
        self, logits: torch.Tensor, seqs: Sequence[SequenceSampling]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Each row's next token and, where asked, its log-probabilities:
        ``logits[i]`` (float32, ``[rows, vocab]``) belongs to ``seqs[i]``."""
        return self.collect(self.launch(logits, seqs), seqs)

    # The two halves of :meth:`sample`: ``launch`` queues the device work
    # and never waits for it; ``collect`` is the one synchronisation.

    def launch(self, logits: torch.Tensor, seqs: Sequence[SequenceSampling]) -> torch.Tensor:
        """Queue the sampling of every row; return ``[rows, columns]``
        float64 on the device: the chosen id, then for rows that asked for
        log-probabilities its log-probability and the top ids and values."""
        device = logits.device
        params = [s.params for s in seqs]
        scores = self.processed(logits, seqs)
        chosen = scores.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if p.temperature > 0]
        if sampled_rows:
            rows = _to_device(sampled_rows, torch.long, device)
            drawn = self._draw(scores.index_select(0, rows), [seqs[i] for i in sampled_rows])
            chosen = chosen.index_copy(0, rows, drawn)
        if any(s.slot is not None for s in seqs):
            self._count(chosen, seqs)
        columns = [chosen.to(torch.float64)[:, None]]
        asking = [i for i, p in enumerate(params) if p.logprobs is not None]
        if asking:
            columns.append(self._logprobs(logits, chosen, asking, params))
        return torch.cat(columns, dim=1) if len(columns) > 1 else columns[0]

    def collect(
        self, packed: torch.Tensor, seqs: Sequence[SequenceSampling]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        rows = packed.tolist()  # the step's one synchronisation
        tokens = [int(row[0]) for row in rows]
        logprobs: list[TokenLogprobs | None] = []
        for seq, row, token in zip(seqs, rows, tokens):
            p = seq.params
            if p.constraint is not None:
                p.constraint.accept(token)
            if p.logprobs is None:
                logprobs.append(None)
                continue
            k = p.logprobs
            top_ids, top_values = row[2 : 2 + k], row[2 + MAX_LOGPROBS : 2 + MAX_LOGPROBS + k]
            logprobs.append(TokenLogprobs(row[1], tuple((int(t), v) for t, v in zip(top_ids, top_values))))
        return tokens, logprobs

    def processed(self, logits: torch.Tensor, seqs: Sequence[SequenceSampling]) -> torch.Tensor:
        """The logits with each row's penalties and constraint applied: what
        a greedy row takes the argmax of."""
        return self._constrain(self._penalise(logits, seqs), seqs)

    def distribution(self, logits: torch.Tensor, seqs: Sequence[SequenceSampling]) -> torch.Tensor:
        """The probabilities each row's next token is drawn with (a greedy
        row: all on its argmax)."""
        scores = self.processed(logits, seqs)
        probs = torch.nn.functional.one_hot(scores.argmax(dim=-1), scores.shape[1]).to(scores.dtype)
        rows = [i for i, s in enumerate(seqs) if s.params.temperature > 0]
        if rows:
            index = _to_device(rows, torch.long, logits.device)
            drawn = self._probabilities(scores.index_select(0, index), [seqs[i].params for i in rows])
            probs = probs.index_copy(0, index, drawn)
        return probs

    # ------------------------------------------------------------ stages --

    def _penalise(self, logits: torch.Tensor, seqs: Sequence[SequenceSampling]) -> torch.Tensor:
        rows = [i for i, s in enumerate(seqs) if s.params.penalised]
        if not rows:
            return logits
        device = logits.device
        slots = _to_device([self._slot(seqs[i], device) for i in rows], torch.long, device)
        assert self._counts is not None and self._prompt_seen is not None
        counts = self._counts.index_select(0, slots)
        generated = counts > 0
        seen = self._prompt_seen.index_select(0, slots) | generated
        values = _to_device(
            [
                [seqs[i].params.repetition_penalty, seqs[i].params.frequency_penalty, seqs[i].params.presence_penalty]
                for i in rows
            ],
            logits.dtype,
            device,
        )
        repetition, frequency, presence = values[:, 0:1], values[:, 1:2], values[:, 2:3]
        index = _to_device(rows, torch.long, device)
        picked = logits.index_select(0, index)
        picked = torch.where(seen, torch.where(picked < 0, picked * repetition, picked / repetition), picked)
        picked = picked - frequency * counts - presence * generated
        return logits.index_copy(0, index, picked)

    def _constrain(self, scores: torch.Tensor, seqs: Sequence[SequenceSampling]) -> torch.Tensor:
        rows = [i for i, s in enumerate(seqs) if s.params.constraint is not None]
        if not rows:
            return scores
        device = scores.device
        vocab = scores.shape[1]
        bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
        for j, i in enumerate(rows):
            constraint = seqs[i].params.constraint
            assert constraint is not None
            constraint.fill_bitmask(bitmask, j)
        if device.type == "cuda":
            bitmask = bitmask.pin_memory()
        bitmask = bitmask.to(device, non_blocking=True)
        token = torch.arange(vocab, device=device)
        allowed = (bitmask[:, token >> 5] >> (token & 31)) & 1
        index = _to_device(rows, torch.long, device)
        picked = scores.index_select(0, index).masked_fill(allowed == 0, float("-inf"))
        return scores.index_copy(0, index, picked)

    def _probabilities(self, scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Each row of ``scores`` (processed logits) divided by its
        temperature, filtered, as probabilities."""
        vocab = scores.shape[1]
        settings = _to_device(
            [[p.temperature, p.top_k or vocab, p.top_p, p.min_p] for p in params], scores.dtype, scores.device
        )
        scores = scores / settings[:, 0:1]
        if any(p.top_k or p.top_p < 1 or p.min_p > 0 for p in params):
            scores = _filter(scores, settings[:, 1:2], settings[:, 2:3], settings[:, 3:4])
        return torch.softmax(scores, dim=-1)

    def _draw(self, scores: torch.Tensor, seqs: Sequence[SequenceSampling]) -> torch.Tensor:
        """Sample each row of ``scores`` (processed logits)."""
        device = scores.device
        probs = self._probabilities(scores, [s.params for s in seqs])
        cdf = probs.cumsum(dim=-1)
        uniform = torch.empty((len(seqs), 1), dtype=cdf.dtype, device=device)
        if any(seq.params.seed is None for seq in seqs):
            uniform.uniform_()  # seeded rows draw theirs again below
        for row, seq in enumerate(seqs):
            seed = seq.params.seed
            if seed is None:
                continue
            if seq.generator is None:
                seq.generator = torch.Generator(device=device).manual_seed(seed)
            uniform[row].uniform_(generator=seq.generator)
        # Below the row's total (which rounding keeps near, not at, 1), and
        # the first token whose cumulative mass exceeds it: a token of
        # probability 0 spans no interval and is never chosen. (A row with
        # nothing allowed has no distribution; the clamp keeps its id a token.)
        total = cdf[:, -1:]
        point = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, point, right=True)[:, 0].clamp_(max=scores.shape[1] - 1)

    def _logprobs(
        self, logits: torch.Tensor, chosen: torch.Tensor, rows: list[int], params: list[SamplingParams]
    ) -> torch.Tensor:
        """``[rows, 1 + 2 * MAX_LOGPROBS]``: the chosen token's
        log-probability, the top ids, the top values (NaN in rows that did
        not ask)."""
        device = logits.device
        index = _to_device(rows, torch.long, device)
        logp = torch.log_softmax(logits.index_select(0, index), dim=-1)
        mine = logp.gather(1, chosen.index_select(0, index)[:, None]).to(torch.float64)
        k = max(params[i].logprobs or 0 for i in rows)
        top = logp.topk(k, dim=-1) if k else None
        block = torch.full((len(rows), 2 * MAX_LOGPROBS), float("nan"), dtype=torch.float64, device=device)
        if top is not None:
            block[:, :k] = top.indices.to(torch.float64)
            block[:, MAX_LOGPROBS : MAX_LOGPROBS + k] = top.values.to(torch.float64)
        out = torch.full((logits.shape[0], 1 + 2 * MAX_LOGPROBS), float("nan"), dtype=torch.float64, device=device)
        return out.index_copy(0, index, torch.cat([mine, block], dim=1))

    def _count(self, chosen: torch.Tensor, seqs: Sequence[SequenceSampling]) -> None:
        """Add each penalised row's chosen token to its counts, on the device."""
        rows = [i for i, s in enumerate(seqs) if s.slot is not None]
        device = chosen.device
        slots = _to_device([seqs[i].slot for i in rows], torch.long, device)
        tokens = chosen.index_select(0, _to_device(rows, torch.long, device))
        assert self._counts is not None
        # One token per row and one row per slot: no index repeats.
        self._counts.index_put_((slots, tokens), self._counts[slots, tokens] + 1)

    def _slot(self, seq: SequenceSampling, device: torch.device) -> int:
        """``seq``'s row of the penalty table, filled from its prompt the
        first time (a request is first sampled before it generates)."""
        if seq.slot is not None:
            return seq.slot
        if not self._free_slots:
            self._grow(device)
        slot = seq.slot = self._free_slots.pop()
        assert self._counts is not None and self._prompt_seen is not None
        self._counts[slot] = 0
        self._prompt_seen[slot] = False
        self._prompt_seen[slot].index_fill_(0, _to_device(list(seq.prompt), torch.long, device), True)
        return slot

    def _grow(self, device: torch.device) -> None:
        have = 0 if self._counts is None else self._counts.shape[0]
        more = max(8, have)
        counts = torch.zeros((have + more, self.vocab_size), dtype=torch.int32, device=device)
        seen = torch.zeros((have + more, self.vocab_size), dtype=torch.bool, device=device)
        if self._counts is not None and self._prompt_seen is not None:
            counts[:have] = self._counts
            seen[:have] = self._prompt_seen
        self._counts, self._prompt_seen = counts, seen
        self._free_slots.extend(range(have + more - 1, have - 1, -1))


def _filter(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """transformers' top-k, top-p and min-p warpers, in that order, per row
    (``[rows, 1]`` settings; ``top_k`` = vocab, ``top_p`` = 1, ``min_p`` = 0
    are off), from one descending sort; the most probable token is kept."""
    ordered, order = scores.sort(dim=-1, descending=True)
    rank = torch.arange(scores.shape[1], device=scores.device)
    keep = rank[None, :] < top_k
    ordered = ordered.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    # top-p as transformers computes it: a token goes when the mass of it and
    # every less probable token is at most 1 - top_p (summed from the least).
    tail = probs.flip(-1).cumsum(-1).flip(-1)
    keep &= (tail > 1 - top_p) | (top_p >= 1)
    # min-p compares with the most probable token, which no filter removes.
    keep &= probs >= min_p * probs[:, :1]
    keep[:, 0] = True
    return torch.full_like(scores, float("-inf")).scatter(1, order, ordered.masked_fill(~keep, float("-inf")))


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without waiting for the device: on a
    GPU through pinned memory, copied asynchronously."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)
