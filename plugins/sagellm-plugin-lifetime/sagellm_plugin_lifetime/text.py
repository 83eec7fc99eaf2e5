"""``[lifetime] plugin = "text"``: a learned text model in torch.

The request's text (:attr:`~sagellm_core.types.Request.prompt_text`, the
user's new message) becomes hashed word unigrams and bigrams, averaged by an
``EmbeddingBag`` (fastText's recipe); with the cheap features of
:mod:`.features` (earlier replies of the conversation, prompt size, ...) an
MLP predicts quantiles of ``log1p(output tokens)`` under the pinball loss.
``members`` such models, alike but for their random start, are trained side
by side and their quantiles averaged: with so few examples of most phrases,
one member's fit depends much on its random start, and on ShareGPT the
average of 16 is off by about 6% fewer tokens than one. They run as one
batched module, well under a millisecond a request on a CPU core, which a
sentence-embedding model is not (all-MiniLM-L6-v2 takes about 10 ms a
prompt here). A prompt that nearly repeats an earlier one is predicted that
one's reply length (:mod:`.near_duplicates`).

Serving: :meth:`TextLifetime.predict_batch` predicts the requests that
arrive in one step with one forward pass (the hook predicts one request
through it); the forward pass is warmed up at load. In service the head
keeps learning online, with its cost bounded per finished request: each
finish adds that request's gradient (computed in closed form, no autograd)
to a running sum, and every ``online_batch`` finishes one optimiser step
applies it: the same step as one batched step on those requests.

Training (``sagellm lifetime train``, or on first use when no weights file
exists) streams a workload, by default ShareGPT, and fits the ``train`` part
of its split (:mod:`.split`, whole conversations), stopping early on the
``dev`` part; the ``test`` part is never read. Seeded, so the same command
gives the same weights.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs
import numpy as np
from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.config import WorkloadSettings
from sagellm_core.errors import ConfigError
from sagellm_core.types import QUANTILE_LEVELS, LifetimePrediction, Request, RequestOutcome

from .features import FEATURE_NAMES, History, PendingFeatures, log_tokens
from .quantiles import MEDIAN, prediction
from .split import DEV_FRACTION, KINDS, TEST_FRACTION, Split, make_split

WORD = re.compile(r"\w+|[^\w\s]")
MAX_WORDS = 256
#: Hashes of words seen, so a word is hashed once (cleared when full).
_WORD_HASHES: dict[str, int] = {}
_MAX_WORD_HASHES = 1 << 20
#: Odd 64-bit constants that mix two word hashes into a bigram's.
_MIX_A = np.uint64(0x9E3779B97F4A7C15)
_MIX_B = np.uint64(0xC2B2AE3D27D4EB4F)


def _positive(cls):
    return [validators.instance_of(cls), validators.gt(0)]


@frozen
class TextSettings:
    #: Weights file; "" is the default model in the cache folder
    #: ($SAGELLM_CACHE, else ~/.cache/sagellm), trained there on first use.
    weights: str = field(default="", validator=validators.instance_of(str))
    buckets: int = field(default=1 << 16, validator=_positive(int))
    dim: int = field(default=32, validator=_positive(int))
    hidden: int = field(default=128, validator=_positive(int))
    #: Models averaged; each has its own ``dim`` text vector and MLP.
    members: int = field(default=16, validator=_positive(int))
    epochs: int = field(default=8, validator=_positive(int))
    learning_rate: float = field(default=1e-3, validator=_positive(float))
    seed: int = field(default=0, validator=validators.instance_of(int))
    #: The workload trained on (a ``[workload] source``).
    train_source: str = field(default="sharegpt", validator=validators.instance_of(str))
    online_batch: int = field(default=64, validator=_positive(int))
    online_learning_rate: float = field(default=1e-4, validator=[validators.instance_of(float), validators.ge(0)])
    #: A prompt at least this similar to an earlier one is predicted that
    #: one's reply length (:mod:`.near_duplicates`); over 1 turns it off.
    duplicate_similarity: float = field(default=0.95, validator=[validators.instance_of(float), validators.ge(0)])
    #: The split trained on (:mod:`.split`): ``conversation`` (a hash of the
    #: conversation) or ``temporal`` (the earliest conversations); the test
    #: part is never read, the dev part only for early stopping.
    split: str = field(default="conversation", validator=validators.in_(KINDS))
    test_fraction: float = field(default=TEST_FRACTION, validator=[validators.instance_of(float), validators.gt(0)])
    dev_fraction: float = field(default=DEV_FRACTION, validator=[validators.instance_of(float), validators.gt(0)])
    #: Calls at load that warm the forward pass up (the first call is slow).
    warmup_calls: int = field(default=3, validator=[validators.instance_of(int), validators.ge(0)])
    #: Torch threads for the model's small serving computations, set around
    #: each and then restored (0: torch's own). One avoids waiting on a
    #: second thread, which on a busy machine costs milliseconds.
    threads: int = field(default=1, validator=[validators.instance_of(int), validators.ge(0)])


#: Settings that change how a trained model serves, not its weights.
SERVING_SETTINGS = (
    "weights",
    "online_batch",
    "online_learning_rate",
    "duplicate_similarity",
    "warmup_calls",
    "threads",
)


def cache_dir() -> Path:
    return Path(os.environ.get("SAGELLM_CACHE") or Path.home() / ".cache" / "sagellm")


def default_weights(settings: TextSettings) -> Path:
    """The cache file for these training settings (any change retrains)."""
    keys = attrs.asdict(settings, filter=lambda a, _: a.name not in SERVING_SETTINGS)
    digest = hashlib.blake2b(repr(sorted(keys.items())).encode(), digest_size=6).hexdigest()
    return cache_dir() / f"lifetime-text-{digest}.pt"


def _word_hash(word: str) -> int:
    value = _WORD_HASHES.get(word)
    if value is None:
        if len(_WORD_HASHES) >= _MAX_WORD_HASHES:
            _WORD_HASHES.clear()
        value = _WORD_HASHES[word] = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
    return value


def text_ids(text: str | None, buckets: int) -> np.ndarray:
    """Hashed word unigrams and bigrams (bucket 0 stands for no text), as
    int64. A word is hashed once (blake2b, the same in every process); a
    bigram's hash mixes its two words' hashes."""
    words = WORD.findall(text.lower())[:MAX_WORDS] if text else []
    if not words:
        return np.zeros(1, dtype=np.int64)
    h = np.fromiter(map(_word_hash, words), dtype=np.uint64, count=len(words))
    bigrams = h[:-1] * _MIX_A + h[1:] * _MIX_B
    bigrams ^= bigrams >> np.uint64(31)
    grams = np.concatenate([h, bigrams])
    return (grams % np.uint64(buckets - 1)).astype(np.int64) + 1


def _torch():
    try:
        import torch
    except ImportError:
        raise ConfigError("lifetime plugin 'text' needs torch: pip install 'sagellm-plugin-lifetime[text]'") from None
    return torch


def build_model(settings: TextSettings):
    torch = _torch()
    members, width = settings.members, settings.dim + len(FEATURE_NAMES)

    class EnsembleHead(torch.nn.Module):
        """``members`` MLPs (input -> hidden -> ReLU -> quantiles) as batched
        matrix products: input (members, n, width) -> (members, n, quantiles)."""

        def __init__(self):
            super().__init__()
            layers = [
                (torch.nn.Linear(width, settings.hidden), torch.nn.Linear(settings.hidden, len(QUANTILE_LEVELS)))
                for _ in range(members)
            ]  # nn.Linear's initialisation, member by member
            self.w1 = torch.nn.Parameter(torch.stack([a.weight.detach().T for a, _ in layers]))
            self.b1 = torch.nn.Parameter(torch.stack([a.bias.detach()[None] for a, _ in layers]))
            self.w2 = torch.nn.Parameter(torch.stack([b.weight.detach().T for _, b in layers]))
            self.b2 = torch.nn.Parameter(torch.stack([b.bias.detach()[None] for _, b in layers]))

        def forward(self, x):
            return torch.baddbmm(self.b2, torch.relu(torch.baddbmm(self.b1, x, self.w1)), self.w2)

    class TextQuantileModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            # One table holds every member's text vectors, side by side.
            self.bag = torch.nn.EmbeddingBag(settings.buckets, members * settings.dim, mode="mean", sparse=True)
            self.head = EnsembleHead()

        def head_input(self, text, numeric):
            """The members' inputs, (members, n, width), from the bag's
            output (n, members * dim) and the features (n, features)."""
            text = text.view(len(numeric), members, settings.dim).transpose(0, 1)
            return torch.cat([text, numeric.expand(members, -1, -1)], 2)

        def members_forward(self, ids, offsets, numeric):
            """Each member's log quantiles, (members, n, quantiles)."""
            return self.head(self.head_input(self.bag(ids, offsets), numeric))

        def forward(self, ids, offsets, numeric):
            """The members' sorted log quantiles, averaged: (n, quantiles)."""
            return self.members_forward(ids, offsets, numeric).sort(2).values.mean(0)

    return TextQuantileModel()


