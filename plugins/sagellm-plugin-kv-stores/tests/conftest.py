import shutil
import socket
import subprocess
import time

import pytest


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A redis-server of its own on a free port (Debian's redis-server
    package; CI installs it), no persistence; skipped where it is absent."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server): the Redis store is not tested")
    pytest.importorskip("redis", reason="the redis client is not installed (sagellm-plugin-kv-stores[redis])")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                pytest.fail(f"redis-server did not start on port {port}")
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    process.terminate()
    process.wait()
