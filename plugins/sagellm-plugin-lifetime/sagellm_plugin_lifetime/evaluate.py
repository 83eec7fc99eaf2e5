"""``sagellm lifetime evaluate``: every predictor on the test part of a split.

The split (:mod:`.split`) is by whole conversation: ``conversation`` (a hash
of the conversation id) or ``temporal`` (the last conversations to arrive
are the test). Predictors whose settings name a split (``text``) are built
on the same one, so the model never trained on a conversation it is scored
on, whatever ``--test-fraction`` says.

The workload (ShareGPT by default: real text, real reply lengths) is played
as events in time. Each conversation is a closed loop: a turn arrives at the
later of its own arrival and its predecessor's finish (a user reads the
reply before writing again), and finishes ``decode_s_per_token`` per output
token later. A request of the ``train`` or ``dev`` part is only observed when
it finishes, so online predictors learn from it. A request of the ``test``
part is predicted when it arrives, then observed when it finishes: the
prequential protocol of an online predictor in an engine. Everything a
predictor remembers (conversation history, near-duplicate prompts, online
steps) is fed strictly in finish order: a turn is only visible to
predictions of requests that arrive after it finished. The test requests
that arrive between two finishes (at most 64) are predicted together, with
the predictor's ``predict_batch`` where it has one (one forward pass), else
one hook call each.

Figures per predictor, over the test requests, and again over those whose
prompt is not token-for-token equal to the prompt of a train or dev request
(``no_repeat``: exact repeats are regenerated or re-shared conversations,
predicted from the earlier reply's length):

* ``mae``: mean |predicted median - true output tokens|;
* ``acc10``: the share predicted within 10% of the truth;
* ``coverage80``: the share inside the predicted 10%-90% interval;
* ``latency_ms``: prediction time per request (wall time of each group's
  prediction / its size; ``benchmarks/lifetime_latency.py`` gives p50/p99);
* ``mean_confidence``, and ``mae_confident`` over the share
  (``confident_share``) at confidence >= 0.5;
* ``remaining_mae``: for requests longer than ``g`` tokens, the error of the
  remaining length predicted after ``g`` generated tokens, refined (the
  prediction's distribution conditioned on having reached ``g``) and naive
  (the first prediction minus ``g``).

The baseline row predicts the median output length of the train requests.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import statistics
import time
from collections.abc import Iterable, Sequence

import attrs
from rich.console import Console
from rich.table import Table

from sagellm_core.config import WorkloadSettings
from sagellm_core.errors import SagellmError
from sagellm_core.registry import PluginContext, build_settings, installed, load_class
from sagellm_core.replay import workloads
from sagellm_core.types import LifetimePrediction, Request, RequestOutcome

from .split import DEV_FRACTION, TEST_FRACTION, Split, arrival_order, conversation_id, make_split

BATCH = 64
REFINE_AT = (64, 256)
#: Decoding time per output token in the evaluation's closed loop (50
#: tokens/s a sequence): when a reply finishes, and so when it is known.
DECODE_S_PER_TOKEN = 0.02
#: Settings a predictor may have that must follow the evaluated split.
SPLIT_SETTINGS = ("split", "test_fraction", "dev_fraction")


def prompt_digest(request: Request) -> bytes:
    return hashlib.blake2b(request.prompt_token_ids.tobytes(), digest_size=16).digest()


def _subset_figures(errors, within10, covered) -> dict:
    n = len(errors)
    if not n:
        return {"requests": 0}
    return {
        "requests": n,
        "mae": round(statistics.fmean(errors), 2),
        "acc10": round(sum(within10) / n, 4),
        "coverage80": round(sum(covered) / n, 4) if covered is not None else None,
    }


@attrs.define
class Scores:
    """Running figures of one predictor."""

    name: str
    abs_errors: list[float] = attrs.field(factory=list)
    within10: list[bool] = attrs.field(factory=list)
    covered: list[bool] = attrs.field(factory=list)
    repeats: list[bool] = attrs.field(factory=list)
    confidences: list[float] = attrs.field(factory=list)
    confident_errors: list[float] = attrs.field(factory=list)
    batch_s: list[float] = attrs.field(factory=list)
    #: g -> [refined errors, naive errors]
    remaining: dict[int, tuple[list[float], list[float]]] = attrs.field(
        factory=lambda: {g: ([], []) for g in REFINE_AT}
    )
    error: str | None = None

    def add(self, prediction: LifetimePrediction, true_tokens: int, repeat: bool = False) -> None:
        error = abs(prediction.output_tokens - true_tokens)
        self.abs_errors.append(error)
        self.within10.append(error <= 0.1 * true_tokens)
        self.covered.append(prediction.low_tokens <= true_tokens <= prediction.high_tokens)
        self.repeats.append(repeat)
        self.confidences.append(prediction.confidence)
        if prediction.confidence >= 0.5:
            self.confident_errors.append(error)
        for g, (refined, naive) in self.remaining.items():
            if true_tokens > g:
                left = true_tokens - g
                refined.append(abs(prediction.remaining_tokens(g) - left))
                naive.append(abs(max(1.0, prediction.output_tokens - g) - left))

    def figures(self) -> dict:
        n = len(self.abs_errors)
        if self.error is not None or n == 0:
            return {"predictor": self.name, "error": self.error or "no predictions", "requests": n}
        mean = statistics.fmean
        keep = [not r for r in self.repeats]
        return {
            "predictor": self.name,
            **_subset_figures(self.abs_errors, self.within10, self.covered),
            "latency_ms": round(1e3 * sum(self.batch_s) / n, 4) if self.batch_s else None,
            "mean_confidence": round(mean(self.confidences), 4),
            "confident_share": round(len(self.confident_errors) / n, 4),
            "mae_confident": round(mean(self.confident_errors), 2) if self.confident_errors else None,
            "remaining_mae": {
                str(g): {"refined": round(mean(r), 2), "naive": round(mean(v), 2), "requests": len(r)}
                for g, (r, v) in self.remaining.items()
                if r
            },
            "no_repeat": _subset_figures(
                [e for e, k in zip(self.abs_errors, keep) if k],
                [w for w, k in zip(self.within10, keep) if k],
                [c for c, k in zip(self.covered, keep) if k],
            ),
        }


def build_predictor(name: str, workload: WorkloadSettings, block_size: int = 16, split: Split | None = None):
    """The predictor ``name`` with its default settings, but for any of
    :data:`SPLIT_SETTINGS` it has: those follow ``split``."""
    where = "sagellm lifetime evaluate"
    cls, _ = load_class("lifetime", name, where)
    params = {}
    settings_cls = getattr(cls, "Settings", None)
    if split is not None and settings_cls is not None and attrs.has(settings_cls):
        accepted = attrs.fields_dict(settings_cls)
        values = {"split": split.kind, "test_fraction": split.test_fraction, "dev_fraction": split.dev_fraction}
        params = {key: values[key] for key in SPLIT_SETTINGS if key in accepted}
    settings = build_settings(cls, params, f"{where}: predictor {name!r}")
    return cls(settings, PluginContext(name, block_size, 1, workload.seed, workload))


def predict_group(predictor, requests: Sequence[Request]) -> list:
    """One group's predictions: ``predict_batch`` (one forward pass) where
    the predictor has it, else the hook once a request."""
    batched = getattr(predictor, "predict_batch", None)
    if batched is not None:
        return list(batched(requests))
    return [predictor.sagellm_predict_lifetime(request=request) for request in requests]


def _outcome(request: Request, prediction: LifetimePrediction | None, arrival: float, finish: float) -> RequestOutcome:
    return RequestOutcome(request, request.output_tokens, 0, arrival, arrival, finish, 0, prediction)


def timeline(requests: Iterable[Request], decode_s_per_token: float = DECODE_S_PER_TOKEN):
    """The closed loop as events in time order: (time, kind, request,
    arrival, finish), kind ``"finish"`` or ``"arrive"``; a finish and an
    arrival at the same time come finish first. A turn arrives at the later
    of its own arrival and its conversation's previous finish."""
    if decode_s_per_token <= 0:
        raise ValueError(f"decode_s_per_token = {decode_s_per_token!r}: positive")
    last_finish: dict[str, float] = {}
    heap: list = []
    seq = 0
    for request in requests:
        now = request.arrival_s
        # Every event still to come is at or after ``now``.
        while heap and heap[0][0] < now:
            time_s, _, _, kind, r, arrival, finish = heapq.heappop(heap)
            yield time_s, kind, r, arrival, finish
        arrival = max(now, last_finish.get(request.session_id, now)) if request.session_id is not None else now
        finish = arrival + decode_s_per_token * max(1, request.output_tokens)
        if request.session_id is not None:
            last_finish[request.session_id] = finish
        heapq.heappush(heap, (arrival, 1, seq, "arrive", request, arrival, finish))
        heapq.heappush(heap, (finish, 0, seq, "finish", request, arrival, finish))
        seq += 1
    while heap:
        time_s, _, _, kind, r, arrival, finish = heapq.heappop(heap)
        yield time_s, kind, r, arrival, finish


