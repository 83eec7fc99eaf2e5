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

Training (``sagellm lifetime train``, or on first use when no weights file
exists) streams a workload, by default ShareGPT, and learns from its training
conversations (:mod:`.split`); a tenth of those is kept for early stopping.
Seeded, so the same command gives the same weights. In service the head
keeps learning online: every ``online_batch`` finished requests make one
small optimiser step on what they were predicted from.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

import attrs
from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.config import WorkloadSettings
from sagellm_core.errors import ConfigError
from sagellm_core.types import QUANTILE_LEVELS, LifetimePrediction, Request, RequestOutcome

from .features import FEATURE_NAMES, History, PendingFeatures, log_tokens
from .quantiles import MEDIAN, prediction
from .split import held_out

WORD = re.compile(r"\w+|[^\w\s]")
MAX_WORDS = 256
#: Salt of the validation draw inside the training conversations.
VALIDATION_SALT = "validation:"


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


#: Settings that change how a trained model serves, not its weights.
SERVING_SETTINGS = ("weights", "online_batch", "online_learning_rate", "duplicate_similarity")


def cache_dir() -> Path:
    return Path(os.environ.get("SAGELLM_CACHE") or Path.home() / ".cache" / "sagellm")


def default_weights(settings: TextSettings) -> Path:
    """The cache file for these training settings (any change retrains)."""
    keys = attrs.asdict(settings, filter=lambda a, _: a.name not in SERVING_SETTINGS)
    digest = hashlib.blake2b(repr(sorted(keys.items())).encode(), digest_size=6).hexdigest()
    return cache_dir() / f"lifetime-text-{digest}.pt"


def text_ids(text: str | None, buckets: int) -> list[int]:
    """Hashed word unigrams and bigrams (bucket 0 stands for no text)."""
    if not text:
        return [0]
    words = WORD.findall(text.lower())[:MAX_WORDS]
    grams = [*words, *(f"{a} {b}" for a, b in zip(words, words[1:]))]
    return [
        1 + int.from_bytes(hashlib.blake2b(g.encode(), digest_size=4).digest(), "little") % (buckets - 1) for g in grams
    ] or [0]


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

        def members_forward(self, ids, offsets, numeric):
            """Each member's log quantiles, (members, n, quantiles)."""
            text = self.bag(ids, offsets).view(len(numeric), members, settings.dim).transpose(0, 1)
            return self.head(torch.cat([text, numeric.expand(members, -1, -1)], 2))

        def forward(self, ids, offsets, numeric):
            """The members' sorted log quantiles, averaged: (n, quantiles)."""
            return self.members_forward(ids, offsets, numeric).sort(2).values.mean(0)

    return TextQuantileModel()


def _batch(torch, rows):
    """(ids, offsets, numeric) tensors for rows of (text ids, features)."""
    ids, offsets, start = [], [], 0
    for gram_ids, _ in rows:
        offsets.append(start)
        ids.extend(gram_ids)
        start += len(gram_ids)
    return (
        torch.tensor(ids, dtype=torch.long),
        torch.tensor(offsets, dtype=torch.long),
        torch.tensor([features for _, features in rows], dtype=torch.float32),
    )


def pinball(torch, predicted, target):
    """The pinball loss of quantiles (..., n, quantiles) of targets (n,),
    summed over any leading (member) dimension."""
    levels = torch.tensor(QUANTILE_LEVELS)
    diff = target[:, None] - predicted
    loss = torch.maximum(levels * diff, (levels - 1) * diff)
    return loss.sum() / (target.numel() * len(QUANTILE_LEVELS))


def training_rows(settings: TextSettings, requests: Iterable[Request], block_size: int = 16):
    """(rows, targets, validation flags) of the training conversations among
    ``requests``, features as the history of training conversations stood
    at each arrival (no held-out reply is seen, not even through a feature)."""
    history = History(block_size, duplicate_similarity=math.inf)
    rows, targets, validation = [], [], []
    for request in requests:
        if held_out(request):
            continue
        rows.append((text_ids(request.prompt_text, settings.buckets), history.features(request)))
        targets.append(log_tokens(request.output_tokens))
        key = VALIDATION_SALT + (request.session_id or request.request_id)
        validation.append(hashlib.blake2b(key.encode(), digest_size=1).digest()[0] < 26)  # ~10%
        history.observe(request, request.output_tokens)
    return rows, targets, validation


def train(settings: TextSettings, requests: Iterable[Request] | None = None, block_size: int = 16, log=print):
    """Train on the training conversations of ``requests`` (by default the
    workload ``settings.train_source``); keep the epoch with the lowest
    validation MAE. Returns the model."""
    torch = _torch()
    torch.manual_seed(settings.seed)
    if requests is None:
        from sagellm_core.replay import workloads

        requests = workloads.load(WorkloadSettings(source=settings.train_source))
    rows, targets, validation = training_rows(settings, requests, block_size)
    fit = [i for i, v in enumerate(validation) if not v]
    check = [i for i, v in enumerate(validation) if v]
    if not fit or not check:
        raise ConfigError(f"lifetime plugin 'text': too few training requests ({len(rows)})")
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
            f"epoch {epoch + 1}/{settings.epochs}: validation MAE {mae:.1f} tokens"
            f" ({len(fit):,} training requests, {settings.members} members)"
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
        self.history = History(context.block_size, duplicate_similarity=settings.duplicate_similarity)
        self.optimiser = torch.optim.Adam(self.model.head.parameters(), lr=settings.online_learning_rate)
        self._pending = PendingFeatures()
        self._finished: list[tuple[tuple[list[int], list[float]], float]] = []

    def _row(self, request: Request) -> tuple[list[int], list[float]]:
        return text_ids(request.prompt_text, self.settings.buckets), self.history.features(request)

    @hookimpl
    def sagellm_predict_lifetime(self, request: Request) -> LifetimePrediction:
        row = self._row(request)
        self._pending[request.request_id] = row
        with self.torch.no_grad():
            log_quantiles = self.model(*_batch(self.torch, [row]))[0].tolist()
        return prediction(log_quantiles, self.name, log_median=self.history.near_duplicate(request))

    @hookimpl
    def sagellm_request_finished(self, outcome: RequestOutcome) -> None:
        request = outcome.request
        row = self._pending.pop(request.request_id, None)
        if row is not None and self.settings.online_learning_rate > 0:
            self._finished.append((row, log_tokens(outcome.num_output_tokens)))
            if len(self._finished) >= self.settings.online_batch:
                self._learn()
        self.history.observe(request, outcome.num_output_tokens)

    def _learn(self) -> None:
        torch = self.torch
        rows = [row for row, _ in self._finished]
        target = torch.tensor([t for _, t in self._finished])
        self._finished.clear()
        self.model.train()
        loss = pinball(torch, self.model.members_forward(*_batch(torch, rows)), target)
        self.optimiser.zero_grad()
        self.model.bag.zero_grad()
        loss.backward()
        self.optimiser.step()  # the head only: the text table stays as trained
        self.model.eval()