def _batch(torch, rows):
    """(ids, offsets, numeric) tensors for rows of (text ids, features)."""
    lengths = [len(gram_ids) for gram_ids, _ in rows]
    offsets = np.zeros(len(rows), dtype=np.int64)
    np.cumsum(lengths[:-1], out=offsets[1:])
    return (
        torch.from_numpy(np.concatenate([gram_ids for gram_ids, _ in rows]).astype(np.int64, copy=False)),
        torch.from_numpy(offsets),
        torch.tensor([features for _, features in rows], dtype=torch.float32),
    )


def pinball(torch, predicted, target):
    """The pinball loss of quantiles (..., n, quantiles) of targets (n,),
    summed over any leading (member) dimension."""
    levels = torch.tensor(QUANTILE_LEVELS)
    diff = target[:, None] - predicted
    loss = torch.maximum(levels * diff, (levels - 1) * diff)
    return loss.sum() / (target.numel() * len(QUANTILE_LEVELS))


def split_of(settings: TextSettings, requests: Iterable[Request] | None = None) -> Split:
    """The split ``settings`` train on: a temporal one orders the
    conversations of ``requests`` if given, else of the whole workload
    ``settings.train_source``."""
    workload = WorkloadSettings(source=settings.train_source)
    return make_split(settings.split, workload, settings.test_fraction, settings.dev_fraction, requests)


