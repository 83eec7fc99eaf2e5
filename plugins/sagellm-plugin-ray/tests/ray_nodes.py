"""What the tests of ``sagellm serve --cluster`` with ``placement = "ray"``
share: a Ray cluster of two raylets on this machine, a completion, the
instance actors alive, and a front stopped. Import only where ray, torch,
the torch engine, the server and the cluster plugin are installed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import ray
from ray.cluster_utils import Cluster

#: How long an instance actor may take to start (torch and a model, on a loaded machine).
START_S = 240.0


@contextlib.contextmanager
def two_raylets(second_node_ip: str | None = None) -> Iterator[Cluster]:
    """A head raylet and a second one (on ``second_node_ip``, else on the
    machine's address as Ray picks it), one CPU each, this process joined
    to them (to read the actors' state); all stopped on leaving."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        second = {"node_ip_address": second_node_ip} if second_node_ip else {}
        cluster.add_node(num_cpus=1, **second)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def complete(url: str, prompt: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def instance_actors() -> list[dict]:
    """The instance actors alive, from Ray's actor table (no dashboard needed)."""
    table = ray._private.state.actors().values()
    return [a for a in table if a["ActorClassName"].endswith("InstanceActor") and a["State"] == "ALIVE"]


def stop(front) -> int:
    """Stop a front (``sagellm_plugin_server.testing.Server``) with SIGTERM:
    its exit status; killed, and the test failed, if it is not gone in 120 s."""
    return front.stop(120, must_exit=True)
