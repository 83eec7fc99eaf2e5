"""``sagellm lifetime evaluate`` and ``sagellm lifetime train``."""

from __future__ import annotations

from pathlib import Path

import attrs

from sagellm_core import hookimpl
from sagellm_core.config import WorkloadSettings
from sagellm_core.errors import SagellmError

from . import evaluate as evaluation
from .split import DEV_FRACTION, KINDS, TEST_FRACTION


def _check_fractions(args) -> None:
    if not 0 < args.test_fraction < 1:
        raise SagellmError(f"--test-fraction {args.test_fraction}: between 0 and 1")
    if not 0 < args.dev_fraction < 1 or args.test_fraction + args.dev_fraction >= 1:
        raise SagellmError(f"--dev-fraction {args.dev_fraction}: between 0 and 1 - --test-fraction")


def cmd_evaluate(args) -> int:
    names = args.predictor or evaluation.available()
    workload = WorkloadSettings(source=args.source, max_requests=args.max_requests)
    _check_fractions(args)
    if args.decode_s_per_token <= 0:
        raise SagellmError(f"--decode-s-per-token {args.decode_s_per_token}: positive")
    rows = evaluation.evaluate(
        names,
        workload,
        args.test_fraction,
        progress=not args.quiet,
        split=args.split,
        dev_fraction=args.dev_fraction,
        decode_s_per_token=args.decode_s_per_token,
    )
    evaluation.print_rows(rows)
    if args.json:
        evaluation.write_json(rows, args.json)
    return 1 if any(row.get("error") for row in rows) else 0


def cmd_train(args) -> int:
    from . import text

    _check_fractions(args)
    settings = text.TextSettings(
        train_source=args.source,
        epochs=args.epochs,
        seed=args.seed,
        split=args.split,
        test_fraction=args.test_fraction,
        dev_fraction=args.dev_fraction,
    )
    if args.max_requests and not args.out:
        # The default file stands for a model trained on the whole workload.
        raise SagellmError("--max-requests trains on part of the workload: name the weights file with --out")
    out = Path(args.out) if args.out else text.default_weights(settings)
    from sagellm_core.replay import workloads

    requests = workloads.load(WorkloadSettings(source=args.source, max_requests=args.max_requests))
    # A temporal split orders the whole workload's conversations, as evaluate does.
    model = text.train(settings, requests, split=text.split_of(settings) if args.split == "temporal" else None)
    text.save(model, settings, out)
    print(f"wrote {out}")
    return 0


def _split_arguments(p) -> None:
    p.add_argument(
        "--split",
        choices=KINDS,
        default="conversation",
        help="conversation: a hash of the whole conversation; temporal: the last conversations are the test",
    )
    p.add_argument(
        "--test-fraction",
        type=float,
        default=TEST_FRACTION,
        help=f"share of conversations in the test part (default {TEST_FRACTION}); the 'text' model trains without them",
    )
    p.add_argument(
        "--dev-fraction",
        type=float,
        default=DEV_FRACTION,
        help=f"share of conversations in the dev part, for early stopping and studies (default {DEV_FRACTION})",
    )


@hookimpl
def sagellm_register_commands(subparsers) -> None:
    parser = subparsers.add_parser("lifetime", help="lifetime (output-length) predictors: evaluate, train")
    sub = parser.add_subparsers(dest="lifetime_command", required=True)

    p = sub.add_parser("evaluate", help="every predictor on the test part of a split: MAE, acc10, coverage, latency")
    p.add_argument("--predictor", action="append", help="a sagellm.lifetime plugin (repeat; default: all installed)")
    p.add_argument("--source", default="sharegpt", help="the workload (a [workload] source; default sharegpt)")
    p.add_argument("--max-requests", type=int, help="only the first N requests of the workload")
    _split_arguments(p)
    p.add_argument(
        "--decode-s-per-token",
        type=float,
        default=evaluation.DECODE_S_PER_TOKEN,
        help=f"decoding time per output token: when a reply finishes (default {evaluation.DECODE_S_PER_TOKEN})",
    )
    p.add_argument("--json", help="write the figures as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_evaluate)

    from .text import TextSettings  # torch is imported only when training

    defaults = attrs.fields(TextSettings)
    p = sub.add_parser("train", help="train the 'text' predictor on the train part of a split")
    p.add_argument("--source", default="sharegpt", help="the workload trained on (default sharegpt)")
    p.add_argument("--epochs", type=int, default=defaults.epochs.default)
    p.add_argument("--seed", type=int, default=defaults.seed.default)
    p.add_argument("--max-requests", type=int, help="only the first N requests of the workload")
    _split_arguments(p)
    p.add_argument("--out", help="weights file (default: the cache file the 'text' plugin looks for)")
    p.set_defaults(func=cmd_train)
