"""An instance its placement reports gone: the watch says so once, on one
line naming it, and the router is no longer offered it, unless it is the
last of its kind (then every instance is offered, and the front's own
fallback answers; fuzzed over roles, loads and the instances gone). Real
local processes stand for the instances."""

from __future__ import annotations

import io
import signal
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# The launcher is the `serve` extra's (it checks an instance's health with httpx).
pytest.importorskip("httpx")

from sagellm_plugin_cluster import clusterfile  # noqa: E402
from sagellm_plugin_cluster.launcher import LiveRouter, RunningInstance, Watch  # noqa: E402

from sagellm_core.drivers.placement import InstanceCommand, LocalProcesses  # noqa: E402
from sagellm_core.types import InstanceLoad, Request  # noqa: E402

INSTANCE = """
[engine]
name = "torch"
model = "m"
[prefix_cache]
plugin = "radix"
block_size = 4
[kv_pool]
plugin = "paged"
num_blocks = 64
[eviction]
plugin = "lru"
[scheduler]
passes = ["fcfs"]
"""
SLEEP = ("-c", "import time; print('serving', flush=True); time.sleep(120)")


def cluster(folder: Path, roles: list[str]) -> clusterfile.ClusterSpec:
    (folder / "i.toml").write_text(INSTANCE)
    tables = "".join(f'[[instance]]\nconfig = "i.toml"\nrole = "{role}"\n' for role in roles)
    (folder / "cluster.toml").write_text(f'[router]\nplugin = "round-robin"\n{tables}')
    return clusterfile.load(folder / "cluster.toml")


@pytest.fixture
def local():
    placed = LocalProcesses()
    yield placed
    placed.stop(grace_s=5)


def started(spec: clusterfile.ClusterSpec, local: LocalProcesses) -> list[RunningInstance]:
    return [RunningInstance(i, local.start(InstanceCommand(i.instance_id, SLEEP))) for i in spec.instances]


def loads(running: list[RunningInstance]) -> list[InstanceLoad]:
    return [InstanceLoad(r.spec.instance_id, r.spec.role, 0, 0, 0) for r in running]


def kill(instance: RunningInstance) -> None:
    process = instance.placed.process  # type: ignore[attr-defined]
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def test_a_gone_instance_is_reported_once_and_no_longer_routed(tmp_path: Path, local: LocalProcesses) -> None:
    spec = cluster(tmp_path, ["colocated"] * 3)
    running = started(spec, local)
    out = io.StringIO()
    watch = Watch(running, out=out)
    router = LiveRouter(spec.router, watch)
    watch.look()
    assert watch.gone == {} and out.getvalue() == ""
    kill(running[1])
    watch.look()
    watch.look()
    assert watch.gone == {"i-1": "exited with -9"}
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sagellm: instance i-1 at http://127.0.0.1:")
    assert "exited with -9: no longer routed" in lines[0]
    chosen = {router.route(Request(f"r{n}", [1, 2, 3], 4), loads(running), 0.0).instance_id for n in range(6)}
    assert chosen == {"i-0", "i-2"}
    assert router.plugin_name == "round-robin"


def test_the_last_prefill_instance_is_still_offered(tmp_path: Path, local: LocalProcesses) -> None:
    spec = cluster(tmp_path, ["prefill", "decode", "decode"])
    running = started(spec, local)
    watch = Watch(running, out=io.StringIO())
    router = LiveRouter(spec.router, watch)
    kill(running[2])  # a decode instance: the other takes its requests
    watch.look()
    decisions = [router.route(Request(f"r{n}", [1, 2, 3], 4), loads(running), 0.0) for n in range(4)]
    assert {(d.instance_id, d.decode_instance_id) for d in decisions} == {("i-0", "i-1")}
    kill(running[0])  # the only prefill instance: still offered, its decode instance computes
    watch.look()
    assert set(watch.gone) == {"i-0", "i-2"}
    decisions = [router.route(Request(f"s{n}", [1, 2, 3], 4), loads(running), 0.0) for n in range(4)]
    assert {d.instance_id for d in decisions} == {"i-0"}


def test_the_watch_thread_looks_until_closed(tmp_path: Path, local: LocalProcesses) -> None:
    spec = cluster(tmp_path, ["colocated"] * 2)
    running = started(spec, local)
    watch = Watch(running, interval_s=0.05, out=io.StringIO()).start()
    try:
        kill(running[0])
        for _ in range(600):
            if watch.gone:
                break
            watch._quit.wait(0.05)
    finally:
        watch.close()
    assert set(watch.gone) == {"i-0"}
    assert not watch._thread.is_alive()


@pytest.fixture(scope="module", params=["round-robin", "least-loaded", "kv-aware"])
def any_router(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("routers")
    (folder / "i.toml").write_text(INSTANCE)
    (folder / "cluster.toml").write_text(f'[router]\nplugin = "{request.param}"\n[[instance]]\nconfig = "i.toml"\n')
    return clusterfile.load(folder / "cluster.toml").router


roles = st.one_of(
    st.lists(st.just("colocated"), min_size=1, max_size=5),
    st.tuples(st.integers(1, 3), st.integers(1, 3)).map(lambda n: ["prefill"] * n[0] + ["decode"] * n[1]),
)


@settings(max_examples=150, deadline=None)
@given(roles=roles, data=st.data())
def test_fuzz_the_router_is_offered_only_live_instances_while_each_kind_has_one(any_router, roles, data) -> None:
    ids = [f"i-{n}" for n in range(len(roles))]
    gone = data.draw(st.sets(st.sampled_from(ids), max_size=len(ids)), label="gone")
    watch = Watch([], out=io.StringIO())
    watch.gone.update((name, "exited with -9") for name in gone)
    router = LiveRouter(any_router, watch)
    offered = [
        InstanceLoad(name, role, data.draw(st.integers(0, 500)), data.draw(st.integers(0, 4)), 0)
        for name, role in zip(ids, roles, strict=True)
    ]
    decision = router.route(Request("r", [1, 2, 3, 4, 5], 4), offered, 0.0)  # checked by the core's Router
    live_roles = {role for name, role in zip(ids, roles, strict=True) if name not in gone}
    kinds_left = bool(live_roles & {"colocated", "prefill"}) and ("prefill" not in live_roles or "decode" in live_roles)
    if kinds_left:
        assert decision.instance_id not in gone and decision.decode_instance_id not in gone
