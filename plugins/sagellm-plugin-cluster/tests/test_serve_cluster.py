"""``sagellm serve --cluster``: two colocated instances of the torch engine
(a tiny random Llama, CPU) behind the routing front, and one prefill with
one decode instance (1P1D, KV pulled over gloo, and read in place over the
Mooncake Transfer Engine and NIXL where they are installed). Greedy outputs through
the front equal one instance's (``sagellm serve`` on the same config),
streamed or not; requests sharing a prefix meet on one instance under the
KV-aware router; with the prefill instance killed, the decode instance
computes each prompt (the failed transfers counted) and answers the same;
every instance process is gone once the front stops, or once an instance
fails to start; the front's own token ids and block keys are an
instance's (``/tokenize``, ``/kv/keys``), its cache full or empty. Marked ``engine`` (each process loads
torch and the model): ``tox -e cluster-transfer`` runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sagellm_plugin_torch")
pytest.importorskip("sagellm_plugin_server")

import httpx  # noqa: E402
from sagellm_plugin_cluster import clusterfile, transports  # noqa: E402
from sagellm_plugin_cluster.front import PromptKeys  # noqa: E402
from sagellm_plugin_cluster.launcher import Launcher  # noqa: E402
from sagellm_plugin_server.testing import Server, server_config  # noqa: E402

from sagellm_core.errors import SagellmError  # noqa: E402
from sagellm_core.types import Request  # noqa: E402

pytestmark = pytest.mark.engine

#: Six prompts over two shared prefixes of several blocks (block size 4).
PREFIXES = ["alpha beta gamma delta epsilon zeta eta theta", "one two three four five six seven eight nine"]
PROMPTS = [f"{PREFIXES[i % 2]} tail {i} " + "word " * i for i in range(6)]
CHATS = [[{"role": "user", "content": f"{PREFIXES[0]} question {i}"}] for i in range(2)]
START_S = 300.0
#: A prefill instance's lease in the 1P1D cluster: the front sweeps what a
#: transfer left on its store this long (plus its grace) after it.
LEASE_S = 10.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A child that exited but was not yet reaped by its parent is gone too.
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


def serve_cluster(cluster: Path) -> Server:
    """``sagellm serve --cluster FILE`` in a subprocess on a free port."""
    return Server(args=["--cluster", str(cluster)], start_timeout_s=START_S)


def stop(front: Server) -> int:
    """Stop the front (SIGTERM) and return its exit status; it has as long
    as its instances take to stop, and fails the test past 120 s."""
    return front.stop(120, must_exit=True)


def settled_stats(url: str, n: int) -> dict:
    """``/kv/stats`` once the front has counted ``n`` requests (a stream is
    counted after its last chunk, which the client may read first)."""
    deadline = time.monotonic() + 30
    while True:
        stats = httpx.get(f"{url}/kv/stats", params={"check_invariants": True}, timeout=60).json()
        if sum(stats["requests"].values()) >= n or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def swept_stats(url: str) -> dict:
    """``/kv/stats`` once the front has no transfer left to sweep (each is
    swept ``LEASE_S`` + its grace after it ended)."""
    from sagellm_plugin_cluster.front import SWEEP_GRACE_S

    deadline = time.monotonic() + LEASE_S + SWEEP_GRACE_S + 30
    while True:
        stats = httpx.get(f"{url}/kv/stats", timeout=60).json()
        if stats["store"]["to_sweep"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


def complete(url: str, prompt: str) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def chat_stream(url: str, messages: list[dict]) -> str:
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
    text = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
    return "".join(text)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    from sagellm_plugin_torch import testing

    folder = tmp_path_factory.mktemp("serve-cluster")
    model = testing.save_tiny_llama(folder / "model")
    config = server_config(folder, model, max_num_seqs=4)
    cluster = folder / "cluster.toml"
    cluster.write_text(
        f'start_timeout_s = {START_S}\n[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "{config.name}"\ncount = 2\n'
    )
    return folder, config, cluster


@pytest.fixture(scope="module", params=["gloo", "mooncake", "nixl"])
def disaggregated(configs, request):
    transport = request.param
    try:
        transports.load(transport)
    except SagellmError as exc:  # its package is not installed
        pytest.skip(str(exc))
    folder, config, _ = configs
    cluster = folder / f"pd-{transport}.toml"
    # Each side's transport on an address of its own (127.0.0.0/8 is loopback: one machine, two addresses).
    instances = "".join(
        f'[[instance]]\nconfig = "{config.name}"\nrole = "{role}"\nhost = "{host}"\n'
        for role, host in (("prefill", "127.0.0.2"), ("decode", "127.0.0.3"))
    )
    cluster.write_text(
        f'start_timeout_s = {START_S}\npull_timeout_s = 20\nlease_s = {LEASE_S}\ntransport = "{transport}"\n'
        f'[router]\nplugin = "kv-aware"\n{instances}'
    )
    return cluster


@pytest.fixture(scope="module")
def reference(configs):
    """Each prompt's greedy output from one instance: ``sagellm serve`` alone."""
    _, config, _ = configs
    server = Server(config)
    try:
        return [complete(server.url, p) for p in PROMPTS], [chat_stream(server.url, m) for m in CHATS]
    finally:
        server.stop()