def training_rows(
    settings: TextSettings, requests: Iterable[Request], block_size: int = 16, split: Split | None = None
):
    """(rows, targets, dev flags) of the ``train`` and ``dev`` requests among
    ``requests``; features as the history of those parts stood at each
    arrival (no test reply is seen, not even through a feature)."""
    split = split or split_of(settings)
    history = History(block_size, duplicate_similarity=math.inf)
    rows, targets, dev = [], [], []
    for request in requests:
        part = split.part(request)
        if part == "test":
            continue
        rows.append((text_ids(request.prompt_text, settings.buckets), history.features(request)))
        targets.append(log_tokens(request.output_tokens))
        dev.append(part == "dev")
        history.observe(request, request.output_tokens)
    return rows, targets, dev


def train(
    settings: TextSettings,
    requests: Iterable[Request] | None = None,
    block_size: int = 16,
    log=print,
    split: Split | None = None,
):
    """Fit the ``train`` part of ``requests`` (by default the workload
    ``settings.train_source``), keeping the epoch with the lowest MAE on the
    ``dev`` part. The split is ``split`` if given, else ``settings``' (a
    temporal one ordered over ``requests`` when they are given). Returns the
    model."""
    torch = _torch()
    torch.manual_seed(settings.seed)
    if requests is None:
        from sagellm_core.replay import workloads

        split = split or split_of(settings)
        requests = workloads.load(WorkloadSettings(source=settings.train_source))
    elif split is None:
        if settings.split == "temporal":
            requests = list(requests)  # read twice: the order, then the rows
        split = split_of(settings, requests)
    rows, targets, dev = training_rows(settings, requests, block_size, split)
    fit = [i for i, v in enumerate(dev) if not v]
    check = [i for i, v in enumerate(dev) if v]
    if not fit or not check:
        raise ConfigError(f"lifetime plugin 'text': too few training requests ({len(fit)} train, {len(check)} dev)")
    model = build_model(settings)
    sparse = torch.optim.SparseAdam(list(model.bag.parameters()), lr=settings.learning_rate)
    dense = torch.optim.Adam(model.head.parameters(), lr=settings.learning_rate)
    y = torch.tensor(targets)
    order = torch.Generator().manual_seed(settings.seed)
    best, best_state = float("inf"), None
    for epoch in range(settings.epochs):
        model.train()
        permutation = torch.randperm(len(fit), generator=order).tolist()
        for start in range(0, len(fit), 128):
            index = [fit[i] for i in permutation[start : start + 128]]
            # Each member learns on its own; their average is only for serving.
            loss = pinball(torch, model.members_forward(*_batch(torch, [rows[i] for i in index])), y[index])
            sparse.zero_grad()
            dense.zero_grad()
            loss.backward()
            sparse.step()
            dense.step()
        model.eval()
        with torch.no_grad():
            median = model(*_batch(torch, [rows[i] for i in check]))[:, MEDIAN]
            mae = (torch.expm1(median) - torch.expm1(y[check])).abs().mean().item()
        log(
            f"epoch {epoch + 1}/{settings.epochs}: dev MAE {mae:.1f} tokens"
            f" ({len(fit):,} training requests, {len(check):,} dev, {settings.members} members, {settings.split} split)"
        )
        if mae < best:
            best, best_state = mae, {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    return model


def save(model, settings: TextSettings, path: Path) -> None:
    torch = _torch()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"settings": attrs.asdict(settings), "state": model.state_dict()}, tmp)
    tmp.replace(path)  # never a half-written weights file


