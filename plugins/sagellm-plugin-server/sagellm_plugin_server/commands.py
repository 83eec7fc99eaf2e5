"""``sagellm serve`` and ``sagellm bench serve``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from sagellm_core import hookimpl
from sagellm_core.cli import add_set_option, check_config, single_overrides
from sagellm_core.config import Settings
from sagellm_core.errors import ConfigError, SagellmError

#: ``sagellm serve``'s flags (vLLM's names) and the config key each sets: a
#: flag is a ``--set`` with a name, so a TOML file and flags mean the same.
#: ``--gpu-memory-utilization`` also sets ``[kv_pool] num_blocks = "auto"``;
#: ``--[no-]enable-prefix-caching`` picks or drops ``[prefix_cache] plugin``.
FLAG_KEYS: dict[str, tuple[str, str]] = {
    "model": ("engine", "model"),
    "device": ("engine", "device"),
    "dtype": ("engine", "dtype"),
    "max_model_len": ("engine", "max_model_len"),
    "max_num_seqs": ("engine", "max_num_seqs"),
    "max_num_batched_tokens": ("engine", "max_num_batched_tokens"),
    "gpu_memory_utilization": ("engine", "gpu_memory_utilization"),
    "async_scheduling": ("engine", "async_scheduling"),
    "block_size": ("prefix_cache", "block_size"),
    "num_blocks": ("kv_pool", "num_blocks"),
    "eviction": ("eviction", "plugin"),
    "served_model_name": ("server", "model_name"),
}
#: The prefix cache ``--enable-prefix-caching`` picks where the config names none.
PREFIX_CACHE = "radix"
#: ``--no-enable-prefix-caching`` replaces ``[prefix_cache]`` by its block
#: size alone, which ``--set`` may still give.
_KEPT_WITHOUT_CACHE = {"--no-enable-prefix-caching": ("prefix_cache", "block_size")}


def defaults_path() -> Path:
    """The config ``sagellm serve MODEL`` starts from without ``--config``."""
    return Path(str(resources.files(__package__) / "serve.toml"))


def _flag(dest: str, value: Any) -> str:
    """The flag as typed, for messages: ``--max-num-seqs 64``."""
    return f"--{dest.replace('_', '-')} {value}"


def serve_settings(args: argparse.Namespace) -> Settings:
    """The config ``sagellm serve`` serves: ``--config`` (else
    :func:`defaults_path`), with ``--set`` and the flags applied; a flag and
    a ``--set`` of the same key are refused, not ranked."""
    from sagellm_core import config

    if args.config is None and args.model is None:
        raise SagellmError(
            "sagellm serve: give a MODEL (smollm2, a checkpoint folder or a .gguf file) or --config FILE"
        )
    path = args.config or defaults_path()
    sets = single_overrides(args)
    # config key -> (the flag as typed, the value it sets)
    flags: dict[tuple[str, ...], tuple[str, Any]] = {
        keys: (_flag(dest, getattr(args, dest)), getattr(args, dest))
        for dest, keys in FLAG_KEYS.items()
        if getattr(args, dest) is not None
    }
    if args.gpu_memory_utilization is not None:
        if not 0 < args.gpu_memory_utilization <= 1:
            raise SagellmError(f"--gpu-memory-utilization {args.gpu_memory_utilization}: a fraction in (0, 1]")
        flags[("kv_pool", "num_blocks")] = (_flag("gpu_memory_utilization", args.gpu_memory_utilization), "auto")
    if args.enable_prefix_caching is not None:
        flags.update(_prefix_caching(config.load(path, sets), args.enable_prefix_caching, flags))
    for keys, (flag, _) in flags.items():
        for set_keys in sets:
            overlap = set_keys[: len(keys)] == keys or keys[: len(set_keys)] == set_keys
            if overlap and set_keys != _KEPT_WITHOUT_CACHE.get(flag):
                raise SagellmError(f"{flag} and --set {'.'.join(set_keys)}=...: both set {'.'.join(keys)}; give one")
    return config.load(path, {**sets, **{keys: value for keys, (_, value) in flags.items()}})


def _prefix_caching(base: Settings, enable: bool, flags: dict) -> dict[tuple[str, ...], tuple[str, Any]]:
    """What ``--[no-]enable-prefix-caching`` sets on ``base``, the config
    with ``--set`` applied."""
    if not enable:  # the section keeps only its block size: no cache
        _, block_size = flags.pop(("prefix_cache", "block_size"), (None, base.block_size))
        return {("prefix_cache",): ("--no-enable-prefix-caching", {"block_size": block_size})}
    out: dict[tuple[str, ...], tuple[str, Any]] = {}
    if base.prefix_cache is None:
        out[("prefix_cache", "plugin")] = ("--enable-prefix-caching", PREFIX_CACHE)
    if base.eviction is None and ("eviction", "plugin") not in flags:  # a cache needs a victim policy
        out[("eviction", "plugin")] = ("--enable-prefix-caching", "lru")
    return out


def build_server(settings: Settings, plugins: Sequence[object] = ()):
    """(app, engine thread, model name) for a config whose engine is torch;
    the thread is not started. ``plugins`` are registered on the engine's
    runtime before it starts (observers a caller adds: a cluster instance's
    KV-event publisher)."""
    from sagellm_core.drivers.engines import LiveEngine, build_engine, sized_pool
    from sagellm_core.runtime import Runtime

    from .app import build_app
    from .engine_thread import EngineThread
    from .hints import PinLedger
    from .metrics import ServerMetrics

    engine, engine_settings = build_engine(settings)
    if not isinstance(engine, LiveEngine):
        raise ConfigError(
            f"{settings.path}: [engine] name = {settings.engine.name!r}; `sagellm serve` serves the torch engine"
        )
    rt = Runtime(sized_pool(settings, engine))
    for plugin in plugins:
        rt.host.pm.register(plugin)
    core = engine.start(rt)
    metrics = ServerMetrics(settings.eviction.name if settings.eviction else "none")
    server = settings.section("server")
    thread = EngineThread(core, server.max_waiting, metrics.observe)
    name = server.model_name or engine_settings.model
    pins = PinLedger(server.pin_budget_blocks, core.rt.block_size)
    return build_app(thread, name, metrics, pins), thread, name


def cmd_serve(args) -> int:
    settings = serve_settings(args)
    if args.check:
        print("\n".join(check_config(settings)))
        return 0
    import uvicorn

    app, thread, name = build_server(settings)
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


def _serve_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the torch engine over OpenAI's API, with Prometheus metrics and KV stats",
        description="Serve MODEL (or --config FILE) over OpenAI's API. Each flag sets the config key it names,"
        " on --config's file or, without one, on sagellm serve's defaults (serve.toml in sagellm-plugin-server).",
    )
    p.add_argument(
        "model", nargs="?", help="smollm2, a checkpoint folder or a .gguf file ([engine] model); or give --config"
    )
    p.add_argument("--config", help="a config whose [engine] is torch; flags and --set override its keys")
    add_set_option(p)

    def key(dest: str) -> str:
        section, name = FLAG_KEYS[dest]
        return f"[{section}] {name}"

    p.add_argument("--device", help=f"cpu, cuda, cuda:1, npu ({key('device')})")
    p.add_argument("--dtype", help=f"float32, float16, bfloat16 ({key('dtype')})")
    p.add_argument("--max-model-len", type=int, help=f"longest prompt plus output ({key('max_model_len')})")
    p.add_argument("--max-num-seqs", type=int, help=f"requests running at once ({key('max_num_seqs')})")
    p.add_argument("--max-num-batched-tokens", type=int, help=f"tokens in one step ({key('max_num_batched_tokens')})")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help=f'[prefix_cache] plugin = "{PREFIX_CACHE}" where the config names none (with [eviction] plugin = "lru"'
        " where it names none); --no-enable-prefix-caching leaves [prefix_cache] its block size only",
    )
    p.add_argument("--block-size", type=int, help=f"tokens a KV block ({key('block_size')})")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, help=f"the KV pool's size in blocks ({key('num_blocks')})")
    size.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help=f"the share of device memory the engine may use; the pool gets the rest ({key('gpu_memory_utilization')},"
        ' and [kv_pool] num_blocks = "auto")',
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help=f"pack step N+1 while step N runs on the device ({key('async_scheduling')}; off by default:"
        " on the CPU nothing overlaps)",
    )
    p.add_argument("--eviction", help=f"a sagellm.eviction plugin: lru, s3fifo, ... ({key('eviction')})")
    p.add_argument("--served-model-name", help=f"the model name clients send ({key('served_model_name')})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--check", action="store_true", help="print the config as `sagellm config check` does, and exit without serving"
    )
    p.set_defaults(func=cmd_serve)


def _bench_parser(subparsers) -> None:
    b = subparsers.add_parser("bench", help="load generators")
    sub = b.add_subparsers(dest="bench_command", required=True)
    s = sub.add_parser("serve", help="replay a trace's prompts against any OpenAI-compatible endpoint")
    s.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    s.add_argument(
        "--trace",
        required=True,
        help="a ShareGPT .json file, a Mooncake .jsonl trace (text built from its hash ids) or an Azure .csv trace"
        " (text of its context token counts)",
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
    s.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a request may take in all, else it failed (default 300)"
    )
    s.add_argument(
        "--first-token-timeout", type=float, help="seconds a request may wait for its first text, else it failed"
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", help="write the figures as JSON here")
    s.add_argument("--quiet", action="store_true", help="no progress bar or table")
    s.set_defaults(func=cmd_bench_serve)


@hookimpl
def sagellm_register_commands(subparsers) -> None:
    _serve_parser(subparsers)
    _bench_parser(subparsers)
