"""The ``ray`` placement: each instance of a served cluster a Ray actor,
placed by Ray on a machine of a Ray cluster with the CPUs and GPUs its
command asks for; the actor runs the instance's command as a child
process there, serving on its node's address (Ray's node IP, which the
peers of a prefill or decode instance on other nodes reach too), and
reports whether it still runs.

It joins the cluster that ``RAY_ADDRESS`` names, or, without it, starts
Ray on this machine for the placement's life. Health comes from Ray: an
actor that died (its node lost, its process killed) is reported gone with
Ray's reason; a child that exited, with its exit status. The child is
bound to its actor's life (Linux's parent-death signal): an actor that
dies takes its instance with it. A command ``with_front`` (a cluster
file's ``pd_on_front_node``) is placed on the front's own node; any other
on the node Ray picks. :meth:`RayActors.stop`
stops each child, then kills each actor, so nothing started is left on
any node."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from sagellm_core.drivers.placement import InstanceCommand, filled, free_port, tail
from sagellm_core.errors import SagellmError

from .executor import ADDRESS_ENV

#: Seconds to wait for an actor's answer before it counts as unreachable.
ASK_TIMEOUT_S = 30.0
#: Seconds Ray may take to find a node with an actor's resources free.
PLACE_TIMEOUT_S = 300.0
#: Linux's prctl option: the signal a process gets when its parent exits.
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the actor's process ends."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class InstanceActor:
    """Runs one instance's command on the node Ray placed it on."""

    def __init__(self, argv: tuple[str, ...], env: dict[str, str], name: str):
        self.node = ray.util.get_node_ip_address()
        # The node's address: the front and the instance's peers on other nodes reach it there.
        self.host = self.node
        self.port = free_port(self.host)
        self.log = Path(tempfile.mkdtemp(prefix="sagellm-instance-")) / f"{name}.log"
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [sys.executable, *filled(argv, self.host, self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    def address(self) -> tuple[str, str, int, int]:
        """(node address, the address served on, port, the child's pid)."""
        return self.node, self.host, self.port, self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def log_tail(self, lines: int) -> str:
        return tail(self.log, lines)

    def stop(self, grace_s: float) -> int:
        """Stop the child (SIGTERM, then SIGKILL after ``grace_s``); its exit status."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
        finally:
            shutil.rmtree(self.log.parent, ignore_errors=True)


class RayActor:
    """:class:`sagellm_core.drivers.placement.PlacedInstance` of :class:`RayActors`."""

    def __init__(self, command: InstanceCommand, actor: Any, node: str, host: str, port: int, pid: int):
        self.command = command
        self.actor = actor
        self.node = node
        self.url = f"http://{host}:{port}"
        self.pid = pid
        self._failure: str | None = None

    def failure(self) -> str | None:
        if self._failure is None:
            try:
                code = ray.get(self.actor.poll.remote(), timeout=ASK_TIMEOUT_S)
            except ray.exceptions.RayActorError as exc:
                self._failure = "lost its Ray actor: " + _first_line(exc)
            except ray.exceptions.GetTimeoutError:
                return None  # busy or slow, not known dead: the next look asks again
            else:
                if code is not None:
                    self._failure = f"exited with {code} in its Ray actor"
        return self._failure

    def log_tail(self, lines: int = 5) -> str:
        try:
            return str(ray.get(self.actor.log_tail.remote(lines), timeout=ASK_TIMEOUT_S))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return "its output went with its actor"


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


class RayActors:
    """:class:`sagellm_core.drivers.placement.Placement` on Ray."""

    def __init__(self) -> None:
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            # log_to_driver off: the instances' output stays in their own logs.
            address = os.environ.get(ADDRESS_ENV) or None
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        self.placed: list[RayActor] = []
        self._actor = ray.remote(InstanceActor)

    def front_host(self) -> str:
        return str(ray.util.get_node_ip_address())

    def start(self, command: InstanceCommand) -> RayActor:
        here: Any = "DEFAULT"
        if command.with_front:  # this node, and no other
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actor = self._actor.options(
            num_cpus=command.num_cpus,
            num_gpus=command.num_gpus,
            max_restarts=0,
            max_task_retries=0,
            scheduling_strategy=here,
        ).remote(command.argv, dict(command.env), command.name)
        try:
            node, host, port, pid = ray.get(actor.address.remote(), timeout=PLACE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor)
            raise SagellmError(
                f"instance {command.name}: Ray found no node with num_cpus={command.num_cpus:g},"
                f" num_gpus={command.num_gpus:g} free in {PLACE_TIMEOUT_S:g} s (ray status lists what is free)"
            ) from None
        except ray.exceptions.RayError as exc:
            ray.kill(actor)
            raise SagellmError(
                f"instance {command.name}: its Ray actor (num_cpus={command.num_cpus:g},"
                f" num_gpus={command.num_gpus:g}) failed to start: {_first_line(exc)}"
            ) from None
        placed = RayActor(command, actor, node, host, port, pid)
        self.placed.append(placed)
        return placed

    def stop(self, grace_s: float) -> None:
        try:
            asked = [p.actor.stop.remote(grace_s) for p in self.placed]
            for placed, ref in zip(self.placed, asked, strict=True):
                try:
                    ray.get(ref, timeout=grace_s + ASK_TIMEOUT_S)
                except ray.exceptions.RayError:
                    pass  # its actor is gone, and its child with it
                ray.kill(placed.actor)
        finally:
            self.placed.clear()
            if self.started_ray:
                ray.shutdown()
