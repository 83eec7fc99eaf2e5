"""The replay engine (engine name ``replay``): drives the runtime over a
workload in simulated time.

* ``timed``: continuous batching as vLLM v1 schedules it. Each step gives a
  token budget first to running requests (decode, or the next prefill chunk),
  preempting by the victim-selection hook when blocks run out, then admits
  waiting requests in the order the scheduling passes left them (stopping at
  the first that does not fit). Step time comes from the roofline cost model.
* ``cache-only``: each request is served alone, in arrival order, as cache
  simulators do; no batching, no time model. For comparing prefix-cache and
  eviction policies without engine dynamics.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from attrs import field, frozen, validators

from sagellm_core.drivers.arrivals import serve_arrivals
from sagellm_core.drivers.recorder import Recorder
from sagellm_core.drivers.serial import serve_serially
from sagellm_core.drivers.step_engine import StepEngine
from sagellm_core.drivers.step_scheduler import PackedStep
from sagellm_core.errors import ConfigError
from sagellm_core.registry import PluginContext
from sagellm_core.replay.costmodel import HARDWARE, LINKS, MODELS, CostModel, ModeledCosts
from sagellm_core.runtime import Runtime
from sagellm_core.types import PoolUsage, Request, SequenceState

MODES = ("timed", "cache-only")


@frozen
class ReplaySettings:
    mode: str = field(default="timed", validator=validators.in_(MODES))
    hardware: str = field(default="h100", validator=validators.in_(sorted(HARDWARE)))
    model: str = field(default="llama-3.1-8b", validator=validators.in_(sorted(MODELS)))
    max_num_batched_tokens: int = field(default=8192, validator=[validators.instance_of(int), validators.gt(0)])
    max_num_seqs: int = field(default=256, validator=[validators.instance_of(int), validators.gt(0)])
    flops_efficiency: float = field(default=0.6, validator=[validators.gt(0), validators.le(1)])
    bandwidth_efficiency: float = field(default=0.8, validator=[validators.gt(0), validators.le(1)])
    step_overhead_s: float = field(default=0.002, validator=validators.ge(0))
    #: cache-only: blocks for this many tokens beyond the prompt are taken at
    #: admission, as LMDeploy's prefill reserves 16 tokens of decode room.
    prealloc_tokens: int = field(default=0, validator=[validators.instance_of(int), validators.ge(0)])
    #: timed: a conversation's turn (same ``session_id``) is sent only once
    #: its previous turn has finished, at the later of its own arrival and
    #: that finish, as a user waits for the answer before writing again.
    #: Off, turns arrive when the workload says, answered or not.
    closed_loop: bool = field(default=False, validator=validators.instance_of(bool))
    #: timed: the link each KV store's loads cross, by store name (``pcie``,
    #: ``nvme``, ``network``: :data:`~sagellm_core.replay.costmodel.LINKS`),
    #: so a load takes time (TTFT includes it) and load-or-recompute weighs
    #: it against the prefill it saves; a store not named loads in no time.
    tier_links: dict[str, str] = field(
        factory=dict,
        validator=validators.deep_mapping(
            validators.instance_of(str), validators.in_(sorted(LINKS)), validators.instance_of(dict)
        ),
    )


@contextmanager
def _fewer_collections() -> Iterator[None]:
    """Run the cyclic garbage collector less often during a replay: a replay
    allocates objects by the million, few of them in cycles, and a young
    collection every 700 allocations (Python's default) traverses them again
    and again. The objects built before the run (the plugins, the config)
    are moved out of the collector's sight meanwhile, as vLLM's engine does
    after its start (``gc.freeze``), unless the process froze some itself.
    Both are undone after the run."""
    threshold, freeze = gc.get_threshold(), gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(10_000, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if freeze:
            gc.unfreeze()


def cost_model(settings: ReplaySettings) -> CostModel:
    """The roofline ``settings`` describe: their hardware, model and efficiencies."""
    return CostModel(
        HARDWARE[settings.hardware],
        MODELS[settings.model],
        settings.flops_efficiency,
        settings.bandwidth_efficiency,
        settings.step_overhead_s,
    )


class ReplayEngine:
    """The embedded default engine."""

    Settings = ReplaySettings
    owns: tuple[str, ...] = ()
    owns_unless_configured: tuple[str, ...] = ()

    def __init__(self, settings: ReplaySettings, context: PluginContext):
        self.settings = settings
        self.cost = cost_model(settings)

    def run(self, rt: Runtime, requests: Iterator[Request], on_request: Callable[[], None] = lambda: None) -> Recorder:
        recorder = Recorder(prefill_flops=(self.cost.model.flops_per_token, self.cost.model.flops_per_token_pair))
        rt.stores.settle_puts = True  # a store holds what was written by the simulated time, whatever the disk
        with _fewer_collections():
            if self.settings.mode == "cache-only":
                self._cache_only(rt, requests, recorder, on_request)
            else:
                self._timed(rt, requests, recorder, on_request)
        return recorder

    # ---------------------------------------------------------- cache-only --

    def _cache_only(self, rt: Runtime, requests, recorder: Recorder, on_request) -> None:
        prealloc = self.settings.prealloc_tokens

        def serve(state: SequenceState) -> PoolUsage | None:
            request = state.request
            if not rt.admit(state, state.num_tokens, prealloc):
                return None
            state.num_computed_tokens = request.num_prompt_tokens
            state.first_token_s = rt.now_s
            out = request.output_tokens
            # Outputs whose ids are known are computed and cached like a real
            # engine caches them; unknown ones hold no KV here.
            if request.output_token_ids is not None and rt.grow(state, out):
                state.num_computed_tokens += out
            state.num_output_tokens = out
            state.finish_s = rt.now_s
            return rt.pool_usage()

        serve_serially(rt, requests, serve, recorder, on_request, finish=rt.finish)

    # --------------------------------------------------------------- timed --

    def _timed(self, rt: Runtime, requests, recorder: Recorder, on_request) -> None:
        engine = TimedReplay(rt, self.settings, self.cost)
        serve_arrivals(rt, engine, requests, recorder, on_request, closed_loop=self.settings.closed_loop)


class TimedReplay(StepEngine):
    """Replay's timed mode as an engine: the step loop of every step engine,
    its executor the cost model (a step takes the time the roofline gives
    it) and its clock simulated (idle, it jumps to the next arrival)."""

    def __init__(self, rt: Runtime, settings: ReplaySettings, cost: CostModel):
        super().__init__(rt, settings.max_num_batched_tokens, settings.max_num_seqs)
        self.cost = cost
        self.simulated_s = 0.0
        self._load_s = 0.0  # the stores' load seconds charged to steps so far
        if settings.tier_links:
            stores = [s.selection.name for s in rt.host.plugins.get("kv_stores", ())]
            unknown = sorted(set(settings.tier_links) - set(stores))
            if unknown:
                raise ConfigError(
                    f"{rt.settings.path}: [engine] tier_links names {unknown}, not among [kv_stores] tiers = {stores}"
                )
            links = {tier: LINKS[name] for tier, name in settings.tier_links.items()}
            rt.set_load_costs(ModeledCosts(cost, links, rt.block_size))

    def add_request(self, request: Request) -> None:
        """``request`` arrives at its ``arrival_s`` (due on this clock)."""
        self.rt.set_time(request.arrival_s)
        self.arrive(request)

    def clock(self) -> float:
        return self.simulated_s

    def wait_until(self, when_s: float) -> None:
        self.simulated_s = when_s

    def execute(self, step: PackedStep) -> None:
        # The step waits for the loads its admissions made (their modelled time).
        loads = sum(tier.load_s for tier in self.rt.counters.tiers.values())
        self.simulated_s += loads - self._load_s
        self._load_s = loads
        self.simulated_s += self.cost.step_time_of(step.num_batched_tokens, step.attention_pairs, step.kv_tokens)