class _Run:
    """The predictors of one evaluation and what they have been scored on."""

    def __init__(self, names: Sequence[str], workload: WorkloadSettings, split: Split, known_prompts: set[bytes]):
        self.split = split
        self.known_prompts = known_prompts
        self.predictors = {}
        self.scores = {name: Scores(name) for name in names}
        for name in names:
            try:
                self.predictors[name] = build_predictor(name, workload, split=split)
            except SagellmError:
                raise
            except Exception as exc:  # a predictor that cannot start is reported, not fatal
                self.scores[name].error = f"failed to start: {type(exc).__name__}: {exc}"
        self.train_outputs: list[int] = []
        self.test_outputs: list[tuple[int, bool]] = []
        #: Test requests arrived since the last finish, not yet predicted.
        self.batch: list[Request] = []
        self.predicted: dict[str, dict[str, LifetimePrediction]] = {name: {} for name in self.predictors}

    def live(self):
        return [(n, p) for n, p in self.predictors.items() if self.scores[n].error is None]

    def arrive(self, request: Request) -> None:
        self.batch.append(request)
        if len(self.batch) == BATCH:
            self.flush()

    def flush(self) -> None:
        batch = self.batch
        if not batch:
            return
        repeats = [prompt_digest(r) in self.known_prompts for r in batch]
        for name, predictor in self.live():
            scores = self.scores[name]
            try:
                start = time.perf_counter()
                predictions = predict_group(predictor, batch)
                scores.batch_s.append(time.perf_counter() - start)
                if len(predictions) != len(batch):
                    raise ValueError(f"{len(predictions)} predictions for {len(batch)} requests")
                for request, prediction, repeat in zip(batch, predictions, repeats):
                    problem = prediction.problem() if isinstance(prediction, LifetimePrediction) else "not a prediction"
                    if problem:
                        raise ValueError(f"returned {prediction!r}: {problem}")
                    scores.add(prediction, request.output_tokens, repeat)
                    self.predicted[name][request.request_id] = prediction
            except Exception as exc:
                scores.error = f"{type(exc).__name__}: {exc}"
        self.test_outputs.extend((r.output_tokens, repeat) for r, repeat in zip(batch, repeats))
        self.batch = []

    def finish(self, request: Request, part: str, arrival: float, finish: float) -> None:
        self.flush()  # what arrived before this finish is predicted without it
        if part == "train":
            self.train_outputs.append(request.output_tokens)
        for name, predictor in self.live():
            prediction = self.predicted[name].pop(request.request_id, None)
            try:
                predictor.sagellm_request_finished(outcome=_outcome(request, prediction, arrival, finish))
            except Exception as exc:
                self.scores[name].error = f"{type(exc).__name__}: {exc}"

    def rows(self, names: Sequence[str]) -> list[dict]:
        rows = [{**self.scores[name].figures(), "split": self.split.kind} for name in names]
        rows.append(_baseline(self.train_outputs, self.test_outputs, self.split.kind))
        return rows