def test_front_answers_as_one_instance_and_stops_every_child(configs, reference):
    _, _, cluster = configs
    front = serve_cluster(cluster)
    try:
        completions = [complete(front.url, p) for p in PROMPTS]
        chats = [chat_stream(front.url, m) for m in CHATS]
        models = httpx.get(f"{front.url}/v1/models").json()
        stats = settled_stats(front.url, len(PROMPTS) + len(CHATS))
    finally:
        code = stop(front)
    assert (completions, chats) == reference
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert stats["router"] == "kv-aware"
    assert stats["requests"] == {"forwarded": len(PROMPTS) + len(CHATS), "failed": 0}
    instances = stats["instances"]
    assert sum(i["routed"] for i in instances.values()) == len(PROMPTS) + len(CHATS)
    assert {i["invariants"] for i in instances.values()} == {"ok"}
    # Prompts sent one at a time over two prefixes: once a prefix's blocks
    # are published, its later prompts go where they are, and hit them.
    assert sum(i["block_hit_rate"] > 0 for i in instances.values()) >= 1
    assert code == 128 + signal.SIGTERM  # stopped by the signal, after its instances
    assert not [pid for pid in (i["pid"] for i in instances.values()) if alive(pid)]


def test_disaggregated_answers_as_one_instance_and_falls_back_to_recompute(disaggregated, reference):
    front = serve_cluster(disaggregated)
    try:
        completions = [complete(front.url, p) for p in PROMPTS]
        chats = [chat_stream(front.url, m) for m in CHATS]
        stats = settled_stats(front.url, len(PROMPTS) + len(CHATS))
        by_role = {i["role"]: i for i in stats["instances"].values()}
        os.kill(by_role["prefill"]["pid"], signal.SIGKILL)
        after_kill = [complete(front.url, p) for p in PROMPTS[:2]]
        after = settled_stats(front.url, len(PROMPTS) + len(CHATS) + 2)
        swept = swept_stats(front.url)
    finally:
        stop(front)
    assert (completions, chats) == reference
    assert after_kill == reference[0][:2]
    served = len(PROMPTS) + len(CHATS)
    assert stats["transfers"] == {"done": served, "failed": 0, "expired": 0}
    pulled = by_role["decode"]["transfers"]
    assert pulled["done"] == served and pulled["blocks"] > 0 and pulled["recomputed_tokens"] == 0
    assert by_role["prefill"]["transfers"]["leases_ended"]["done"] == served
    assert {i["invariants"] for i in by_role.values()} == {"ok"}
    # The prefill instance gone: each request's transfer failed, and the
    # decode instance computed the prompt, its accounting whole.
    assert after["transfers"] == {"done": served, "failed": 2, "expired": 0}
    assert after["requests"] == {"forwarded": served + 2, "failed": 0}
    decode = next(i for i in after["instances"].values() if i["role"] == "decode")
    assert decode["invariants"] == "ok"
    # Every transfer is over and its lease's deadline past: no key of one is left on the store.
    assert swept["store"]["transfer_keys"] == 0 and swept["store"]["to_sweep"] == 0, swept["store"]
    assert not [pid for pid in (i["pid"] for i in by_role.values()) if alive(pid)]


