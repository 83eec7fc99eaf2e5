"""``sagellm lifetime evaluate`` and ``sagellm lifetime train``."""

from __future__ import annotations

from pathlib import Path

import attrs

from sagellm_core import hookimpl
from sagellm_core.config import WorkloadSettings
from sagellm_core.errors import SagellmError

from . import evaluate as evaluation
from .split import TEST_FRACTION


def cmd_evaluate(args) -> int:
    names = args.predictor or evaluation.available()
    workload = attrs.evolve(evaluation.DEFAULT_WORKLOAD, source=args.source, max_requests=args.max_requests)
    if not 0 < args.test_fraction < 1:
        raise SagellmError(f"--test-fraction {args.test_fraction}: between 0 and 1")
    rows = evaluation.evaluate(names, workload, args.test_fraction, progress=not args.quiet)
    evaluation.print_rows(rows)
    if args.json:
        evaluation.write_json(rows, args.json)
    return 1 if any(row.get("error") for row in rows) else 0


def cmd_train(args) -> int:
    from . import text

    settings = text.TextSettings(train_source=args.source, epochs=args.epochs, seed=args.seed)
    if args.max_requests and not args.out:
        # The default file stands for a model trained on the whole workload.
        raise SagellmError("--max-requests trains on part of the workload: name the weights file with --out")
    out = Path(args.out) if args.out else text.default_weights(settings)
    from sagellm_core.replay import workloads

    requests = workloads.load(WorkloadSettings(source=args.source, max_requests=args.max_requests))
    model = text.train(settings, requests)
    text.save(model, settings, out)
    print(f"wrote {out}")
    return 0


@hookimpl
def sagellm_register_commands(subparsers) -> None:
    parser = subparsers.add_parser("lifetime", help="lifetime (output-length) predictors: evaluate, train")
    sub = parser.add_subparsers(dest="lifetime_command", required=True)

    p = sub.add_parser("evaluate", help="every predictor on a held-out split: MAE, acc10, latency")
    p.add_argument("--predictor", action="append", help="a sagellm.lifetime plugin (repeat; default: all installed)")
    p.add_argument("--source", default="sharegpt", help="the workload (a [workload] source; default sharegpt)")
    p.add_argument("--max-requests", type=int, help="only the first N requests of the workload")
    p.add_argument(
        "--test-fraction",
        type=float,
        default=TEST_FRACTION,
        help=f"share of conversations held out (default {TEST_FRACTION})",
    )
    p.add_argument("--json", help="write the figures as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_evaluate)

    from .text import TextSettings  # torch is imported only when training

    defaults = attrs.fields(TextSettings)
    p = sub.add_parser("train", help="train the 'text' predictor on the training conversations")
    p.add_argument("--source", default="sharegpt", help="the workload trained on (default sharegpt)")
    p.add_argument("--epochs", type=int, default=defaults.epochs.default)
    p.add_argument("--seed", type=int, default=defaults.seed.default)
    p.add_argument("--max-requests", type=int, help="only the first N requests of the workload")
    p.add_argument("--out", help="weights file (default: the cache file the 'text' plugin looks for)")
    p.set_defaults(func=cmd_train)
