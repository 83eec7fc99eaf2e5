"""Helpers for tests against a live ``sagellm serve`` (this project's, or a
plugin author's): start one on 127.0.0.1 on a free port, wait until healthy,
end it; talk to it with the openai client, read its metrics and KV stats."""

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
    ``sagellm serve``'s arguments (a model and flags); it must answer
    ``/health`` within ``start_timeout_s``."""

    def __init__(self, config: Path | None = None, args: Sequence[str] = (), start_timeout_s: float = 120.0):
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
        deadline = time.monotonic() + start_timeout_s
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
        raise RuntimeError(f"sagellm serve did not become healthy in {start_timeout_s:g} s")

    def stop(self, timeout_s: float = 20.0, must_exit: bool = False) -> int:
        """SIGTERM, then SIGKILL if it is still running ``timeout_s`` later;
        its exit status. With ``must_exit`` a server that had to be killed
        fails the caller (the ``TimeoutExpired`` raised): a front, say, that
        does not stop its instances in time."""
        self.process.terminate()
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            if must_exit:
                raise
            return self.process.wait()


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


def client(server: Server):
    """The official openai client on ``server`` (the ``test`` extra installs it)."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def metrics(server: Server) -> dict[str, float]:
    """``/metrics`` parsed: each sample's value, summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def kv(server: Server, check: bool = False) -> dict:
    """``/kv/stats``; with ``check``, the runtime's invariants too."""
    return httpx.get(f"{server.url}/kv/stats", params={"check_invariants": check}).json()
