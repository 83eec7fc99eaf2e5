"""``sagellm serve --cluster`` with ``placement = "ray"``, a prefill and a
decode instance on two Ray nodes with different addresses: a head raylet
on the machine's address (as Ray picks it) and a second one on
``127.0.0.2``, one CPU each. All of 127.0.0.0/8 is loopback on Linux: this
is one machine with two addresses, not two machines. Each instance serves,
and binds its transport, on its node's address; KV goes over gloo and the
Mooncake Transfer Engine and NIXL (each where it is installed), and the
greedy outputs equal one instance's. Marked ``engine``: ``tox -e ray``."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("torch")
pytest.importorskip("sagellm_plugin_torch")
pytest.importorskip("sagellm_plugin_server")
pytest.importorskip("sagellm_plugin_cluster")

import httpx  # noqa: E402
from sagellm_plugin_server.testing import Server, server_config  # noqa: E402

from .ray_nodes import START_S, complete, instance_actors, stop, two_raylets  # noqa: E402

pytestmark = pytest.mark.engine


#: The second raylet's address. (Ray replaces 127.0.0.1 by the machine's own
#: address wherever it is given, so the head keeps that one, as Ray picks it.)
SECOND_NODE_IP = "127.0.0.2"
#: Four prompts of the tiny model's own words (``w0`` .. ``w127``, one token
#: each), no two sharing a first block: each transfer moves every full
#: block of its prompt (block size 4), none of them already on the decode side.
PD_PROMPTS = [" ".join(f"w{10 * i + j}" for j in range(9 + i)) for i in range(4)]
PD_BLOCKS = sum((len(p.split()) - 1) // 4 for p in PD_PROMPTS)


@pytest.fixture(scope="module")
def two_addresses():
    """A head raylet on the machine's address and a second one on
    ``SECOND_NODE_IP``, one CPU each."""
    with two_raylets(SECOND_NODE_IP) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    from sagellm_plugin_torch import testing

    folder = tmp_path_factory.mktemp("pd-nodes")
    model = testing.save_tiny_llama(folder / "model")
    return server_config(folder, model, max_num_seqs=4)


@pytest.fixture(scope="module")
def one_instance(model_config):
    """Each prompt's greedy output from one instance: ``sagellm serve`` alone."""
    server = Server(model_config)
    try:
        return [complete(server.url, p).json()["choices"][0]["text"] for p in PD_PROMPTS]
    finally:
        server.stop()


@pytest.mark.parametrize("transport", ["gloo", "mooncake", "nixl"])
def test_prefill_and_decode_on_two_nodes_exchange_kv(transport, two_addresses, model_config, one_instance, monkeypatch):
    """1P1D with ``placement = "ray"``: Ray puts the prefill and the decode
    instance on different nodes (one CPU each), each serving, and binding
    its transport, on its node's address; every transfer is done over the
    file's transport, the greedy outputs equal one instance's, and both
    instances' accounting is whole afterwards (``check_invariants``)."""
    from sagellm_plugin_cluster import transports

    from sagellm_core.errors import SagellmError

    try:
        transports.load(transport)
    except SagellmError as exc:  # its package is not installed here
        pytest.skip(str(exc))
    monkeypatch.setenv("RAY_ADDRESS", two_addresses.address)
    cluster_file = model_config.parent / f"pd-{transport}.toml"
    instances = "".join(
        f'[[instance]]\nconfig = "{model_config.name}"\nrole = "{role}"\nnum_cpus = 1\n'
        for role in ("prefill", "decode")
    )
    cluster_file.write_text(
        f'start_timeout_s = {START_S}\nplacement = "ray"\ntransport = "{transport}"\npull_timeout_s = 20\n'
        f'[router]\nplugin = "kv-aware"\n{instances}'
    )
    front = Server(args=["--cluster", str(cluster_file)], start_timeout_s=START_S)
    try:
        actors = instance_actors()
        answers = [complete(front.url, p) for p in PD_PROMPTS]
        after = httpx.get(f"{front.url}/kv/stats", params={"check_invariants": True}, timeout=60).json()
    finally:
        stop(front)
    nodes = {a["Address"]["IPAddress"] for a in actors}
    assert len(actors) == 2 and len(nodes) == 2 and SECOND_NODE_IP in nodes, actors  # one on each address
    assert [a.status_code for a in answers] == [200] * len(PD_PROMPTS)
    assert [a.json()["choices"][0]["text"] for a in answers] == one_instance
    assert after["transfers"] == {"done": len(PD_PROMPTS), "failed": 0, "expired": 0}
    by_role = {i["role"]: i for i in after["instances"].values()}
    assert {i["invariants"] for i in by_role.values()} == {"ok"}
    pulled = by_role["decode"]["transfers"]
    assert pulled["done"] == len(PD_PROMPTS) and pulled["blocks"] == PD_BLOCKS, pulled
