"""``SagellmConnector``: sagellm's transport hook offered to LMDeploy as a KV
connector, a host tier for the PyTorch engine.

Scheduler side (one instance, handed to ``Scheduler(kv_connector=...)``, or
built by the patched ``build_kv_connector``, see :mod:`install`):

* every step, the full blocks the batch will have computed and that are not
  on the host yet are offloaded: each takes a host slot (the slot written
  longest ago once the tier is full, :class:`~sagellm_core.kit.slots.SlotIndex`),
  the copy is reported through ``sagellm_transfer_blocks(device -> host)``,
  and a save lease pins their logical blocks until the workers have copied them;
* a waiting request whose prompt continues on the host past its device hit
  loads those blocks back (``host -> device`` into the blocks LMDeploy
  allocated), asynchronously as LMDeploy's load protocol is: the request
  waits until the workers report the load, then LMDeploy publishes it.

Blocks are known by sagellm's chained content key (SHA-256 over the block's
token ids, from the adapter's root), as the radix cache and the trie adapter
know them. Worker side: the host tier is one CPU tensor per KV tensor,
``host_blocks`` blocks long; loads run before the forward, saves after, with
tensor indexing on the block dimension (dim 0 of LMDeploy's caches).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from sagellm_core.kit.slots import SlotIndex
from sagellm_core.runtime import Runtime
from sagellm_core.types import ROOT_KEY, TransferPlan, chain_key
from sagellm_plugin_lmdeploy.compat import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorResult,
    KVConnectorRole,
    KVLoadResult,
    KVSaveBlockLease,
    numpy,
    torch,
)

NAME = "SagellmConnector"


@dataclass
class SagellmConnectorMetadata(KVConnectorMetadata):
    #: (request id, host slots, device block ids): copy host -> device.
    loads: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    #: (operation id, device block ids, host slots): copy device -> host.
    saves: list[tuple[int, list[int], list[int]]] = field(default_factory=list)
    leases: tuple[KVSaveBlockLease, ...] = ()

    def get_save_block_leases(self) -> tuple[KVSaveBlockLease, ...]:
        return self.leases


def block_keys(seq, num_blocks: int, block_size: int) -> list[int]:
    """Chained content keys of the first ``num_blocks`` blocks of ``seq``."""
    namespace = seq.adapter_name or ""
    key = chain_key(ROOT_KEY, namespace.encode()) if namespace else ROOT_KEY
    tokens = numpy.asarray(seq.history_cache[: num_blocks * block_size], dtype=numpy.int64)
    keys = []
    for i in range(num_blocks):
        key = chain_key(key, tokens[i * block_size : (i + 1) * block_size].tobytes())
        keys.append(key)
    return keys


class SagellmConnector(KVConnectorBase):
    def __init__(self, role: KVConnectorRole, cache_config, *, runtime: Runtime | None = None, **_):
        super().__init__(role)
        self.block_size = cache_config.block_size
        extra = cache_config.kv_transfer_config.kv_connector_extra_config or {}
        self.host_blocks = int(extra.get("host_blocks", 4096))
        self._num_device_blocks = cache_config.num_gpu_blocks
        # Scheduler side.
        self.runtime = runtime
        self.host = SlotIndex(self.host_blocks)  # by chained content key
        self._offered: dict[int, int] = {}  # request -> blocks already considered for saving
        self._loads: list[tuple[int, list[int], list[int]]] = []
        self._loading: set[int] = set()
        self._operations = itertools.count(1)
        # Worker side.
        self.device_caches: dict[str, torch.Tensor] = {}
        self.host_caches: dict[str, torch.Tensor] = {}
        self._saved: set[int] = set()
        self._loaded: set[int] = set()

    def _runtime(self) -> Runtime:
        if self.runtime is None:
            from sagellm_plugin_lmdeploy.live import load_runtime

            self.runtime = load_runtime(self._num_device_blocks, self.block_size)
        return self.runtime

    # ------------------------------------------------------- scheduler side --

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        limit = (request.num_all_ids - 1) // self.block_size  # one token is always computed
        on_host = 0
        for key in block_keys(request, limit, self.block_size):
            if key not in self.host:
                break
            on_host += 1
        return max(0, on_host * self.block_size - num_computed_tokens), True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or not block_ids:
            return
        first = request.num_history_ids // self.block_size
        keys = block_keys(request, first + len(block_ids), self.block_size)[first:]
        slots = self.host.slots(keys)
        result = self._runtime().transfer(
            TransferPlan(
                "host",
                "device",
                tuple(slots),
                self.block_size,
                tuple(block_ids),
                tuple(k.to_bytes(8, "little") for k in keys),
            )
        )
        if result is not None and not result.ok:
            raise RuntimeError(f"sagellm transport failed to load {len(slots)} blocks: {result.error}")
        self._loads.append((int(request.seq_id), slots, [int(b) for b in block_ids]))
        self._loading.add(int(request.seq_id))

    def build_connector_meta(self, step_input) -> SagellmConnectorMetadata | None:
        saves, leases = [], []
        for seq, token_len, block_ids, logical_ids in zip(
            step_input.running,
            step_input.connector_token_lens,
            step_input.connector_block_ids,
            step_input.connector_logical_block_ids,
        ):
            full = min(token_len // self.block_size, len(block_ids))
            start = self._offered.get(int(seq.seq_id), 0)
            if full <= start:
                continue
            self._offered[int(seq.seq_id)] = full
            keys = block_keys(seq, full, self.block_size)
            todo = [i for i in range(start, full) if keys[i] not in self.host]
            if not todo:
                continue
            device = [int(block_ids[i]) for i in todo]
            todo_keys = [keys[i] for i in todo]
            slots = self.host.place(todo_keys)
            if slots is None:
                continue  # more blocks than the host tier holds
            plan_keys = tuple(key.to_bytes(8, "little") for key in todo_keys)
            result = self._runtime().transfer(
                TransferPlan("device", "host", tuple(device), self.block_size, tuple(slots), plan_keys)
            )
            if result is None or not result.ok:
                self.host.forget(todo_keys)
                continue  # no transport, or it failed (counted by the runtime): not offloaded
            operation = next(self._operations)
            saves.append((operation, device, slots))
            leases.append(KVSaveBlockLease(operation, tuple(int(logical_ids[i]) for i in todo)))
        loads, self._loads = self._loads, []
        if not saves and not loads:
            return None
        return SagellmConnectorMetadata(loads=loads, saves=saves, leases=tuple(leases))

    def update_connector_output(self, output: KVConnectorOutput) -> KVConnectorResult:
        received = set(output.finished_receiving or ()) & self._loading
        self._loading -= received
        return KVConnectorResult(
            load_results=tuple(KVLoadResult(request_id, True) for request_id in sorted(received)),
            completed_save_ids=frozenset(output.completed_save_ids or ()),
        )

    def request_finished(self, request) -> None:
        self._offered.pop(int(request.seq_id), None)

    # ---------------------------------------------------------- worker side --

    def register_kv_caches(self, kv_caches) -> None:
        flat: dict[str, torch.Tensor] = {}
        for name, value in kv_caches.items():
            tensors = [value] if isinstance(value, torch.Tensor) else list(value)
            for i, tensor in enumerate(tensors):
                flat[f"{name}.{i}"] = tensor
        self.device_caches = flat
        pin = torch.cuda.is_available()
        self.host_caches = {
            name: torch.empty((self.host_blocks, *t.shape[1:]), dtype=t.dtype, device="cpu", pin_memory=pin)
            for name, t in flat.items()
        }

    def start_load_kv(self) -> None:
        meta = self._connector_metadata  # None on a step with nothing to move
        if not isinstance(meta, SagellmConnectorMetadata):
            return
        for request_id, slots, device in meta.loads:
            src = torch.tensor(slots, dtype=torch.long)
            for name, cache in self.device_caches.items():
                cache[torch.tensor(device, dtype=torch.long, device=cache.device)] = self.host_caches[name][src].to(
                    cache.device
                )
            self._loaded.add(request_id)

    def start_save_kv(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, SagellmConnectorMetadata):
            return
        for operation, device, slots in meta.saves:
            dst = torch.tensor(slots, dtype=torch.long)
            for name, cache in self.device_caches.items():
                self.host_caches[name][dst] = cache[torch.tensor(device, dtype=torch.long, device=cache.device)].cpu()
            self._saved.add(operation)

    def get_finished(self) -> KVConnectorOutput:
        saved, self._saved = self._saved, set()
        loaded, self._loaded = self._loaded, set()
        return KVConnectorOutput(completed_save_ids=saved or None, finished_receiving=loaded or None)
