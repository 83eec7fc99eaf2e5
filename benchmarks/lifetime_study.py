"""What limits the ``text`` lifetime predictor on ShareGPT: a study for
the goal of an MAE of 100 tokens or less, read on the **dev** part of the
conversation split only (:mod:`sagellm_plugin_lifetime.split`): the test
part is dropped before anything is computed (``study_requests``), so no
choice made from this study has seen a test conversation.

    python3 benchmarks/lifetime_study.py

Needs torch and the ShareGPT workload (``tox -e lifetime`` has both). It
prints:

1. the learning curve: the model trained on 1/8, 1/4, 1/2 and all of the
   train conversations (nested, drawn by conversation), its dev MAE and how
   much each doubling of the data gains;
2. one member against the average of ``members``, on all the data;
3. near-duplicate prompts: the share of dev turns whose prompt nearly
   repeats an earlier one, and the error of that one's reply length against
   the model's on them; and the dev turns whose prompt is token-for-token a
   train prompt's.

The dev figures are offline: each dev turn is predicted with the features
the evaluation gives it (every earlier reply of the train and dev parts
known), but with no online step and no near-duplicate answer, so that (1)
and (2) measure the trained model alone (which stops early on the same dev
part). ``sagellm lifetime evaluate`` gives the served figures on the test
part. About 10 minutes on two cores.
"""

from __future__ import annotations

import hashlib
import math
import statistics

import attrs
import torch
from sagellm_plugin_lifetime import text
from sagellm_plugin_lifetime.evaluate import prompt_digest
from sagellm_plugin_lifetime.features import History
from sagellm_plugin_lifetime.quantiles import MEDIAN
from sagellm_plugin_lifetime.split import Split, conversation_id, make_split, study_requests

from sagellm_core.config import WorkloadSettings
from sagellm_core.replay import workloads

FRACTIONS = (1 / 8, 1 / 4, 1 / 2, 1.0)


def _draw(request) -> float:
    """The conversation's place in the nested subsets, in [0, 1)."""
    key = f"study:{conversation_id(request)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") / 2**32


def study_data(requests, split: Split) -> list:
    """The requests a study may read: the train and dev parts, in order
    (:func:`study_requests`; never a test request)."""
    return [request for request, _ in study_requests(requests, split)]


def dev_rows(settings: text.TextSettings, requests, split: Split):
    """Rows and true lengths of the dev turns among ``requests`` (which must
    hold no test request: :func:`study_data`), with near-duplicate answers
    (log length or None) as the evaluation's history would give them, and
    whether the prompt is a train prompt's, token for token."""
    requests = list(requests)
    train_prompts = {prompt_digest(r) for r in requests if split.part(r) == "train"}
    history = History(16)
    rows, truths, duplicates, repeats = [], [], [], []
    for request in requests:
        part = split.part(request)
        if part == "test":
            raise ValueError(f"a study read the test request {request.request_id}")
        if part == "dev":
            rows.append((text.text_ids(request.prompt_text, settings.buckets), history.features(request)))
            truths.append(request.output_tokens)
            duplicates.append(history.near_duplicate(request))
            repeats.append(prompt_digest(request) in train_prompts)
        history.observe(request, request.output_tokens)
    return rows, truths, duplicates, repeats


def medians(model, rows) -> list[float]:
    model.eval()
    with torch.no_grad():
        out = torch.cat([model(*text._batch(torch, rows[i : i + 2048])) for i in range(0, len(rows), 2048)])
    return torch.expm1(out[:, MEDIAN]).tolist()


def mae(predicted, truths) -> float:
    return statistics.fmean(abs(p - t) for p, t in zip(predicted, truths))


def main() -> None:
    settings = text.TextSettings()
    split = make_split(settings.split, test_fraction=settings.test_fraction, dev_fraction=settings.dev_fraction)
    requests = study_data(workloads.load(WorkloadSettings(source="sharegpt")), split)
    rows, truths, duplicates, repeats = dev_rows(settings, requests, split)
    print(
        f"{len(requests):,} train and dev requests (the test part is not read), {len(rows):,} dev;"
        f" members={settings.members}, epochs={settings.epochs}"
    )

    print("\n1. learning curve (dev MAE, offline)")
    print(f"{'fraction':>9} {'training requests':>18} {'MAE':>8} {'gain':>7}")
    previous = None
    for fraction in FRACTIONS:
        subset = [r for r in requests if split.part(r) == "dev" or _draw(r) < fraction]
        trained = sum(split.part(r) == "train" for r in subset)
        model = text.train(settings, subset, log=lambda m: None, split=split)
        error = mae(medians(model, rows), truths)
        gain = f"{previous - error:7.2f}" if previous is not None else f"{'':>7}"
        print(f"{fraction:9.3f} {trained:18,} {error:8.2f} {gain}")
        previous = error
    full, full_error = model, error  # the last fraction is all the data

    print("\n2. one member against the average (all the data)")
    single = text.train(attrs.evolve(settings, members=1), requests, log=lambda m: None, split=split)
    print(f"one member: MAE {mae(medians(single, rows), truths):.2f}; {settings.members} members: {full_error:.2f}")

    print(f"\n3. near-duplicate prompts among the dev turns (similarity >= {settings.duplicate_similarity})")
    model_medians = medians(full, rows)
    found = [i for i, d in enumerate(duplicates) if d is not None]
    answered = [math.expm1(duplicates[i]) if duplicates[i] is not None else model_medians[i] for i in range(len(rows))]
    if found:
        model_error = mae([model_medians[i] for i in found], [truths[i] for i in found])
        duplicate_error = mae([math.expm1(duplicates[i]) for i in found], [truths[i] for i in found])
        print(
            f"{len(found):,} turns ({len(found) / len(rows):.1%}): model MAE {model_error:.1f},"
            f" earlier reply's length {duplicate_error:.1f};"
            f" all turns: model {mae(model_medians, truths):.2f},"
            f" answered from near-duplicates {mae(answered, truths):.2f}"
        )
    else:
        print("no dev turn has a near-duplicate prompt")
    exact = [i for i, r in enumerate(repeats) if r]
    other = [i for i, r in enumerate(repeats) if not r]
    print(f"{len(exact):,} dev turns ({len(exact) / len(rows):.1%}) repeat a train prompt token for token")
    for label, subset in (("on them", exact), ("on the others", other)):
        if subset:
            print(
                f"  {label}: model MAE {mae([model_medians[i] for i in subset], [truths[i] for i in subset]):.2f},"
                f" answered from near-duplicates {mae([answered[i] for i in subset], [truths[i] for i in subset]):.2f}"
            )


if __name__ == "__main__":
    main()
