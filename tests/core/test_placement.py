"""Where a served cluster's instances run (``sagellm.placements``): the
``local`` placement starts a command as a child process serving on the
address it picked, reports it gone once it exits, and stops every child,
killing one that ignores SIGTERM; a placement that is not installed is a
one-line error naming it and its pip install."""

from __future__ import annotations

import os
import time
import urllib.request

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sagellm_core import registry
from sagellm_core.drivers import placement
from sagellm_core.drivers.placement import InstanceCommand, LocalProcesses
from sagellm_core.errors import ConfigError

#: An HTTP server on the address the placement gives it, answering every GET with 200.
SERVE = (
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(sys.argv[3].encode())\n"
    "    def log_message(self, *a): pass\n"
    "http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()\n"
)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    status = f"/proc/{pid}/status"
    return os.path.exists(status) and "\nState:\tZ" in open(status).read()


def answer(url: str, deadline_s: float = 30.0) -> str:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:  # the core's tests have no HTTP client
                return str(response.read().decode())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_local_serves_on_the_address_it_fills_in_and_stops_every_child() -> None:
    local = placement.load_placement("local", "placement")
    assert isinstance(local, LocalProcesses) and local.front_host() == "127.0.0.1"
    argv = ("-c", SERVE, placement.HOST, placement.PORT)
    first = local.start(InstanceCommand("a", (*argv, "first")))
    second = local.start(InstanceCommand("b", (*argv, "second"), env={"SAGELLM_X": "1"}))
    try:
        assert first.url != second.url and first.url.startswith("http://127.0.0.1:")
        assert (answer(first.url), answer(second.url)) == ("first", "second")
        assert first.failure() is None and second.failure() is None
    finally:
        local.stop(grace_s=5)
    assert gone(first.pid) and gone(second.pid)
    assert first.failure() == f"exited with {first.process.returncode}" and first.process.returncode != 0


def test_an_exit_is_reported_with_its_output_and_a_stubborn_child_is_killed() -> None:
    local = LocalProcesses()
    failing = local.start(InstanceCommand("failing", ("-c", "import sys; print('no model here'); sys.exit(3)")))
    stubborn = local.start(
        InstanceCommand(
            "stubborn",
            (
                "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)",
            ),
        )
    )
    try:
        failing.process.wait(timeout=30)
        assert failing.failure() == "exited with 3"
        assert failing.log_tail() == "no model here"
        deadline = time.monotonic() + 30
        while stubborn.log_tail() != "up" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stubborn.failure() is None
    finally:
        local.stop(grace_s=0.5)
    assert stubborn.process.returncode == -9  # SIGTERM ignored: killed after the grace
    assert gone(stubborn.pid)


@given(
    st.lists(st.sampled_from(["{host}", "{port}", "{host}:{port}", "-m", "x{port}", ""]) | st.text(max_size=6)),
    st.integers(1, 65535),
)
def test_only_whole_placeholder_items_are_filled(argv: list[str], port: int) -> None:
    out = placement.filled(argv, "10.0.0.7", port)
    assert len(out) == len(argv)
    for given_item, item in zip(argv, out, strict=True):
        expected = {"{host}": "10.0.0.7", "{port}": str(port)}.get(given_item, given_item)
        assert item == expected


@pytest.mark.parametrize("name", ["kubernetes", 3])
def test_an_unknown_placement_is_one_line_naming_the_key(name: object) -> None:
    with pytest.raises(ConfigError) as caught:
        placement.load_placement(name, "cluster.toml: placement")
    message = str(caught.value)
    assert message.startswith(f"cluster.toml: placement = {name!r}: ") and "\n" not in message


@pytest.mark.skipif("ray" in registry.installed(placement.PLACEMENTS), reason="sagellm-plugin-ray is installed")
def test_ray_without_its_plugin_names_the_pip_install() -> None:
    with pytest.raises(
        ConfigError, match=r"placement = 'ray': no such placement; installed: local \(pip install sagellm-plugin-ray\)$"
    ):
        placement.find("ray", "placement")
