"""What limits the ``text`` lifetime predictor on ShareGPT: a study for
issue 6's goal (MAE of 100 tokens or less on the held-out split).

    python3 benchmarks/lifetime_study.py

Needs torch and the ShareGPT workload (``tox -e lifetime`` has both). It
prints:

1. the learning curve: the model trained on 1/8, 1/4, 1/2 and all of the
   training conversations (nested, drawn by conversation), its held-out MAE
   and how much each doubling of the data gains;
2. one member against the average of ``members``, on all the data;
3. near-duplicate prompts: the share of held-out turns whose prompt nearly
   repeats an earlier one, and the error of that one's reply length against
   the model's on them.

The held-out figures are offline: each held-out turn is predicted with the
features the evaluation gives it (every earlier reply known), but with no
online step and no near-duplicate answer, so that (1) and (2) measure the
trained model alone. ``sagellm lifetime evaluate`` gives the served figures.
About 10 minutes on two cores.
"""

from __future__ import annotations

import hashlib
import math
import statistics

import attrs
import torch
from sagellm_plugin_lifetime import text
from sagellm_plugin_lifetime.features import History
from sagellm_plugin_lifetime.quantiles import MEDIAN
from sagellm_plugin_lifetime.split import held_out

from sagellm_core.config import WorkloadSettings
from sagellm_core.replay import workloads

FRACTIONS = (1 / 8, 1 / 4, 1 / 2, 1.0)


def _draw(request) -> float:
    """The conversation's place in the nested subsets, in [0, 1)."""
    key = f"study:{request.session_id or request.request_id}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") / 2**32


def held_out_rows(settings: text.TextSettings, requests):
    """Rows and true lengths of the held-out turns, with near-duplicate
    answers (log length or None) as evaluation's history would give them."""
    history = History(16)
    rows, truths, duplicates = [], [], []
    for request in requests:
        if held_out(request):
            rows.append((text.text_ids(request.prompt_text, settings.buckets), history.features(request)))
            truths.append(request.output_tokens)
            duplicates.append(history.near_duplicate(request))
        history.observe(request, request.output_tokens)
    return rows, truths, duplicates


def medians(model, rows) -> list[float]:
    model.eval()
    with torch.no_grad():
        out = torch.cat([model(*text._batch(torch, rows[i : i + 2048])) for i in range(0, len(rows), 2048)])
    return torch.expm1(out[:, MEDIAN]).tolist()


def mae(predicted, truths) -> float:
    return statistics.fmean(abs(p - t) for p, t in zip(predicted, truths))


def main() -> None:
    settings = text.TextSettings()
    requests = list(workloads.load(WorkloadSettings(source="sharegpt")))
    rows, truths, duplicates = held_out_rows(settings, requests)
    print(f"{len(requests):,} requests, {len(rows):,} held out; members={settings.members}, epochs={settings.epochs}")

    print("\n1. learning curve (held-out MAE, offline)")
    print(f"{'fraction':>9} {'training requests':>18} {'MAE':>8} {'gain':>7}")
    previous = None
    for fraction in FRACTIONS:
        subset = [r for r in requests if held_out(r) or _draw(r) < fraction]
        trained = sum(not held_out(r) for r in subset)
        model = text.train(settings, subset, log=lambda m: None)
        error = mae(medians(model, rows), truths)
        gain = f"{previous - error:7.2f}" if previous is not None else f"{'':>7}"
        print(f"{fraction:9.3f} {trained:18,} {error:8.2f} {gain}")
        previous = error
    full, full_error = model, error  # the last fraction is all the data

    print("\n2. one member against the average (all the data)")
    single = text.train(attrs.evolve(settings, members=1), requests, log=lambda m: None)
    print(f"one member: MAE {mae(medians(single, rows), truths):.2f}; {settings.members} members: {full_error:.2f}")

    print(f"\n3. near-duplicate prompts among the held-out turns (similarity >= {settings.duplicate_similarity})")
    model_medians = medians(full, rows)
    found = [i for i, d in enumerate(duplicates) if d is not None]
    share = len(found) / len(rows)
    model_error = mae([model_medians[i] for i in found], [truths[i] for i in found])
    duplicate_error = mae([math.expm1(duplicates[i]) for i in found], [truths[i] for i in found])
    answered = [math.expm1(duplicates[i]) if duplicates[i] is not None else model_medians[i] for i in range(len(rows))]
    print(
        f"{len(found):,} turns ({share:.1%}): model MAE {model_error:.1f},"
        f" earlier reply's length {duplicate_error:.1f};"
        f" all turns: model {mae(model_medians, truths):.2f}, answered from near-duplicates {mae(answered, truths):.2f}"
    )


if __name__ == "__main__":
    main()