def load(settings: TextSettings, path: Path):
    torch = _torch()
    try:
        saved = torch.load(path, weights_only=True)
        model = build_model(settings)
        model.load_state_dict(saved["state"])
    except Exception as exc:  # torch raises many kinds for a bad file; the first line names it
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(f"lifetime plugin 'text': weights {path}: {type(exc).__name__}: {first_line}") from None
    return model


class TextLifetime:
    Settings = TextSettings

    def __init__(self, settings: TextSettings, context: PluginContext):
        torch = _torch()
        self.torch = torch
        self.settings = settings
        self.name = context.name
        path = Path(settings.weights) if settings.weights else default_weights(settings)
        if not path.exists():
            if settings.weights:
                raise ConfigError(f"lifetime plugin 'text': weights {path}: no such file")
            print(f"sagellm: training lifetime model 'text' into {path} (once)", file=sys.stderr)
            model = train(
                settings, block_size=context.block_size, log=lambda m: print(f"sagellm: {m}", file=sys.stderr)
            )
            save(model, settings, path)
        self.model = load(settings, path)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)  # served and updated without autograd
        self.history = History(context.block_size, duplicate_similarity=settings.duplicate_similarity)
        head = list(self.model.head.parameters())
        try:  # fused: one kernel a tensor, about half the time of the default
            self.optimiser = torch.optim.Adam(head, lr=settings.online_learning_rate, fused=True)
        except (RuntimeError, TypeError, ValueError):
            self.optimiser = torch.optim.Adam(head, lr=settings.online_learning_rate)
        #: The sum of the finished requests' gradients since the last step.
        self._grads = [torch.zeros_like(p) for p in head]
        self._accumulated = 0
        # d pinball / d quantile, scaled as one batched step's mean loss.
        scale = 1.0 / (settings.online_batch * len(QUANTILE_LEVELS))
        levels = torch.tensor(QUANTILE_LEVELS)
        self._below, self._above = -levels * scale, (1.0 - levels) * scale
        #: request id -> the members' input (members, 1, width) until it
        #: finishes: about 3 KB each, so fewer are kept than by the others.
        self._pending = PendingFeatures(limit=20_000)
        self._warm_up(settings.warmup_calls)

    def _row(self, request: Request) -> tuple[np.ndarray, list[float]]:
        return text_ids(request.prompt_text, self.settings.buckets), self.history.features(request)

    def _warm_up(self, calls: int) -> None:
        """Run the serving path on made-up rows (state untouched), so that
        the first real request does not pay for torch's lazy set-up."""
        if calls <= 0:
            return
        row = (text_ids("warm up the text model", self.settings.buckets), [0.5] * len(FEATURE_NAMES))
        for _ in range(calls):
            for n in (1, 2, 8, 64):
                _, x = self._forward([row] * n)
            self._gradient(x[:, :1], 1.0, accumulate=False)
        if self.history.prompts is not None:
            self.history.prompts.signature(list(range(64)))

    def _threads(self) -> int:
        """Switch torch to ``threads``; returns the count to restore."""
        before = self.torch.get_num_threads()
        if self.settings.threads and before != self.settings.threads:
            self.torch.set_num_threads(self.settings.threads)
        return before

    def _restore(self, before: int) -> None:
        if self.settings.threads and before != self.settings.threads:
            self.torch.set_num_threads(before)

    def _forward(self, rows):
        """The averaged log quantiles of ``rows`` (a list per row), and the
        members' input (members, n, width): what the online update needs."""
        torch = self.torch
        before = self._threads()
        try:
            with torch.inference_mode():
                ids, offsets, numeric = _batch(torch, rows)
                x = self.model.head_input(self.model.bag(ids, offsets), numeric)
                return self.model.head(x).sort(2).values.mean(0).tolist(), x
        finally:
            self._restore(before)

    def predict_batch(self, requests: Sequence[Request]) -> list[LifetimePrediction]:
        """Predictions for requests that arrive together (one step): one
        forward pass for all; each sees the state as it stood before any of
        them, so it is what the hook would answer for each alone."""
        if not requests:
            return []
        rows = [self._row(request) for request in requests]
        log_quantiles, x = self._forward(rows)
        out = []
        for i, (request, quantiles) in enumerate(zip(requests, log_quantiles)):
            self._pending[request.request_id] = x[:, i : i + 1]
            out.append(prediction(quantiles, self.name, log_median=self.history.near_duplicate(request)))
        return out

    @hookimpl
    def sagellm_predict_lifetime(self, request: Request) -> LifetimePrediction:
        return self.predict_batch((request,))[0]

    @hookimpl
    def sagellm_request_finished(self, outcome: RequestOutcome) -> None:
        request = outcome.request
        pending = self._pending.pop(request.request_id, None)
        if pending is not None and self.settings.online_learning_rate > 0:
            self._gradient(pending, log_tokens(outcome.num_output_tokens))
            self._accumulated += 1
            if self._accumulated >= self.settings.online_batch:
                self._step()
        self.history.observe(request, outcome.num_output_tokens)

    def _gradient(self, x, target: float, accumulate: bool = True) -> None:
        """Add the gradient of one request's pinball loss (summed over
        members, divided by ``online_batch`` and the quantiles, as in one
        batched step) with respect to the head, in closed form: a few small
        matrix products, a bounded cost per finished request. ``x`` is the
        members' input for the request (members, 1, width) as predicted: the
        text table does not learn online, so it still holds."""
        torch = self.torch
        head = self.model.head
        before = self._threads()
        try:
            with torch.no_grad():
                pre = torch.baddbmm(head.b1, x, head.w1)  # (members, 1, hidden)
                hidden = torch.relu(pre)
                q = torch.baddbmm(head.b2, hidden, head.w2)  # (members, 1, quantiles)
                # d pinball / d q: -level where the target is above, 1 - level below.
                dq = torch.where(q < target, self._below, self._above)
                dhidden = torch.bmm(dq, head.w2.transpose(1, 2)).mul_(pre > 0)
                if accumulate:
                    w1, b1, w2, b2 = self._grads
                    w1.baddbmm_(x.transpose(1, 2), dhidden)
                    b1.add_(dhidden)
                    w2.baddbmm_(hidden.transpose(1, 2), dq)
                    b2.add_(dq)
        finally:
            self._restore(before)

    def _step(self) -> None:
        """One optimiser step on the head with the summed gradients; the text
        table stays as trained."""
        head = list(self.model.head.parameters())
        for p, total in zip(head, self._grads):
            p.grad = total
        before = self._threads()
        try:
            self.optimiser.step()
            for p, total in zip(head, self._grads):
                p.grad = None
                total.zero_()
        finally:
            self._restore(before)
        self._accumulated = 0
