"""``sagellm lifetime evaluate``: every predictor on one held-out split.

The workload (ShareGPT by default: real text, real reply lengths) streams in
arrival order. A request of a training conversation (:mod:`.split`) is only
observed as finished, so online predictors learn from it. A request of a
held-out conversation is first predicted (timed), then observed: the
prequential protocol of an online predictor in an engine, which learns from
every finished request. A predictor trained offline (``text``) trains on the
training conversations only.

Figures per predictor, over the held-out requests:

* ``mae``: mean |predicted median - true output tokens|;
* ``acc10``: the share predicted within 10% of the truth;
* ``latency_ms``: prediction time per request, measured over batches of 64
  consecutive held-out requests (wall time of the batch's calls / 64);
* ``coverage80``: the share inside the predicted 10%-90% interval;
* ``mean_confidence``, and ``mae_confident`` over the share
  (``confident_share``) at confidence >= 0.5;
* ``remaining_mae``: for requests longer than ``g`` tokens, the error of the
  remaining length predicted after ``g`` generated tokens, refined (the
  prediction's distribution conditioned on having reached ``g``) and naive
  (the first prediction minus ``g``).

The baseline row predicts the median output length of the training requests.
"""

from __future__ import annotations

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

from .split import TEST_FRACTION, held_out

BATCH = 64
REFINE_AT = (64, 256)
DEFAULT_WORKLOAD = WorkloadSettings(source="sharegpt")


@attrs.define
class Scores:
    """Running figures of one predictor."""

    name: str
    abs_errors: list[float] = attrs.field(factory=list)
    within10: int = 0
    covered: int = 0
    confidences: list[float] = attrs.field(factory=list)
    confident_errors: list[float] = attrs.field(factory=list)
    batch_s: list[float] = attrs.field(factory=list)
    #: g -> [refined errors, naive errors]
    remaining: dict[int, tuple[list[float], list[float]]] = attrs.field(
        factory=lambda: {g: ([], []) for g in REFINE_AT}
    )
    error: str | None = None

    def add(self, prediction: LifetimePrediction, true_tokens: int) -> None:
        error = abs(prediction.output_tokens - true_tokens)
        self.abs_errors.append(error)
        self.within10 += error <= 0.1 * true_tokens
        self.covered += prediction.low_tokens <= true_tokens <= prediction.high_tokens
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
        return {
            "predictor": self.name,
            "requests": n,
            "mae": round(mean(self.abs_errors), 2),
            "acc10": round(self.within10 / n, 4),
            "latency_ms": round(1e3 * sum(self.batch_s) / n, 4) if self.batch_s else None,
            "coverage80": round(self.covered / n, 4),
            "mean_confidence": round(mean(self.confidences), 4),
            "confident_share": round(len(self.confident_errors) / n, 4),
            "mae_confident": round(mean(self.confident_errors), 2) if self.confident_errors else None,
            "remaining_mae": {
                str(g): {"refined": round(mean(r), 2), "naive": round(mean(v), 2), "requests": len(r)}
                for g, (r, v) in self.remaining.items()
                if r
            },
        }


def build_predictor(name: str, workload: WorkloadSettings, block_size: int = 16):
    where = "sagellm lifetime evaluate"
    cls, _ = load_class("lifetime", name, where)
    settings = build_settings(cls, {}, f"{where}: predictor {name!r}")
    return cls(settings, PluginContext(name, block_size, 1, workload.seed, workload))


def _outcome(request: Request, prediction: LifetimePrediction | None) -> RequestOutcome:
    return RequestOutcome(
        request, request.output_tokens, 0, request.arrival_s, request.arrival_s, request.arrival_s, 0, prediction
    )


