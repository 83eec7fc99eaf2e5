"""``[engine] name = "lmdeploy"``: replay a workload through LMDeploy's real
PyTorch-engine scheduler, block manager and prefix trie, on the CPU, with no
model.

``scheduler = "sagellm"`` (default) installs sagellm's trie and reorderer
(:mod:`sagellm_plugin_lmdeploy.install`); ``"stock"`` runs LMDeploy's own.

``mode = "cache-only"``: each request alone, in arrival order, as
``sagellm replay``'s cache-only mode serves a trace: LMDeploy's engine loop
for one request (``add_session``, ``add_sequence``, a prefill ``schedule``
with the engine's ``prealloc_size`` of 16 tokens, the prompt computed, one
token sampled, ``end_session``). Its matching hits are ``seq.num_history_ids``
after the prefill schedule; the tests check them against ``block_trie.stats``.

LMDeploy stamps block access times from ``time.perf_counter()`` into an int64
array (whole seconds), so its LRU ties nearly everything in a fast replay
and breaks ties by object address: not reproducible. The driver gives the
allocator a logical clock (one tick per access-time update), in both modes,
which is LMDeploy's LRU made exact; ``logical_clock = false`` keeps
LMDeploy's own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from attrs import field, frozen, validators

from sagellm_core.drivers.recorder import Recorder
from sagellm_core.drivers.serial import serve_serially
from sagellm_core.registry import PluginContext
from sagellm_core.runtime import Runtime, blocks_for
from sagellm_core.types import PoolUsage, Request, SequenceState
from sagellm_plugin_lmdeploy.live import OWNS_UNLESS_CONFIGURED

SCHEDULERS = ("sagellm", "stock")


@frozen
class LmdeployEngineSettings:
    mode: str = field(default="cache-only", validator=validators.in_(("cache-only",)))
    scheduler: str = field(default="sagellm", validator=validators.in_(SCHEDULERS))
    #: Decode room LMDeploy's engine reserves at each prefill (its
    #: ``prefill_interval``, passed as ``prealloc_size``).
    prealloc_tokens: int = field(default=16, validator=[validators.instance_of(int), validators.ge(0)])
    max_batches: int = field(default=8, validator=[validators.instance_of(int), validators.gt(0)])
    #: False: LMDeploy's own seconds clock (to see its LRU vary run to run).
    logical_clock: bool = field(default=True, validator=validators.instance_of(bool))


def logical_clock(allocator) -> None:
    """LMDeploy's LRU with a tick per access instead of whole seconds."""
    from sagellm_plugin_lmdeploy.compat import numpy

    memory = allocator._log_mem
    memory.access_time = numpy.zeros_like(memory.access_time)
    ticks = itertools.count(1)

    def update_access_time(blocks) -> None:
        memory.access_time[blocks] = next(ticks)

    allocator.update_access_time = update_access_time


def build_scheduler(num_blocks: int, block_size: int, max_batches: int, clock: bool = True):
    from sagellm_plugin_lmdeploy import compat as lm

    scheduler_config = lm.SchedulerConfig(max_batches=max_batches, max_session_len=1 << 22, eviction_type="recompute")
    cache_config = lm.CacheConfig(
        max_batches=max_batches,
        block_size=block_size,
        num_cpu_blocks=0,
        num_gpu_blocks=num_blocks,
        enable_prefix_caching=True,
        max_prefill_token_num=1 << 22,  # a prompt in one prefill, as the replay admits it
        device_type="cpu",
    )
    scheduler = lm.Scheduler(
        scheduler_config, cache_config, seq_meta=lm.SequenceMeta(block_size, strategy=lm.ARSequenceStrategy())
    )
    if clock:
        logical_clock(scheduler.block_manager.allocator)
    return scheduler


class LmdeployEngine:
    """The engine entry point ``lmdeploy`` (``sagellm.engines``)."""

    Settings = LmdeployEngineSettings
    owns = ()
    owns_unless_configured = OWNS_UNLESS_CONFIGURED

    def __init__(self, settings: LmdeployEngineSettings, context: PluginContext):
        from sagellm_plugin_lmdeploy import compat  # fails here, with the install hint, without LMDeploy

        self.settings = settings
        self.lmdeploy_version = compat.LMDEPLOY_VERSION

    def run(self, rt: Runtime, requests: Iterator[Request], on_request: Callable[[], None] = lambda: None) -> Recorder:
        from sagellm_plugin_lmdeploy.install import installed

        if self.settings.scheduler == "stock":
            return self._serve(rt, requests, on_request)
        with installed(rt, observe_requests=False):  # the driver counts its requests
            return self._serve(rt, requests, on_request)

    def _serve(self, rt: Runtime, requests, on_request) -> Recorder:
        from sagellm_plugin_lmdeploy import compat as lm

        s = self.settings
        scheduler = build_scheduler(rt.num_blocks, rt.block_size, s.max_batches, s.logical_clock)
        self.block_trie = scheduler.block_trie
        sampled = lm.numpy.array([0], dtype=lm.numpy.int64)
        sessions = itertools.count()  # one per request, served or not

        def serve(state: SequenceState) -> PoolUsage | None:
            request, number = state.request, next(sessions)
            if blocks_for(request.num_prompt_tokens + s.prealloc_tokens, rt.block_size) > rt.num_blocks:
                return None
            session = scheduler.add_session(number)
            seq = session.add_sequence(
                lm.numpy.asarray(request.prompt_token_ids, dtype=lm.numpy.int64),
                sampling_param=lm.SamplingParam(max_new_tokens=1),
            )
            out = scheduler.schedule(is_prefill=True, prealloc_size=s.prealloc_tokens)
            if seq not in out.running:
                raise RuntimeError(f"LMDeploy did not admit request {request.request_id} into an idle pool")
            rt.count_admission(state, seq.num_history_ids // rt.block_size)
            scheduler.activate_seqs(out.running)
            seq.update_token_ids(sampled, mode=lm.UpdateTokenMode.PREFILL)
            seq.finish()
            scheduler.end_session(number)
            state.num_output_tokens = 1
            state.first_token_s = state.finish_s = rt.now_s
            return PoolUsage(rt.num_blocks, scheduler.block_manager.get_num_free_gpu_blocks())

        # Stock LMDeploy has no sagellm decisions: its requests are counted, not arrived.
        arrive = rt.arrive if s.scheduler == "sagellm" else SequenceState
        return serve_serially(rt, requests, serve, Recorder(), on_request, arrive=arrive)
