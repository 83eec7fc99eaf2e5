"""``sagellm serve`` and ``sagellm bench serve``."""

from __future__ import annotations

import sys

from sagellm_core import hookimpl
from sagellm_core.errors import ConfigError


def build_server(config: str):
    """(app, engine thread) for a config whose engine is torch; the thread
    is not started."""
    from sagellm_core.drivers.engines import LiveEngine, build_engine
    from sagellm_core.replay import session
    from sagellm_core.runtime import Runtime

    from .app import build_app
    from .engine_thread import EngineThread
    from .metrics import ServerMetrics

    settings = session.load_settings(config)
    engine, engine_settings = build_engine(settings)
    if not isinstance(engine, LiveEngine):
        raise ConfigError(
            f"{settings.path}: [engine] name = {settings.engine.name!r}; `sagellm serve` serves the torch engine"
        )
    core = engine.start(Runtime(settings))
    metrics = ServerMetrics(settings.eviction.name if settings.eviction else "none")
    server = settings.section("server")
    thread = EngineThread(core, server.max_waiting, metrics.observe)
    name = server.model_name or engine_settings.model
    return build_app(thread, name, metrics), thread, name


def cmd_serve(args) -> int:
    import uvicorn

    app, thread, name = build_server(args.config)
    thread.start()
    print(f"sagellm: serving {name} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        thread.stop()
    return 0


def cmd_bench_serve(args) -> int:
    from . import bench

    return bench.main(args)


@hookimpl
def sagellm_register_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve the torch engine over OpenAI's API, with Prometheus metrics and KV stats"
    )
    p.add_argument("--config", required=True, help="a config whose [engine] is torch")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)

    b = subparsers.add_parser("bench", help="load generators")
    sub = b.add_subparsers(dest="bench_command", required=True)
    s = sub.add_parser("serve", help="replay a trace's prompts against any OpenAI-compatible endpoint")
    s.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    s.add_argument(
        "--trace",
        required=True,
        help="a ShareGPT .json file, or a Mooncake .jsonl trace (text built from its hash ids)",
    )
    s.add_argument(
        "--rate", type=float, help="requests per second, Poisson (default: the trace's timestamps, or all at once)"
    )
    s.add_argument("--max-requests", type=int, help="only the first N requests")
    s.add_argument("--model", help="the model name to send (default: the server's first model)")
    s.add_argument("--max-tokens", type=int, default=64, help="cap on each request's output tokens (default 64)")
    s.add_argument(
        "--words-per-block", type=int, default=32, help="Mooncake: words of synthetic text per hash id (default 32)"
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", help="write the figures as JSON here")
    s.add_argument("--quiet", action="store_true", help="no progress bar or table")
    s.set_defaults(func=cmd_bench_serve)
