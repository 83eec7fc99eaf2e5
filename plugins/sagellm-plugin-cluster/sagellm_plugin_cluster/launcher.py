"""The instances of a served cluster as local processes: started, checked
healthy, stopped. Nothing more is managed (no restart, no placement): a
cluster on one machine needs no more, and every child is stopped when the
front stops or when any instance fails to start."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from attrs import define

from sagellm_core.errors import SagellmError

from .clusterfile import ClusterSpec, InstanceSpec

#: Seconds a stopped instance has to exit before it is killed.
STOP_GRACE_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@define
class RunningInstance:
    spec: InstanceSpec
    url: str
    process: subprocess.Popen[bytes]
    #: The process's stdout and stderr, read back when it fails to start.
    log: Path

    def log_tail(self, lines: int = 5) -> str:
        text = self.log.read_text(errors="replace").strip().splitlines() if self.log.exists() else []
        return " | ".join(text[-lines:]) or "no output"


class Launcher:
    """Starts every instance of ``spec`` (:meth:`start`) and stops them all (:meth:`stop`)."""

    def __init__(self, spec: ClusterSpec, log_level: str = "warning", store_port: int | None = None):
        """``store_port``: the front's store, which prefill and decode instances join."""
        self.spec = spec
        self.store_port = store_port
        self.log_level = log_level
        self.running: list[RunningInstance] = []
        self._logs = tempfile.TemporaryDirectory(prefix="sagellm-cluster-")

    def start(self) -> list[RunningInstance]:
        """Start every instance and wait until each answers ``/health``;
        on a failed start (an exit, or no answer within the file's
        ``start_timeout_s``) stop them all and raise, naming the instance."""
        try:
            for spec in self.spec.instances:
                port = free_port()
                log = Path(self._logs.name) / f"{spec.instance_id}.log"
                command = [sys.executable, "-m", "sagellm_plugin_cluster.instance", "--config", str(spec.config_path)]
                command += ["--port", str(port), "--log-level", self.log_level, "--role", spec.role]
                if spec.role != "colocated":
                    if self.store_port is None:
                        raise SagellmError(
                            f"instance {spec.instance_id}: a {spec.role} instance needs the front's store"
                        )
                    command += ["--store-port", str(self.store_port), "--links", ",".join(self.spec.links(spec))]
                    command += ["--lease-s", str(self.spec.lease_s), "--send-timeout-s", str(self.spec.pull_timeout_s)]
                    command += ["--transport", self.spec.transport]
                with log.open("w") as out:
                    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
                self.running.append(RunningInstance(spec, f"http://127.0.0.1:{port}", process, log))
            self._wait_healthy(time.monotonic() + self.spec.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.running

    def _wait_healthy(self, deadline: float) -> None:
        waiting = list(self.running)
        while waiting:
            for instance in list(waiting):
                if instance.process.poll() is not None:
                    raise SagellmError(
                        f"instance {instance.spec.instance_id} ({instance.spec.config_path}) exited with"
                        f" {instance.process.returncode} while starting: {instance.log_tail()}"
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
        """Stop every instance started: terminate, then kill any still
        running after :data:`STOP_GRACE_S`."""
        for instance in self.running:
            if instance.process.poll() is None:
                instance.process.terminate()
        for instance in self.running:
            try:
                instance.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                instance.process.kill()
                instance.process.wait()
        self._logs.cleanup()