def test_front_computes_the_ids_and_keys_an_instance_gives(configs):
    folder, config, _ = configs
    cluster = folder / "one.toml"
    cluster.write_text(
        f'start_timeout_s = {START_S}\n[router]\nplugin = "kv-aware"\n[[instance]]\nconfig = "{config.name}"\n'
    )
    spec = clusterfile.load(cluster)
    keys = PromptKeys.of_instance(spec.instances[0].settings)
    launcher = Launcher(spec)
    (instance,) = launcher.start()
    bodies = [({"prompt": p}, False) for p in PROMPTS] + [({"messages": m}, True) for m in CHATS]
    compared = 0
    try:
        for cache_full in (False, True):
            if cache_full:  # the instance's cache now holds the prompts' blocks: its keys are read off its tree
                for p in PROMPTS:
                    complete(instance.url, p)
            for body, chat in bodies:
                for salt in (None, "tenant-a"):
                    asked = {**body, "add_generation_prompt": True} if chat else body
                    ids = httpx.post(f"{instance.url}/tokenize", json=asked, timeout=60).json()["tokens"]
                    given = {"token_ids": ids, "cache_salt": salt}
                    theirs = httpx.post(f"{instance.url}/kv/keys", json=given, timeout=60).json()["keys"]
                    assert keys.token_ids(body, chat) == ids
                    assert keys.keys(Request("keys", ids, 1, cache_salt=salt)) == theirs
                    compared += len(theirs) > 0
    finally:
        launcher.stop()
    assert compared == 2 * 2 * len(bodies)


def test_failed_start_stops_every_instance(configs, tmp_path):
    folder, config, _ = configs
    broken = tmp_path / "broken.toml"
    broken.write_text(config.read_text())
    good = tmp_path / "good.toml"
    good.write_text(config.read_text())
    # The broken instance's model folder is emptied after the file is
    # checked: it exits while loading.
    model = tmp_path / "model"
    model.mkdir()
    broken.write_text(config.read_text().replace(str(folder / "model"), str(model)))
    cluster = tmp_path / "cluster.toml"
    cluster.write_text('[router]\nplugin = "round-robin"\n[[instance]]\nconfig = "good.toml"\n')
    spec = clusterfile.load(cluster)
    broken_spec = clusterfile.InstanceSpec("broken-0", "colocated", broken, spec.instances[0].settings)
    launcher = Launcher(clusterfile.ClusterSpec(cluster, (*spec.instances, broken_spec), spec.router, START_S))
    with pytest.raises(SagellmError, match="instance broken-0 .* exited with"):
        launcher.start()
    assert len(launcher.running) == 2
    assert not [r for r in launcher.running if r.placed.failure() is None]


def test_a_front_stopped_while_its_instances_start_stops_them(configs):
    """SIGTERM before every instance answers /health: the front stops the
    instances it started, and exits by the signal."""
    _, _, cluster = configs
    front = subprocess.Popen(
        [sys.executable, "-m", "sagellm_core.cli", "serve", "--cluster", str(cluster), "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while len(children(front.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        started = children(front.pid)
        front.terminate()
        code = front.wait(timeout=120)
    finally:
        if front.poll() is None:
            front.kill()
    assert len(started) == 2
    assert code == 128 + signal.SIGTERM
    assert not [pid for pid in started if alive(pid)]


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found