def evaluate(
    names: Sequence[str],
    workload: WorkloadSettings = DEFAULT_WORKLOAD,
    fraction: float = TEST_FRACTION,
    progress: bool = False,
) -> list[dict]:
    """Figures for each predictor ``names``, then the median baseline."""
    predictors = {}
    scores = {name: Scores(name) for name in names}
    for name in names:
        try:
            predictors[name] = build_predictor(name, workload)
        except SagellmError:
            raise
        except Exception as exc:  # a predictor that cannot start is reported, not fatal
            scores[name].error = f"failed to start: {type(exc).__name__}: {exc}"
    train_outputs: list[int] = []
    test_outputs: list[int] = []
    batch: list[Request] = []

    def flush() -> None:
        for name, predictor in predictors.items():
            if scores[name].error is not None:
                continue
            predictions = []
            try:
                start = time.perf_counter()
                for request in batch:
                    predictions.append(predictor.sagellm_predict_lifetime(request=request))
                scores[name].batch_s.append(time.perf_counter() - start)
                for request, prediction in zip(batch, predictions):
                    problem = prediction.problem() if isinstance(prediction, LifetimePrediction) else "not a prediction"
                    if problem:
                        raise ValueError(f"returned {prediction!r}: {problem}")
                    scores[name].add(prediction, request.output_tokens)
                    predictor.sagellm_request_finished(outcome=_outcome(request, prediction))
            except Exception as exc:
                scores[name].error = f"{type(exc).__name__}: {exc}"
        test_outputs.extend(r.output_tokens for r in batch)
        batch.clear()

    sessions_in_batch: set[str] = set()
    for request in _stream(workload, progress):
        if held_out(request, fraction):
            # A turn whose conversation is already in the batch waits for the
            # batch to finish, as it would wait for its predecessor's reply.
            if request.session_id in sessions_in_batch:
                flush()
                sessions_in_batch.clear()
            batch.append(request)
            if request.session_id is not None:
                sessions_in_batch.add(request.session_id)
            if len(batch) == BATCH:
                flush()
                sessions_in_batch.clear()
            continue
        train_outputs.append(request.output_tokens)
        for name, predictor in predictors.items():
            if scores[name].error is None:
                predictor.sagellm_request_finished(outcome=_outcome(request, None))
    flush()
    rows = [scores[name].figures() for name in names]
    median = statistics.median(train_outputs) if train_outputs else 0
    errors = [abs(median - t) for t in test_outputs]
    rows.append(
        {
            "predictor": f"median of training requests ({median:g})",
            "requests": len(errors),
            "mae": round(statistics.fmean(errors), 2) if errors else None,
            "acc10": round(sum(e <= 0.1 * t for e, t in zip(errors, test_outputs)) / len(errors), 4)
            if errors
            else None,
        }
    )
    return rows


def _stream(workload: WorkloadSettings, progress: bool) -> Iterable[Request]:
    requests = workloads.load(workload)
    if not progress:
        return requests
    from rich.progress import track

    return track(requests, description="evaluating", total=workloads.count(workload), transient=True)


def print_rows(rows: list[dict], console: Console | None = None) -> None:
    table = Table(title="lifetime predictors on the held-out split")
    columns = [
        "predictor",
        "requests",
        "mae",
        "acc10",
        "latency_ms",
        "coverage80",
        "mean_confidence",
        "mae_confident",
        "confident_share",
    ]
    for column in columns:
        table.add_column(column, justify="left" if column == "predictor" else "right")
    for row in rows:
        table.add_row(*("-" if row.get(c) is None else str(row[c]) for c in columns))
    console = console or Console()
    console.print(table)
    for row in rows:
        for g, r in row.get("remaining_mae", {}).items():
            console.print(
                f"{row['predictor']}: remaining tokens after {g} generated ({r['requests']:,} requests):"
                f" MAE {r['refined']} refined, {r['naive']} naive"
            )
        if row.get("error"):
            console.print(f"[red]{row['predictor']}: {row['error']}")


def write_json(rows: list[dict], path: str) -> None:
    with open(path, "w") as fh:
        json.dump(rows, fh, indent=2)


def available() -> list[str]:
    return sorted(installed("sagellm.lifetime"))
