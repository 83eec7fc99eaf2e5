"""Helpers for tests against a live ``sagellm serve`` (this project's, or a
plugin author's): start one on 127.0.0.1 on a free port, wait until healthy,
end it."""

import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from sagellm_plugin_torch import testing


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``sagellm serve`` in a subprocess on 127.0.0.1, ended by the fixture:
    ``Server(config)`` serves a config file, ``Server(args=[...])`` takes
    ``sagellm serve``'s arguments (a model and flags)."""

    def __init__(self, config: Path | None = None, args: Sequence[str] = ()):
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        serve = [*args, *(["--config", str(config)] if config is not None else []), "--port", str(self.port)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sagellm_core.cli", "serve", *serve],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sagellm serve exited: {self.process.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("sagellm serve did not become healthy in 120 s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def server_config(folder: Path, model: Path, max_waiting: int = 4096, max_num_seqs: int = 32) -> Path:
    return testing.write_config(
        folder,
        model=str(model),
        num_blocks=256,
        block_size=4,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=256,
        extra=f'[server]\nmax_waiting = {max_waiting}\nmodel_name = "tiny"\n',
    )
