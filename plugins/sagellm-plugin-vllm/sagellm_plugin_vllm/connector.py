"""``SagellmConnector``: a host tier for vLLM, placed by sagellm's transport.

A vLLM v1 KV connector (``--kv-transfer-config '{"kv_connector":
"SagellmConnector", "kv_role": "kv_both"}'``; the ``vllm.general_plugins``
entry point registers the name). Scheduler side:

* when a request finishes, its full blocks not yet on the host are offloaded:
  each takes a host slot (the slot written longest ago once the tier is
  full, :class:`~sagellm_core.kit.slots.SlotIndex`), the copy is reported
  through ``sagellm_transfer_blocks(device -> host)``, and the blocks stay
  held until the worker has copied them (``finished_sending``);
* when a request arrives, the blocks of its prompt found on the host after
  the device-cache hit are loaded back: ``sagellm_transfer_blocks(host ->
  device)`` into the blocks vLLM allocated, synchronously before the forward
  pass. vLLM counts these tokens as connector (host) hits, apart from its
  own prefix-cache hits.

Blocks are known by vLLM's chained block hash. Worker side: the host tier is
one CPU tensor per layer, shaped as the layer's KV cache with ``host_blocks``
blocks; each step it performs the scheduler's saves, then its loads, with
tensor indexing on the block dimension (dim 0 of vLLM's per-layer caches).

The sagellm runtime is the scheduler's when ``SagellmScheduler`` runs (it
hands it over); with vLLM's stock scheduler the connector loads the config
named in ``kv_connector_extra_config["sagellm_config"]`` or
``$SAGELLM_CONFIG``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sagellm_core.kit.slots import SlotIndex
from sagellm_core.runtime import Runtime
from sagellm_core.types import TransferPlan
from sagellm_plugin_vllm.compat import (
    CacheHitSource,
    KVConnectorBase_V1,
    KVConnectorFactory,
    KVConnectorMetadata,
    torch,
)

NAME = "SagellmConnector"


@dataclass
class SagellmConnectorMetadata(KVConnectorMetadata):
    #: request id -> (device block ids, host slots): copy device -> host.
    saves: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    #: (host slots, device block ids): copy host -> device before the forward.
    loads: list[tuple[list[int], list[int]]] = field(default_factory=list)


class SagellmConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.host_blocks = int(extra.get("host_blocks", 4096))
        self._config_path = extra.get("sagellm_config")
        self._num_device_blocks = kv_cache_config.num_blocks - 1 if kv_cache_config else 0
        # Scheduler side.
        self.runtime: Runtime | None = None
        self.host = SlotIndex(self.host_blocks)  # by vLLM block hash
        self._local_hit: dict[str, int] = {}
        self._meta = SagellmConnectorMetadata()
        # Worker side.
        self.device_caches: dict[str, torch.Tensor] = {}
        self.host_caches: dict[str, torch.Tensor] = {}
        self._sent: set[str] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a request never waits for it

    # ------------------------------------------------------- scheduler side --

    def bind_runtime(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def _runtime(self) -> Runtime:
        if self.runtime is None:
            from sagellm_plugin_vllm.live import load_runtime

            self.runtime = load_runtime(self._num_device_blocks, self.block_size, self._config_path)
        return self.runtime

    def _on_host(self, request) -> int:
        """Leading blocks of ``request`` whose KV is on the host tier."""
        n = 0
        for block_hash in request.block_hashes:
            if bytes(block_hash) not in self.host:
                break
            n += 1
        return n

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        hit = self._on_host(request) * self.block_size
        # A synchronous load must leave one token to compute.
        hit = min(hit, (request.num_tokens - 1) // self.block_size * self.block_size)
        self._local_hit[request.request_id] = num_computed_tokens
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        local = self._local_hit.pop(request.request_id, 0)
        if num_external_tokens <= 0:
            return
        first, stop = local // self.block_size, (local + num_external_tokens) // self.block_size
        device = blocks.get_block_ids()[0][first:stop]
        keys = [bytes(h) for h in request.block_hashes[first:stop]]
        slots = self.host.slots(keys)
        result = self._runtime().transfer(
            TransferPlan("host", "device", tuple(slots), self.block_size, _sagellm_ids(device), tuple(keys))
        )
        if result is not None and not result.ok:
            raise RuntimeError(f"sagellm transport failed to load {len(slots)} blocks: {result.error}")
        self._meta.loads.append((slots, list(device)))

    @property
    def has_pending_saves(self) -> bool:
        """Offloads planned that no worker has been told of yet."""
        return bool(self._meta.saves)

    def build_connector_meta(self, scheduler_output) -> SagellmConnectorMetadata:
        meta, self._meta = self._meta, SagellmConnectorMetadata()
        return meta

    def request_finished(self, request, block_ids: list[int]):
        self._local_hit.pop(request.request_id, None)
        full = min(len(request.block_hashes), len(block_ids))
        todo = [
            (b, bytes(h)) for b, h in zip(block_ids[:full], request.block_hashes[:full]) if bytes(h) not in self.host
        ]
        if not todo:
            return False, None
        device = tuple(b for b, _ in todo)
        keys = tuple(k for _, k in todo)
        slots = self.host.place(keys)
        if slots is None:
            return False, None  # more blocks than the host tier holds
        result = self._runtime().transfer(
            TransferPlan("device", "host", _sagellm_ids(device), self.block_size, tuple(slots), keys)
        )
        if result is None or not result.ok:
            self.host.forget(keys)
            return False, None  # no transport, or it failed (counted by the runtime): nothing offloaded
        self._meta.saves[request.request_id] = (list(device), slots)
        return True, None  # keep the blocks until the worker has copied them

    # ---------------------------------------------------------- worker side --

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.device_caches = kv_caches
        pin = torch.cuda.is_available()
        self.host_caches = {
            name: torch.empty((self.host_blocks, *cache.shape[1:]), dtype=cache.dtype, device="cpu", pin_memory=pin)
            for name, cache in kv_caches.items()
        }

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SagellmConnectorMetadata)
        # Saves first: their blocks are still held, and a load may target a
        # block that a save of the same step reads from.
        for request_id, (device, slots) in meta.saves.items():
            src = torch.tensor(device, dtype=torch.long)
            dst = torch.tensor(slots, dtype=torch.long)
            for name, cache in self.device_caches.items():
                self.host_caches[name][dst] = cache[src.to(cache.device)].cpu()
            self._sent.add(request_id)
        for slots, device in meta.loads:
            src = torch.tensor(slots, dtype=torch.long)
            for name, cache in self.device_caches.items():
                dst = torch.tensor(device, dtype=torch.long, device=cache.device)
                cache[dst] = self.host_caches[name][src].to(cache.device)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete in start_load_kv, before the forward

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None  # only finished requests are saved, in start_load_kv

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]):
        sent, self._sent = self._sent, set()
        return (sent or None), None


def _sagellm_ids(vllm_block_ids) -> tuple[int, ...]:
    """vLLM's block 0 is its null block; sagellm numbers the usable blocks
    from 0 (the transport's device tier has one row per usable block)."""
    return tuple(b - 1 for b in vllm_block_ids)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: run in every vLLM process,
    it makes ``SagellmConnector`` a known connector name."""
    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, __name__, NAME)
