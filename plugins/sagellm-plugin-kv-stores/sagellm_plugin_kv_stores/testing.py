"""A redis-server of its own for tests and benchmarks: Debian's
``redis-server`` on a free local port, no persistence, stopped on exit."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator


@contextlib.contextmanager
def redis_server(timeout_s: float = 10.0) -> Iterator[str | None]:
    """The URL of a fresh redis-server listening on 127.0.0.1, or ``None``
    where the binary is not installed. A server that does not start within
    ``timeout_s`` is a RuntimeError naming its port."""
    server = shutil.which("redis-server")
    if server is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        command = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        process = subprocess.Popen([*command, "--dir", folder], stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or process.poll() is not None:
                        raise RuntimeError(f"redis-server did not start on port {port}") from None
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait()
