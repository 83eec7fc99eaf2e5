"""The cluster in replay: one colocated instance is the replay engine;
disaggregated and multi-instance runs end every request with every
instance's accounting whole; lost KV events degrade and heal the index."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sagellm_plugin_cluster.links import LINKS, TransferTime

from sagellm_core.cli import check_config
from sagellm_core.errors import ConfigError
from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.replay import session

BASE = """
[engine]
name = "{engine}"
max_num_batched_tokens = 2048
max_num_seqs = 32
[workload]
max_requests = {requests}
[prefix_cache]
plugin = "radix"
block_size = 16
[kv_pool]
plugin = "paged"
num_blocks = {blocks}
[eviction]
plugin = "lru"
[scheduler]
passes = ["fcfs"]
[report]
hook_timing = false
"""


def run(cluster: str = "", router: str = "kv-aware", engine: str = "cluster", requests: int = 120, blocks: int = 3000):
    text = BASE.format(engine=engine, requests=requests, blocks=blocks)
    if engine == "cluster":
        text += f'[router]\nplugin = "{router}"\n[cluster]\n{cluster}\n'
    return session.run(settings_from_toml(text)).report


FIGURES = ("requests", "rejected", "block_hit_rate", "prefill_tokens", "preemptions", "ttft_s", "tpot_s", "simulated_s")


def test_a_cluster_of_one_colocated_instance_is_the_replay_engine():
    alone, cluster = run(engine="replay"), run("colocated = 1")
    assert {k: cluster[k] for k in FIGURES} == {k: alone[k] for k in FIGURES}
    assert cluster["pool_utilisation_mean"] == alone["pool_utilisation_mean"]


def test_prefill_and_decode_instances_hand_every_request_over():
    report = run("prefill = 1\ndecode = 1")
    cluster = report["cluster"]
    prefill, decode = cluster["instances"]
    assert report["requests"] == report["requests_read"] == prefill["requests"] == decode["requests"]
    assert cluster["kv_transfers"] == report["requests"] and cluster["kv_bytes"] > 0
    # The prompts are computed on the prefill side; the decode side computes only the tails.
    assert report["prefill_tokens"] == prefill["prefill_tokens"] > decode["prefill_tokens"]
    assert report["block_hit_rate"] == prefill["block_hit_rate"]


def test_a_small_pool_preempts_and_still_ends_every_request_on_every_instance():
    report = run("prefill = 2\ndecode = 2", router="least-loaded", requests=150, blocks=160)
    assert report["requests"] + report["rejected"] == report["requests_read"]
    assert report["preemptions"] == sum(i["preemptions"] for i in report["cluster"]["instances"]) > 0


def test_kv_aware_routing_finds_more_of_the_prompts_cached_than_round_robin():
    blind = run("colocated = 4", router="round-robin", requests=300)
    aware = run("colocated = 4", router="kv-aware", requests=300)
    assert aware["block_hit_rate"] > blind["block_hit_rate"]


def test_lost_event_batches_degrade_the_index_until_replayed_and_every_request_ends():
    report = run("colocated = 3\nevent_loss = 0.3\nevent_replay_s = 0.5", requests=200)
    events = report["cluster"]["events"]
    assert events["lost"] > 0 and events["gaps"] > 0
    assert 0 < report["cluster"]["routing"]["degraded"] < report["requests"]
    assert report["requests"] == report["requests_read"]


def test_a_router_restart_routes_by_load_until_the_instances_replay_their_events():
    steady = run("colocated = 3", requests=200)
    restarted = run("colocated = 3\nrouter_restart_s = 40.0\nevent_replay_s = 2.0", requests=200)
    routing, events = restarted["cluster"]["routing"], restarted["cluster"]["events"]
    assert events["router_restarts"] == 1 and steady["cluster"]["routing"]["degraded"] == 0
    # Requests arriving in the 2 s the replay takes are routed degraded; after it, exact again.
    assert 0 < routing["degraded"] < routing["decisions"] / 2
    assert restarted["requests"] == restarted["requests_read"]


@pytest.mark.parametrize(
    ("cluster", "says"),
    [
        ("decode = 1", "give both or neither"),
        ("", "no instance that computes prompts"),
        ('colocated = 1\nlink = "carrier-pigeon"', "link = 'carrier-pigeon': accepted: pcie-gen5"),
        ("colocated = 1\nevent_loss = 1.0", "event_loss = 1.0: a probability"),
    ],
)
def test_a_bad_cluster_section_is_one_line_naming_the_key(cluster, says):
    with pytest.raises(ConfigError, match=says) as caught:
        run(cluster)
    assert "\n" not in str(caught.value)


def test_a_cluster_replays_in_timed_mode_only():
    text = (
        BASE.format(engine="cluster", requests=5, blocks=100)
        + '[router]\nplugin = "kv-aware"\n[cluster]\ncolocated = 1\n'
    )
    with pytest.raises(ConfigError, match="timed mode only"):
        session.run(settings_from_toml(text.replace('name = "cluster"', 'name = "cluster"\nmode = "cache-only"')))


@settings(max_examples=100, deadline=None)
@given(
    link=st.sampled_from(sorted(LINKS)),
    num_bytes=st.integers(1, 1 << 34),
    prefill_s=st.floats(0, 10),
    more=st.integers(0, 1 << 30),
)
def test_layerwise_overlap_never_takes_longer_and_more_bytes_never_take_less(link, num_bytes, prefill_s, more):
    pull = TransferTime(LINKS[link], 0.8, 32, layerwise=False)
    overlap = TransferTime(LINKS[link], 0.8, 32, layerwise=True)
    assert overlap.seconds(num_bytes, prefill_s) <= pull.seconds(num_bytes)
    assert overlap.seconds(num_bytes + more, prefill_s) >= overlap.seconds(num_bytes, prefill_s)
    # What is left after a prefill is at least the last layer's share.
    assert overlap.seconds(num_bytes, prefill_s) >= pull.seconds(num_bytes) / 32


def test_config_check_names_the_instances_plugins_and_the_router():
    text = (
        BASE.format(engine="cluster", requests=5, blocks=100)
        + '[router]\nplugin = "kv-aware"\n[cluster]\nprefill = 1\ndecode = 1\n'
    )
    lines = check_config(settings_from_toml(text))
    assert "prefix_cache=radix, kv_pool=paged, eviction=lru" in lines[0]
    assert any(line.startswith("  router 'kv-aware': sagellm-plugin-cluster") for line in lines)
    assert "  cluster: {'colocated': 0, 'prefill': 1, 'decode': 1," in "\n".join(lines)


@settings(max_examples=12, deadline=None)
@given(
    shape=st.sampled_from(["colocated = 2", "prefill = 1\ndecode = 2", "colocated = 1\nprefill = 2\ndecode = 1"]),
    router=st.sampled_from(["round-robin", "least-loaded", "kv-aware"]),
    blocks=st.integers(40, 400),
    loss=st.sampled_from([0.0, 0.5]),
    restart=st.sampled_from([0.0, 5.0]),
    layerwise=st.booleans(),
)
def test_any_cluster_ends_every_request_with_every_instance_whole(shape, router, blocks, loss, restart, layerwise):
    cluster = f"{shape}\nevent_loss = {loss}\nrouter_restart_s = {restart}\nlayerwise = {str(layerwise).lower()}"
    report = run(cluster, router=router, requests=40, blocks=blocks)  # raises if an instance's accounting broke
    assert report["requests"] + report["rejected"] == report["requests_read"] == 40
    instances = report["cluster"]["instances"]
    prefilled = sum(i["requests"] for i in instances if i["role"] == "prefill")
    decoded = sum(i["requests"] + i["rejected"] for i in instances if i["role"] == "decode")
    assert decoded == prefilled  # every prefill was handed to a decode instance, and ended there
