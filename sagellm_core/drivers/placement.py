"""Where the instances of a served cluster run (entry point group
``sagellm.placements``): a placement starts an instance's command
somewhere, says the URL it serves on, whether it is still alive, and
stops it. ``local`` here: processes on this machine; ``ray`` from
``sagellm-plugin-ray``: Ray actors on a Ray cluster's machines.

A placement knows commands, not clusters: the command is the arguments
of a Python interpreter (the placement's own on the machine it picks),
in which an item ``{host}`` or ``{port}`` is replaced by the address the
instance is to serve on there, which the URL then names."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Protocol

from attrs import field, frozen

from sagellm_core import registry
from sagellm_core.errors import ConfigError, PluginStartError, SagellmError

#: The entry point group of the placements (a cluster file's ``placement``).
PLACEMENTS = "sagellm.placements"
#: The argv items a placement replaces by the address it picked.
HOST, PORT = "{host}", "{port}"


@frozen
class InstanceCommand:
    """One instance to start: ``python ARGV...`` with ``env`` added to the
    environment, needing ``num_cpus`` CPUs and ``num_gpus`` GPUs (a
    placement that places by resources reserves them; ``local`` ignores
    them); ``with_front``: on the machine of the placement's caller."""

    #: Unique among the instances of one placement.
    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(factory=dict)
    num_cpus: float = field(default=1.0, converter=float)
    num_gpus: float = field(default=0.0, converter=float)
    with_front: bool = False


class PlacedInstance(Protocol):
    """An instance a placement started."""

    command: InstanceCommand
    #: ``http://HOST:PORT``, reachable from the machine of the placement's caller.
    url: str
    #: The instance's process, on its machine.
    pid: int
    #: The machine it runs on, as its placement names it (an address).
    node: str

    def failure(self) -> str | None:
        """``None`` while the instance runs; once it is gone, why (its exit
        status, its actor's death), in one line."""
        ...

    def log_tail(self, lines: int = 5) -> str:
        """The last ``lines`` of its output, joined on one line."""
        ...


class Placement(Protocol):
    """A placement plugin (group ``sagellm.placements``) is this class,
    built with no arguments."""

    def front_host(self) -> str:
        """The address at which the placed instances reach this machine."""
        ...

    def start(self, command: InstanceCommand) -> PlacedInstance:
        """Start ``command`` where this placement puts it; not waiting for
        it to serve. A :class:`~sagellm_core.errors.SagellmError` naming the
        command when it cannot be placed."""
        ...

    def stop(self, grace_s: float) -> None:
        """Stop every instance started, at once: each has ``grace_s``
        seconds to exit before it is killed; nothing started is left
        running, and what the placement itself started is released."""
        ...


def find(name: object, where: str) -> metadata.EntryPoint:
    """The entry point of the placement ``name``; a :class:`ConfigError`
    naming ``where`` when none is installed by that name."""
    if not isinstance(name, str):
        raise ConfigError(f"{where} = {name!r}: name a placement (local, ray)")
    ep = registry.find(PLACEMENTS, name, where)
    if ep is None:
        names = ", ".join(sorted(registry.installed(PLACEMENTS))) or "none"
        hint = "pip install sagellm-plugin-ray" if name == "ray" else "Ray actors: pip install sagellm-plugin-ray"
        raise ConfigError(f"{where} = {name!r}: no such placement; installed: {names} ({hint})")
    return ep


def load_placement(name: object, where: str) -> Placement:
    """The placement plugin ``name``, built (:func:`find`'s errors, or a
    :class:`PluginStartError` when it fails to import or to start)."""
    ep = find(name, where)
    try:
        cls = ep.load()
    except (Exception, SystemExit) as exc:  # an import error inside a third-party plugin
        raise PluginStartError(f"{where} = {name!r}: {ep.value} failed to import: {type(exc).__name__}: {exc}") from exc
    try:
        placement: Placement = cls()
    except SagellmError:
        raise
    except (Exception, SystemExit) as exc:
        raise PluginStartError(f"{where} = {name!r}: failed to start: {type(exc).__name__}: {exc}") from exc
    return placement


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (the instance binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def filled(argv: Sequence[str], host: str, port: int) -> list[str]:
    """``argv`` with its ``{host}`` and ``{port}`` items replaced."""
    return [host if a == HOST else str(port) if a == PORT else a for a in argv]


def tail(path: Path, lines: int) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " | ".join(text[-lines:]) or "no output"


class LocalProcess:
    """:class:`PlacedInstance` of :class:`LocalProcesses`."""

    def __init__(self, command: InstanceCommand, logs: Path, python: str):
        self.command = command
        self.node = "127.0.0.1"
        port = free_port(self.node)
        self.url = f"http://{self.node}:{port}"
        #: Its stdout and stderr, read back when it fails to start.
        self.log = logs / f"{command.name}.log"
        env = {**os.environ, **command.env} if command.env else None
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [python, *filled(command.argv, self.node, port)], stdout=out, stderr=subprocess.STDOUT, env=env
            )
        self.pid = self.process.pid

    def failure(self) -> str | None:
        code = self.process.poll()
        return None if code is None else f"exited with {code}"

    def log_tail(self, lines: int = 5) -> str:
        return tail(self.log, lines)


class LocalProcesses:
    """The ``local`` placement: each instance a child process of this one,
    serving on loopback."""

    def __init__(self) -> None:
        self.started: list[LocalProcess] = []
        self._logs = tempfile.TemporaryDirectory(prefix="sagellm-instances-")

    def front_host(self) -> str:
        return "127.0.0.1"

    def start(self, command: InstanceCommand) -> LocalProcess:
        placed = LocalProcess(command, Path(self._logs.name), sys.executable)
        self.started.append(placed)
        return placed

    def stop(self, grace_s: float) -> None:
        for placed in self.started:
            if placed.process.poll() is None:
                placed.process.send_signal(signal.SIGTERM)
        for placed in self.started:
            try:
                placed.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                placed.process.kill()
                placed.process.wait()
        self._logs.cleanup()
