"""``[engine] name = "vllm"``: replay a workload through vLLM's real v1
scheduler, KV-cache manager and block pool, on the CPU, with no model.

The scheduler is vLLM's own (``scheduler = "stock"``) or the sagellm one
(``scheduler = "sagellm"``, the default: sagellm's plugins decide). vLLM is
built from a ``VllmConfig`` whose model is a folder holding only a small
``config.json`` (no weights, no tokenizer), as vLLM's own scheduler tests do;
each step's ``ModelRunnerOutput`` is made up (one sampled token per request
that finished its prompt chunk).

``mode = "cache-only"``: each request alone, in arrival order, prompt only
(``max_tokens = 1``: the sampled token is never computed, so only prompt
blocks are cached), as ``sagellm replay``'s cache-only mode serves a trace
without output token ids. Hit counts are vLLM's: its split of a
request's cached tokens when first scheduled (``prefill_stats``), device
prefix-cache hits as ``block_hit_rate``, host-tier hits loaded back by
``SagellmConnector`` (``host_blocks > 0``) as ``host_hit_rate``.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from attrs import define, field, frozen, validators

from sagellm_core.drivers.recorder import Recorder
from sagellm_core.drivers.serial import serve_serially
from sagellm_core.registry import PluginContext
from sagellm_core.runtime import Runtime, blocks_for
from sagellm_core.types import PoolUsage, Request, RequestOutcome, SequenceState

SCHEDULERS = ("sagellm", "stock")
#: A token id for made-up samples (never part of a cached block here).
SAMPLED_TOKEN = 7


@frozen
class VllmEngineSettings:
    mode: str = field(default="cache-only", validator=validators.in_(("cache-only",)))
    scheduler: str = field(default="sagellm", validator=validators.in_(SCHEDULERS))
    max_num_batched_tokens: int = field(default=8192, validator=[validators.instance_of(int), validators.gt(0)])
    max_num_seqs: int = field(default=256, validator=[validators.instance_of(int), validators.gt(0)])
    #: Longest prompt vLLM accepts; longer requests are rejected, as the
    #: replay rejects requests that cannot fit the pool.
    max_model_len: int = field(default=262144, validator=[validators.instance_of(int), validators.gt(0)])
    #: Host-tier blocks for ``SagellmConnector`` (0: no connector). Needs a
    #: ``[transport]`` whose host tier is this size (``local``'s host_blocks).
    host_blocks: int = field(default=0, validator=[validators.instance_of(int), validators.ge(0)])


#: One model folder per ``max_model_len`` in a process, removed at exit:
#: a scheduler is built per replay, and a folder each left one behind each time.
_MODEL_DIRS: dict[int, str] = {}


def model_dir(max_model_len: int) -> str:
    """A model folder vLLM can configure from without weights or a hub."""
    if max_model_len in _MODEL_DIRS:
        return _MODEL_DIRS[max_model_len]
    folder = Path(tempfile.mkdtemp(prefix="sagellm-vllm-model-"))
    atexit.register(shutil.rmtree, folder, True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 1,
                "vocab_size": 1 << 20,
                "max_position_embeddings": max_model_len,
            }
        )
    )
    _MODEL_DIRS[max_model_len] = str(folder)
    return str(folder)


def build_scheduler(
    scheduler: str,
    *,
    block_size: int,
    num_blocks: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    runtime: Runtime | None = None,
    on_finished: Callable[[RequestOutcome], None] | None = None,
    host_blocks: int | None = None,
):
    """vLLM's scheduler (or sagellm's subclass) over a pool of ``num_blocks``
    usable blocks (vLLM's null block comes on top)."""
    from sagellm_plugin_vllm import compat as v
    from sagellm_plugin_vllm.scheduler import SagellmScheduler

    model_config = v.ModelConfig(
        model=model_dir(max_model_len), skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=max_model_len
    )
    scheduler_config = v.SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    cache_config = v.CacheConfig(block_size=block_size, enable_prefix_caching=True)
    kv_transfer_config = None
    if host_blocks is not None:  # sagellm's host tier as vLLM's KV connector
        kv_transfer_config = v.KVTransferConfig(
            kv_connector="SagellmConnector",
            kv_connector_module_path="sagellm_plugin_vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config={"host_blocks": host_blocks},
        )
    vllm_config = v.VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks + 1
    kv_cache_config = v.KVCacheConfig(
        num_blocks=num_blocks + 1,
        kv_cache_tensors=[],
        kv_cache_groups=[
            v.KVCacheGroupSpec(
                ["layer"],
                v.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=v.torch.float32),
            )
        ],
    )
    v.register_all_kvcache_specs(vllm_config)
    kwargs = dict(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=v.StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=True,
    )
    if scheduler != "stock":
        return SagellmScheduler(**kwargs, sagellm_runtime=runtime, on_finished=on_finished)
    stock = v.Scheduler(**kwargs)
    if host_blocks is not None and runtime is not None:
        stock.connector.bind_runtime(runtime)  # vLLM's own decisions, sagellm's host tier
    return stock


