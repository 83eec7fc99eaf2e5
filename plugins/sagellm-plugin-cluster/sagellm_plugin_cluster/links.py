"""How long a request's KV takes from its prefill instance to its decode
instance: link presets (peak bandwidth one way, and a per-transfer
latency), an efficiency real transfers reach, and layer-wise overlap.

Without overlap the decode side pulls the KV once the prefill is done: it
waits ``latency + bytes / (bandwidth * efficiency)``. With layer-wise
overlap (a connector that sends each layer's KV as soon as the layer is
computed, as Mooncake's and vLLM's ``save_kv_layer`` do) layer ``i``'s
transfer starts when layer ``i`` is computed or the previous layer's
transfer ends, whichever is later, so after the prefill only the last
layer's transfer is left where the link keeps up with the compute, and the
transfer's excess over the compute where it does not.
"""

from __future__ import annotations

from attrs import frozen

from sagellm_core.replay.costmodel import Link  # the KV stores' link type: a preset's name, bytes/s one way, latency

LINKS = {
    link.name: link
    for link in (
        # PCIe Gen5 x16 (64 GB/s one way): KV staged through host memory.
        Link("pcie-gen5", 64e9, 10e-6),
        # NVLink 4 on an H100 (900 GB/s both ways): two GPUs of one node.
        Link("nvlink", 450e9, 5e-6),
        # One 200 or 400 Gb/s RDMA NIC (InfiniBand NDR, RoCE): across nodes.
        Link("rdma-200g", 25e9, 20e-6),
        Link("rdma-400g", 50e9, 20e-6),
        # Ascend 910B HCCS, one link of the 8-NPU full mesh (56 GB/s).
        Link("ascend-hccs", 56e9, 10e-6),
    )
}


@frozen
class TransferTime:
    """Transfer times over ``link`` at ``efficiency`` of its peak."""

    link: Link
    efficiency: float
    num_layers: int
    layerwise: bool

    def seconds(self, num_bytes: int, prefill_s: float = 0.0) -> float:
        """The time from the end of a prefill that took ``prefill_s`` to
        its ``num_bytes`` of KV being on the decode side."""
        if num_bytes <= 0:
            return 0.0
        whole = num_bytes / (self.link.bandwidth * self.efficiency)
        if not self.layerwise:
            return self.link.latency_s + whole
        layers = self.num_layers
        per_layer = whole / layers
        # The pipeline's last stage, or the link's excess over the compute of
        # the layers before the last.
        return self.link.latency_s + max(per_layer, whole - prefill_s * (layers - 1) / layers)
