"""``sagellm serve --cluster FILE``: the cluster file's instances started
where its placement puts them (:mod:`.launcher`: local processes, or Ray
actors) behind one routing front (:mod:`.front`), which stops routing to
an instance once its placement reports it gone.

``sagellm serve`` is the server plugin's command; this plugin adds the
option to it. The commands of plugins register in entry-point order,
which nothing fixes, so the option is added to ``serve`` whichever
registers first: at once if it is there, else as the server adds it. The
option's action, not a default, picks the command run, so that the
server's own ``set_defaults(func=...)`` cannot override it."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from sagellm_core import hookimpl
from sagellm_core.errors import SagellmError


class _ClusterAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[no-untyped-def]
        setattr(namespace, self.dest, values)
        namespace.func = cmd_serve_cluster


def add_cluster_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cluster",
        metavar="FILE",
        action=_ClusterAction,
        help="serve a cluster: the file's instances (each a torch engine with its own config) as local processes"
        " or Ray actors (its placement) behind one front that routes with its [router]"
        " (see sagellm-plugin-cluster's README)",
    )


#: ``sagellm serve``'s options that describe one engine: a cluster file's instance configs say that.
_ONE_ENGINE = (
    "model",
    "config",
    "set",
    "check",
    "device",
    "dtype",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "block_size",
    "num_blocks",
    "gpu_memory_utilization",
    "eviction",
    "served_model_name",
)


def cmd_serve_cluster(args: argparse.Namespace) -> int:
    given = [name for name in _ONE_ENGINE if getattr(args, name, None) not in (None, False, [])]
    if given:
        flags = ", ".join("MODEL" if n == "model" else f"--{n.replace('_', '-')}" for n in given)
        raise SagellmError(
            f"--cluster {args.cluster} and {flags}: each instance's config in the cluster file says that"
        )
    import uvicorn

    from . import clusterfile, transports
    from .front import Member, PromptKeys, build_front
    from .launcher import Launcher, LiveRouter, Watch

    spec = clusterfile.load(args.cluster)
    router = spec.router
    store = None
    if any(i.role != "colocated" for i in spec.instances):
        # Its package missing is one line now, not an instance failing to start.
        transports.find(spec.transport, f"{spec.path}: transport").check(f"{spec.path}: transport = {spec.transport!r}")
        import datetime

        import torch.distributed as dist

        # The transfers' control keys live here, in the front, so that
        # neither side of a link takes them down by dying (see transports.py).
        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
        )
    # The front computes the prompts' block keys as the instances do: their tokenizer, their prefix cache.
    keys = PromptKeys.of_instance(spec.instances[0].settings)

    # uvicorn stops on SIGTERM, then raises it again with the handler it
    # found: the default one would end this process before the instances,
    # and so would a SIGTERM while they start (the launcher stops them on
    # the SystemExit).
    def on_sigterm(*_: object) -> None:
        sys.exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    launcher = Launcher(spec, args.log_level, None if store is None else store.port)
    running = launcher.start()
    # Again: a placement may have put its own in (Ray's driver exits with the
    # signal's bare number), and the exit status says the signal ended it.
    signal.signal(signal.SIGTERM, on_sigterm)
    watch = Watch(running)
    try:
        members = [Member(r.spec.instance_id, r.spec.role, r.url, r.placed.pid) for r in running]
        live = LiveRouter(router, watch)
        app = build_front(  # type: ignore[arg-type]
            members, live, keys, spec.pull_timeout_s, store=store, lease_s=spec.lease_s
        )
        names = ", ".join(f"{m.instance_id} at {m.url}" for m in members)
        watch.start()
        print(
            f"sagellm: cluster of {len(members)} ({names}) placed by {spec.placement!r}, router"
            f" {router.plugin_name!r}, serving on http://{args.host}:{args.port}",
            file=sys.stderr,
            flush=True,
        )
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    finally:
        watch.close()
        launcher.stop()
    return 0


@hookimpl
def sagellm_register_commands(subparsers: Any) -> None:
    serve = subparsers.choices.get("serve")
    if serve is not None:
        add_cluster_option(serve)
        return
    add_parser = subparsers.add_parser

    def add_then_extend(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        parser = add_parser(name, **kwargs)
        if name == "serve":
            add_cluster_option(parser)
        return parser

    subparsers.add_parser = add_then_extend
