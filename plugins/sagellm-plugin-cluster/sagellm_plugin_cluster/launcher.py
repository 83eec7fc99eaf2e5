"""The instances of a served cluster: started where the cluster file's
``placement`` puts them (the core's ``sagellm.placements``: ``local``
processes on this machine, ``ray`` actors across a Ray cluster's
machines), checked healthy, watched, stopped. Nothing more is managed (no
restart): every instance is stopped when the front stops or when any
instance fails to start.

While the front serves, :class:`Watch` asks the placement whether each
instance is alive; one that is gone is reported (one line on stderr) and
:class:`LiveRouter` no longer offers it to the router, as long as an
instance of its kind remains (the last prefill instance is still offered:
its decode instance computes what it cannot pull)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

import httpx
from attrs import define

from sagellm_core.drivers import placement as placement_mod
from sagellm_core.drivers.placement import InstanceCommand, PlacedInstance, Placement, free_port
from sagellm_core.drivers.router import PROMPT_ROLES, Router
from sagellm_core.errors import SagellmError
from sagellm_core.types import InstanceLoad, Request, RouteDecision

from .clusterfile import ClusterSpec, InstanceSpec

__all__ = ["Launcher", "LiveRouter", "RunningInstance", "Watch", "free_port", "instance_command"]

#: Seconds a stopped instance has to exit before it is killed.
STOP_GRACE_S = 20.0
#: Seconds between two looks at every instance while the front serves.
WATCH_INTERVAL_S = 1.0


@define
class RunningInstance:
    spec: InstanceSpec
    placed: PlacedInstance

    @property
    def url(self) -> str:
        return self.placed.url

    def log_tail(self, lines: int = 5) -> str:
        return self.placed.log_tail(lines)


def instance_command(
    cluster: ClusterSpec, spec: InstanceSpec, log_level: str, store: tuple[str, int] | None
) -> InstanceCommand:
    """The command of one instance (``python -m sagellm_plugin_cluster.instance``),
    its address left to the placement."""
    argv = ["-m", "sagellm_plugin_cluster.instance", "--config", str(spec.config_path)]
    argv += ["--host", placement_mod.HOST, "--port", placement_mod.PORT]
    argv += ["--log-level", log_level, "--role", spec.role]
    if spec.role != "colocated":
        if store is None:
            raise SagellmError(f"instance {spec.instance_id}: a {spec.role} instance needs the front's store")
        argv += ["--store-host", store[0], "--store-port", str(store[1]), "--links", ",".join(cluster.links(spec))]
        argv += ["--lease-s", str(cluster.lease_s), "--send-timeout-s", str(cluster.pull_timeout_s)]
        argv += ["--transport", cluster.transport]
        # Its transport binds and advertises the address it serves on (the
        # placement's: its node's), unless the file names another.
        argv += ["--transport-host", spec.host or placement_mod.HOST]
    return InstanceCommand(
        spec.instance_id,
        tuple(argv),
        num_cpus=spec.num_cpus,
        num_gpus=spec.num_gpus,
        with_front=spec.role != "colocated" and cluster.pd_on_front_node,
    )


class Launcher:
    """Starts every instance of ``spec`` (:meth:`start`) where its
    placement puts them, and stops them all (:meth:`stop`)."""

    def __init__(
        self,
        spec: ClusterSpec,
        log_level: str = "warning",
        store_port: int | None = None,
        placement: Placement | None = None,
    ):
        """``store_port``: the front's store, which prefill and decode
        instances join; ``placement``: the file's, loaded here if not given."""
        self.spec = spec
        self.store_port = store_port
        self.log_level = log_level
        self.placement = placement or placement_mod.load_placement(spec.placement, f"{spec.path}: placement")
        self.running: list[RunningInstance] = []

    def start(self) -> list[RunningInstance]:
        """Start every instance and wait until each answers ``/health``;
        on a failed start (an exit, or no answer within the file's
        ``start_timeout_s``) stop them all and raise, naming the instance."""
        try:
            store = None if self.store_port is None else (self.placement.front_host(), self.store_port)
            for spec in self.spec.instances:
                command = instance_command(self.spec, spec, self.log_level, store)
                self.running.append(RunningInstance(spec, self.placement.start(command)))
            self._check_nodes()
            self._wait_healthy(time.monotonic() + self.spec.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.running

    def _check_nodes(self) -> None:
        """With ``pd_on_front_node``, prefill and decode instances on the
        front's machine: a placement that put one elsewhere is an error."""
        if not self.spec.pd_on_front_node:
            return
        here = self.placement.front_host()
        for instance in self.running:
            if instance.spec.role != "colocated" and instance.placed.node != here:
                raise SagellmError(
                    f"{self.spec.path}: pd_on_front_node = true, but placement = {self.spec.placement!r} put"
                    f" {instance.spec.role} instance {instance.spec.instance_id} on node {instance.placed.node},"
                    f" not on the front's ({here})"
                )

    def _wait_healthy(self, deadline: float) -> None:
        waiting = list(self.running)
        while waiting:
            for instance in list(waiting):
                failure = instance.placed.failure()
                if failure is not None:
                    raise SagellmError(
                        f"instance {instance.spec.instance_id} ({instance.spec.config_path}) {failure}"
                        f" while starting: {instance.log_tail()}"
                    )
                try:
                    if httpx.get(f"{instance.url}/health", timeout=1).status_code == 200:
                        waiting.remove(instance)
                except httpx.HTTPError:
                    pass
            if waiting and time.monotonic() > deadline:
                names = ", ".join(i.spec.instance_id for i in waiting)
                raise SagellmError(
                    f"{self.spec.path}: start_timeout_s = {self.spec.start_timeout_s:g}: instances {names} did not"
                    " answer /health in time"
                )
            if waiting:
                time.sleep(0.2)

    def stop(self) -> None:
        """Stop every instance started: each has :data:`STOP_GRACE_S` to
        exit before it is killed."""
        self.placement.stop(STOP_GRACE_S)


class Watch:
    """A thread that asks the placement, every ``interval_s``, whether each
    running instance is alive; the ids of those gone are in :attr:`gone`,
    each reported once on ``out``."""

    def __init__(
        self, running: Sequence[RunningInstance], interval_s: float = WATCH_INTERVAL_S, out: TextIO | None = None
    ):
        self.running = list(running)
        self.interval_s = interval_s
        self.out = out or sys.stderr
        self.gone: dict[str, str] = {}
        self._quit = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sagellm-watch", daemon=True)

    def start(self) -> Watch:
        self._thread.start()
        return self

    def look(self) -> None:
        """One look at every instance not yet known to be gone."""
        for instance in self.running:
            name = instance.spec.instance_id
            if name in self.gone:
                continue
            failure = instance.placed.failure()
            if failure is not None:
                self.gone[name] = failure
                print(
                    f"sagellm: instance {name} at {instance.url} (node {instance.placed.node}) {failure}:"
                    f" no longer routed; {instance.log_tail(2)}",
                    file=self.out,
                    flush=True,
                )

    def _loop(self) -> None:
        while not self._quit.wait(self.interval_s):
            try:
                self.look()
            except Exception as exc:  # a placement that cannot answer now: the next look asks again
                print(f"sagellm: watching the instances: {type(exc).__name__}: {exc}", file=self.out, flush=True)

    def close(self) -> None:
        self._quit.set()
        if self._thread.ident is not None:  # started
            self._thread.join()


class LiveRouter:
    """The cluster's router, offered only the instances that ``watch`` has
    not seen gone, unless that leaves no colocated or prefill instance, or
    (with prefill instances) no decode instance: then every instance is
    offered, and the front's own fallbacks answer."""

    def __init__(self, router: Router, watch: Watch):
        self.router = router
        self.watch = watch
        self.plugin_name = router.plugin_name
        self.name = router.name

    def route(self, request: Request, instances: Sequence[InstanceLoad], now_s: float) -> RouteDecision:
        gone = self.watch.gone
        live = [i for i in instances if i.instance_id not in gone] if gone else list(instances)
        if len(live) < len(instances):
            roles = {i.role for i in live}
            if not roles & set(PROMPT_ROLES) or ("prefill" in roles and "decode" not in roles):
                live = list(instances)
        return self.router.route(request, live, now_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.router, name)
