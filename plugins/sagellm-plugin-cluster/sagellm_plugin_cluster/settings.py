"""The ``[cluster]`` config section (declared through ``sagellm.sections``):
the instances of a cluster by role, how KV travels between them, and the
SLOs goodput is counted under."""

from __future__ import annotations

from attrs import frozen

from .links import LINKS


@frozen
class ClusterSettings:
    #: Instances by role: colocated ones serve whole requests; prefill ones
    #: compute prompts and hand the KV to decode ones.
    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    #: The link between a prefill and a decode instance (``links.LINKS``).
    link: str = "rdma-200g"
    #: The share of the link's peak a transfer reaches.
    link_efficiency: float = 0.8
    #: Each layer's KV sent as soon as the layer is computed (else pulled after the prefill).
    layerwise: bool = True
    #: The SLOs a request meets to count in goodput: time to its first token,
    #: and mean time per later token.
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    #: The chance that an instance's batch of KV events is lost on its way to
    #: the router (a fault, for studying the degraded index).
    event_loss: float = 0.0
    #: How long the router takes to get lost batches replayed once it sees a gap.
    event_replay_s: float = 0.005
    #: Restart the router at this simulated second (0: never): its index
    #: starts empty and degraded, and asks every instance for its batches.
    router_restart_s: float = 0.0

    def __attrs_post_init__(self) -> None:
        if self.link not in LINKS:
            raise ValueError(f"link = {self.link!r}: accepted: {', '.join(LINKS)}")
        if (self.prefill > 0) != (self.decode > 0):
            raise ValueError(
                f"prefill = {self.prefill}, decode = {self.decode}: a prefill instance hands its KV to a decode"
                " instance; give both or neither"
            )
        if not 0 < self.link_efficiency <= 1:
            raise ValueError(f"link_efficiency = {self.link_efficiency!r}: a share in (0, 1]")
        if not 0 <= self.event_loss < 1:
            raise ValueError(f"event_loss = {self.event_loss!r}: a probability in [0, 1)")
        if self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0:
            raise ValueError(f"ttft_slo_s = {self.ttft_slo_s!r}, tpot_slo_s = {self.tpot_slo_s!r}: positive seconds")