def evaluate(
    names: Sequence[str],
    workload: WorkloadSettings | None = None,
    fraction: float = TEST_FRACTION,
    progress: bool = False,
    split: str = "conversation",
    dev_fraction: float = DEV_FRACTION,
    decode_s_per_token: float = DECODE_S_PER_TOKEN,
) -> list[dict]:
    """Figures for each predictor ``names`` on the test part of the
    ``split`` split (``fraction`` of the conversations), then the median
    baseline's. ``workload``: ShareGPT's conversations unless given (built
    here, not at import: the source is checked against what is installed)."""
    if workload is None:
        workload = WorkloadSettings(source="sharegpt")
    # One pass first: the conversations in order and the prompts of the
    # train and dev parts (what an exact repeat repeats).
    seen = [(conversation_id(r), prompt_digest(r)) for r in workloads.load(workload)]
    if split == "temporal" and workload.max_requests is None:
        the_split = Split("temporal", fraction, dev_fraction, arrival_order(c for c, _ in seen))
    else:
        the_split = make_split(split, workload, fraction, dev_fraction)
    run = _Run(names, workload, the_split, {d for c, d in seen if the_split.part_of(c) != "test"})
    del seen
    for _, kind, request, arrival, finish in timeline(_stream(workload, progress), decode_s_per_token):
        part = the_split.part(request)
        if kind == "finish":
            run.finish(request, part, arrival, finish)
        elif part == "test":
            run.arrive(request)
    run.flush()
    return run.rows(names)


