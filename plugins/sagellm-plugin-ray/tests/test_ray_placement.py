"""``sagellm serve --cluster`` with ``placement = "ray"``: each instance a
Ray actor on a cluster of two Ray nodes (raylets on this machine, one CPU
each, as two machines would be; each instance asks for one CPU, so Ray
puts one on each node). The front answers through both; an actor killed
is reported gone and the front routes around it; once the front stops, no
actor and no instance process is left. Each instance loads torch and a
tiny random Llama (CPU): marked ``engine``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")
pytest.importorskip("sagellm_plugin_torch")
pytest.importorskip("sagellm_plugin_server")
pytest.importorskip("sagellm_plugin_cluster")

import httpx  # noqa: E402
from sagellm_plugin_server.testing import Server, server_config  # noqa: E402

from .ray_nodes import START_S, complete, instance_actors, stop, two_raylets  # noqa: E402

#: Each instance loads torch and a model: `tox -e ray` runs them (`-m engine`).
pytestmark = pytest.mark.engine

PROMPT = "alpha beta gamma delta epsilon zeta eta theta"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def stats(url: str) -> dict:
    return httpx.get(f"{url}/kv/stats", timeout=60).json()


@pytest.fixture(scope="module")
def two_nodes():
    with two_raylets() as cluster:
        yield cluster


@pytest.fixture
def cluster_file(tmp_path):
    from sagellm_plugin_torch import testing

    model = testing.save_tiny_llama(tmp_path / "model")
    config = server_config(tmp_path, model, max_num_seqs=4)
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(
        f'start_timeout_s = {START_S}\nplacement = "ray"\n[router]\nplugin = "round-robin"\n'
        f'[[instance]]\nconfig = "{config.name}"\ncount = 2\nnum_cpus = 1\n'
    )
    return cluster, config.stem


def test_instances_as_actors_on_both_nodes_routed_around_when_one_dies(two_nodes, cluster_file, monkeypatch):
    cluster_file, _ = cluster_file
    monkeypatch.setenv("RAY_ADDRESS", two_nodes.address)
    front = Server(args=["--cluster", str(cluster_file)], start_timeout_s=START_S)
    try:
        actors = instance_actors()
        first = [complete(front.url, PROMPT) for _ in range(4)]
        before = stats(front.url)
        pids = {name: i["pid"] for name, i in before["instances"].items()}
        parents = {name: parent(pid) for name, pid in pids.items()}
        # One actor's process dies (as its machine would): Ray reports the
        # actor dead, its instance goes with it, the front routes around it.
        dead, live = sorted(pids)
        os.kill(parents[dead], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while alive(pids[dead]) and time.monotonic() < deadline:
            time.sleep(0.2)
        running = {name: alive(pid) for name, pid in pids.items()}
        health = httpx.get(f"{front.url}/health", timeout=60)
        time.sleep(5.0)  # the watch looks once a second
        after = [complete(front.url, PROMPT) for _ in range(4)]
        later = stats(front.url)
    finally:
        code = stop(front)
    output = front.process.stdout.read()
    assert len(actors) == 2 and len({a["Address"]["NodeID"] for a in actors}) == 2  # one instance on each node
    assert [a.status_code for a in first] == [200] * 4
    texts = {a.json()["choices"][0]["text"] for a in first}
    assert len(texts) == 1 and texts != {""}  # greedy: both instances answer alike
    assert {i["routed"] for i in before["instances"].values()} == {2}  # round robin over both
    # Each instance is its actor's child; the killed actor's went with it, the other runs.
    assert set(parents.values()) == {a["Pid"] for a in actors}
    assert running == {dead: False, live: True}
    assert health.status_code == 503 and dead in health.text
    assert f"sagellm: instance {dead} at http://" in output and "lost its Ray actor" in output
    assert [a.status_code for a in after] == [200] * 4
    assert {a.json()["choices"][0]["text"] for a in after} == texts
    assert later["requests"] == {"forwarded": 8, "failed": 0}
    assert later["instances"][live]["routed"] == 6 and later["instances"][dead]["routed"] == 2
    assert code == 128 + signal.SIGTERM
    assert not [pid for pid in pids.values() if alive(pid)]
    deadline = time.monotonic() + 30
    while instance_actors() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert instance_actors() == []


def test_an_actor_no_node_can_hold_is_one_line_and_nothing_is_left(two_nodes, cluster_file, monkeypatch, capsys):
    """Ray finds no node with the instance's resources: the start fails
    naming the instance, and the actors already placed are gone."""
    from sagellm_plugin_ray import placement

    cluster_file, stem = cluster_file
    monkeypatch.setenv("RAY_ADDRESS", two_nodes.address)
    # Long enough for a loaded machine to start the first actor, which fits;
    # the second, which no node can hold, waits out a short one (its wait
    # is the same whatever its length).
    start = placement.RayActors.start

    def start_with_timeout(self, command):
        monkeypatch.setattr(placement, "PLACE_TIMEOUT_S", 5.0 if command.num_gpus else 60.0)
        return start(self, command)

    monkeypatch.setattr(placement.RayActors, "start", start_with_timeout)
    text = cluster_file.read_text().replace("count = 2\n", "")
    cluster_file.write_text(text + f'[[instance]]\nconfig = "{stem}.toml"\nnum_cpus = 0.5\nnum_gpus = 1\n')
    from sagellm_core.cli import main

    assert main(["serve", "--cluster", str(cluster_file), "--port", "0"]) != 0
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"instance {stem}-1: Ray found no node with num_cpus=0.5, num_gpus=1 free in 5 s" in error
    deadline = time.monotonic() + 30
    while instance_actors() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert instance_actors() == []


def test_commands_with_the_front_stay_on_its_node_and_stop_leaves_nothing(two_nodes):
    """The placement alone, on commands that need no model: those
    ``with_front`` (prefill and decode instances of a cluster file with
    ``pd_on_front_node``) land on the caller's node, serving on its
    address, the others where Ray puts them; an exit is reported with its
    status; ``stop`` leaves no actor and no process."""
    from sagellm_plugin_ray.placement import RayActors

    from sagellm_core.drivers.placement import InstanceCommand

    sleep = ("-c", "import sys, time; print(sys.argv[1:], flush=True); time.sleep(120)", "{host}", "{port}")
    placement = RayActors()
    try:
        here = ray.get_runtime_context().get_node_id()
        near = [placement.start(InstanceCommand(f"near-{n}", sleep, num_cpus=0, with_front=True)) for n in range(3)]
        exits = placement.start(InstanceCommand("exits", ("-c", "import sys; sys.exit(4)"), num_cpus=1))
        deadline = time.monotonic() + 60
        while exits.failure() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert exits.failure() == "exited with 4 in its Ray actor"
        assert [p.failure() for p in near] == [None] * 3
        node = ray.util.get_node_ip_address()
        assert all(p.url == f"http://{node}:{p.url.rsplit(':', 1)[1]}" for p in near)  # the front's node's address
        near_ids = {p.actor._actor_id.hex() for p in near}
        assert {a["Address"]["NodeID"] for a in instance_actors() if a["ActorID"] in near_ids} == {here}
        pids = [p.pid for p in (*near, exits)]
    finally:
        placement.stop(grace_s=5)
    assert not [pid for pid in pids if alive(pid)]
    deadline = time.monotonic() + 30
    while instance_actors() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert instance_actors() == []
    assert ray.is_initialized()  # joined, not started: left running