def made_up_output(scheduler, scheduler_output, kv_connector_output=None):
    """One sampled token for each request that finished its prompt (chunk
    boundaries sample nothing), as the model runner would report."""
    from sagellm_plugin_vllm import compat as v

    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = [[] if scheduler.requests[rid].is_prefill_chunk else [SAMPLED_TOKEN] for rid in req_ids]
    return v.ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        kv_connector_output=kv_connector_output,
    )


@define
class PrefixTotals:
    requests: int = 0
    queries: int = 0
    hits: int = 0

    def record_from(self, stats) -> None:
        self.requests += stats.requests
        self.queries += stats.queries
        self.hits += stats.hits


class VllmEngine:
    """The engine entry point ``vllm`` (``sagellm.engines``)."""

    Settings = VllmEngineSettings
    #: vLLM's hash table and block pool serve these sections.
    owns = ("prefix_cache", "kv_pool")
    owns_unless_configured = ()

    def __init__(self, settings: VllmEngineSettings, context: PluginContext):
        from sagellm_plugin_vllm import compat  # fails here, with the install hint, without vLLM

        self.settings = settings
        self.vllm_version = compat.VLLM_VERSION

    def run(self, rt: Runtime, requests: Iterator[Request], on_request: Callable[[], None] = lambda: None) -> Recorder:
        from sagellm_plugin_vllm import compat as v

        s = self.settings
        recorder = Recorder()
        scheduler = build_scheduler(
            s.scheduler,
            block_size=rt.block_size,
            num_blocks=rt.num_blocks,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_num_seqs=s.max_num_seqs,
            max_model_len=s.max_model_len,
            runtime=rt,
            # The sagellm scheduler concludes the requests it serves itself.
            on_finished=recorder.record,
            host_blocks=s.host_blocks or None,
        )
        worker = None
        if s.host_blocks:
            from sagellm_plugin_vllm.connector import SagellmConnector

            # The worker side of the connector, without KV tensors (the
            # transport's tiers hold stand-in bytes): it acknowledges saves.
            worker = SagellmConnector(scheduler.vllm_config, v.KVConnectorRole.WORKER, scheduler.kv_cache_config)
        v.init_none_hash(v.sha256)
        hasher = v.get_request_block_hasher(rt.block_size, v.sha256)
        pool = scheduler.kv_cache_manager.block_pool
        #: vLLM's own prefix-cache counters over the run (it hands them out
        #: per step, with its scheduler stats).
        self.prefix_cache_stats = PrefixTotals()

        def serve(state: SequenceState) -> PoolUsage | None:
            request = state.request
            too_long = request.num_prompt_tokens >= s.max_model_len
            if too_long or blocks_for(request.num_prompt_tokens, rt.block_size) > rt.num_blocks:
                return None
            vreq = v.VllmRequest(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids.tolist(),
                sampling_params=v.SamplingParams(max_tokens=1, ignore_eos=True),
                pooling_params=None,
                arrival_time=request.arrival_s,
                block_hasher=hasher,
                cache_salt=request.cache_salt,
                priority=request.priority,
            )
            # The sagellm scheduler's view of the request is made from this
            # one: its token array as is, its tenant, session and hints.
            vreq.sagellm_request = request
            scheduler.add_request(vreq)
            admitted = False
            # With the connector, a finished request's blocks stay held until
            # the worker has saved them: one more (empty) step delivers that.
            while scheduler.has_unfinished_requests() or (worker is not None and scheduler.connector.has_pending_saves):
                out = scheduler.schedule()
                if not admitted and out.num_scheduled_tokens:
                    admitted = True
                    prefill = vreq.prefill_stats  # vLLM's split of the hit, until outputs take it
                    rt.count_admission(
                        state,
                        prefill.num_local_cached_tokens // rt.block_size,
                        prefill.num_external_cached_tokens // rt.block_size,
                    )
                connector_output = None
                if worker is not None:
                    worker.bind_connector_metadata(out.kv_connector_metadata)
                    worker.start_load_kv(None)
                    sent, _ = worker.get_finished(set())
                    worker.clear_connector_metadata()
                    connector_output = v.KVConnectorOutput(finished_sending=sent or set())
                outputs = scheduler.update_from_output(out, made_up_output(scheduler, out, connector_output))
                for client in outputs.values():
                    stats = client.scheduler_stats
                    if stats is not None and stats.prefix_cache_stats is not None:
                        self.prefix_cache_stats.record_from(stats.prefix_cache_stats)
            return PoolUsage(rt.num_blocks, pool.get_num_free_blocks())

        def finish(state: SequenceState) -> RequestOutcome | None:
            if s.scheduler != "stock":
                return None  # the sagellm scheduler concluded it (on_finished)
            state.num_output_tokens = 1
            return rt.conclude(state)

        # The sagellm scheduler's add_request arrives each request with
        # vLLM's own match; the driver's state counts its admission.
        return serve_serially(rt, requests, serve, recorder, on_request, arrive=SequenceState, finish=finish)