def _baseline(train_outputs: list[int], test_outputs: list[tuple[int, bool]], split: str) -> dict:
    median = statistics.median(train_outputs) if train_outputs else 0

    def figures(outputs: list[int]) -> dict:
        errors = [abs(median - t) for t in outputs]
        return _subset_figures(errors, [e <= 0.1 * t for e, t in zip(errors, outputs)], None)

    every = figures([t for t, _ in test_outputs])
    every.pop("coverage80", None)
    no_repeat = figures([t for t, repeat in test_outputs if not repeat])
    no_repeat.pop("coverage80", None)
    return {"predictor": f"median of training requests ({median:g})", **every, "split": split, "no_repeat": no_repeat}


def _stream(workload: WorkloadSettings, progress: bool) -> Iterable[Request]:
    requests = workloads.load(workload)
    if not progress:
        return requests
    from rich.progress import track

    return track(requests, description="evaluating", total=workloads.count(workload), transient=True)


def _table(title: str, rows: list[dict], columns: list[str], within: str | None = None) -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column == "predictor" else "right")
    for row in rows:
        source = row.get(within) or {} if within else row
        cells = [row["predictor"]] + ["-" if source.get(c) is None else str(source[c]) for c in columns[1:]]
        table.add_row(*cells)
    return table


def print_rows(rows: list[dict], console: Console | None = None) -> None:
    split = rows[0].get("split", "conversation") if rows else "conversation"
    console = console or Console()
    every = ["predictor", "requests", "mae", "acc10", "coverage80", "latency_ms", "mean_confidence"]
    console.print(_table(f"lifetime predictors on the test part of the {split} split", rows, every))
    console.print(
        _table(
            "the same without exact repeats (prompts token-for-token equal to a train or dev prompt)",
            rows,
            ["predictor", "requests", "mae", "acc10", "coverage80"],
            within="no_repeat",
        )
    )
    for row in rows:
        for g, r in row.get("remaining_mae", {}).items():
            console.print(
                f"{row['predictor']}: remaining tokens after {g} generated ({r['requests']:,} requests):"
                f" MAE {r['refined']} refined, {r['naive']} naive"
            )
        if row.get("mae_confident") is not None:
            console.print(
                f"{row['predictor']}: MAE {row['mae_confident']} at confidence >= 0.5"
                f" ({row['confident_share']:.1%} of requests)"
            )
        if row.get("error"):
            console.print(f"[red]{row['predictor']}: {row['error']}")


def write_json(rows: list[dict], path: str) -> None:
    with open(path, "w") as fh:
        json.dump(rows, fh, indent=2)


def available() -> list[str]:
    return sorted(installed("sagellm.lifetime"))
