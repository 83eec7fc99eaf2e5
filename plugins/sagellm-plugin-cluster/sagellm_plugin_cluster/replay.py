"""A cluster in replay (``[engine] name = "cluster"``, with ``[cluster]``
and ``[router]``): replay's timed mode on several instances, each with its
own runtime, plugins, pool and simulated clock, a router in front of them,
and KV handed from prefill to decode instances over a simulated link.

* Every request is routed at its arrival (``sagellm_route_request``), with
  each instance's queued work and the prompt's blocks the router's index
  says it holds. The index is fed by the KV events each instance publishes
  after every step (:mod:`.events`, :mod:`.index`).
* A colocated instance serves the whole request. A prefill instance
  computes the prompt (the request with one output token, as a
  disaggregated proxy sends it) and is done; the decode instance then gets
  the request once its KV has arrived (:mod:`.links`): it takes what its
  own cache holds, the prompt's other full blocks come over the link (not
  computed), it computes the prompt's last partial block and samples every
  output token, the first included (as vLLM's decode side does).
* The run's counters are the cluster's: prefix hits and prefill work where
  prompts are computed (colocated and prefill instances), evictions,
  preemptions and re-prefill everywhere, requests as the cluster ended
  them. The report's ``cluster`` section has a row per instance, the KV
  transfers, the index's state, and goodput under ``[cluster]``'s SLOs
  (after DistServe: requests meeting both their TTFT and TPOT SLO).

Simplifications, said where they matter: a prefill instance frees a
request's blocks when its prefill ends (its lease until the pull is not
held in memory here); the transfer is timed from the decode instance's
cache as it is when the prefill ends; layer-wise sending overlaps the step
that completes the prefill (a chunked prompt's earlier chunks are sent
with it).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from sagellm_core.config import InstanceSettings, Settings
from sagellm_core.counters import Counters
from sagellm_core.drivers.arrivals import Arrivals
from sagellm_core.drivers.recorder import Recorder
from sagellm_core.drivers.router import Router
from sagellm_core.drivers.step_scheduler import PackedStep
from sagellm_core.errors import ConfigError, PluginError
from sagellm_core.registry import PluginContext
from sagellm_core.replay.costmodel import CostModel
from sagellm_core.replay.engine import ReplaySettings, TimedReplay, cost_model
from sagellm_core.runtime import Runtime
from sagellm_core.timing import summarise
from sagellm_core.types import InstanceLoad, PoolUsage, Request, RouteDecision

from .events import KVEventPublisher
from .index import KVIndex
from .links import LINKS, TransferTime
from .settings import ClusterSettings


class DecodeReplay(TimedReplay):
    """A decode instance: a request arrives with the KV of its prompt's
    full blocks on its way (:meth:`add_transferred`); the prefill chunk that
    covers them costs only the tokens it computes."""

    def __init__(self, rt: Runtime, settings: ReplaySettings, cost: CostModel):
        super().__init__(rt, settings, cost)
        #: Request id -> the prompt tokens whose KV comes from its prefill instance.
        self.transferred: dict[str, int] = {}

    def add_transferred(self, request: Request, now_s: float, transferred_tokens: int) -> None:
        self.rt.set_time(now_s)
        self.arrive(request)
        if transferred_tokens:
            self.transferred[request.request_id] = transferred_tokens

    def execute(self, step: PackedStep) -> None:
        tokens, pairs = step.num_batched_tokens, step.attention_pairs
        transferred = self.transferred
        if transferred:
            for state, n, context, prefill in zip(step.states, step.num_new, step.context, step.prefill):
                upto = transferred.get(state.request_id)
                if upto is None or not prefill:
                    continue
                if context + n >= upto:  # the transferred KV is in place after this chunk
                    del transferred[state.request_id]
                if context >= upto:
                    continue
                arrived = min(n, upto - context)
                computed, start = n - arrived, context + arrived
                tokens -= arrived
                pairs -= n * context + n * (n + 1) // 2 - (computed * start + computed * (computed + 1) // 2)
        self.simulated_s += self.cost.step_time_of(tokens, pairs, step.kv_tokens)

    def ended(self, state) -> None:  # type: ignore[no-untyped-def]
        self.transferred.pop(state.request_id, None)


@attrs.define(eq=False)
class Instance:
    id: str
    role: str
    rt: Runtime
    engine: TimedReplay
    publisher: KVEventPublisher
    #: Requests it ended: finished (a prefill instance: prefills done), rejected.
    finished: int = 0
    rejected: int = 0
    busy_s: float = 0.0
    used_block_sum: float = 0.0
    samples: int = 0
    #: KV this instance sent (prefill) or received (decode): transfers, blocks, bytes, seconds.
    transfers: int = 0
    transfer_blocks: int = 0
    transfer_bytes: int = 0
    transfer_s: float = 0.0
    #: The engine's batched tokens at its last step (the recorder sums the steps').
    batched_tokens: int = 0


@attrs.define(eq=False)
class _InFlight:
    request: Request
    route: RouteDecision


class _ClusterView:
    """What ``Recorder.sample`` reads of a runtime, for the whole cluster:
    the prompt instances' hits, every instance's cached blocks."""

    def __init__(self, instances: list[Instance]):
        self._prompt = [i for i in instances if i.role != "decode"]
        self._all = instances

    @property
    def counters(self) -> Counters:
        return Counters(
            hit_blocks=sum(i.rt.counters.hit_blocks for i in self._prompt),
            query_blocks=sum(i.rt.counters.query_blocks for i in self._prompt),
        )

    @property
    def num_cached_blocks(self) -> int:
        return sum(i.rt.num_cached_blocks for i in self._all)


class ClusterReplay:
    """The ``cluster`` engine plugin: takes replay's settings (``[engine]``
    keys as ``replay``'s; timed only)."""

    Settings = ReplaySettings
    # The run's own runtime loads the config's plugins (checked, and named in
    # the report) but serves no request: each instance has its own.
    owns: tuple[str, ...] = ()
    owns_unless_configured: tuple[str, ...] = ()

    def __init__(self, settings: ReplaySettings, context: PluginContext):
        if settings.mode != "timed":
            raise ConfigError(f'[engine] mode = "{settings.mode}": a cluster replays in timed mode only')
        self.settings = settings
        self.cost = cost_model(settings)

    def run(self, rt: Runtime, requests: Iterator[Request], on_request: Callable[[], None] = lambda: None) -> Recorder:
        return ClusterRun(rt.settings, self.settings, self.cost).run(requests, on_request)


class ClusterRun:
    """One replay of a workload on a cluster."""

    def __init__(self, settings: Settings, replay: ReplaySettings, cost: CostModel):
        cluster: ClusterSettings = settings.section("cluster")
        if cluster.colocated + cluster.prefill == 0:
            raise ConfigError(
                f"{settings.path}: [cluster] has no instance that computes prompts;"
                " set colocated, or prefill and decode"
            )
        self.settings, self.cluster, self.replay, self.cost = settings, cluster, replay, cost
        self.router = Router(settings)
        self.instances: list[Instance] = []
        for role in ("colocated", "prefill", "decode"):
            for n in range(getattr(cluster, role)):
                self.instances.append(self._instance(f"{role}-{n}", role))
        self.by_id = {i.id: i for i in self.instances}
        self.index = KVIndex(self.by_id)
        self.link = TransferTime(LINKS[cluster.link], cluster.link_efficiency, cost.model.num_layers, cluster.layerwise)
        self._random = random.Random(settings.workload.seed)
        #: (time, serial, kind, payload): transferred KV reaching a decode
        #: instance, and replays of lost event batches.
        self._events: list[tuple[float, int, str, Any]] = []
        self._serial = 0
        self._replay_due = False
        self.in_flight: dict[str, _InFlight] = {}
        self.decisions = 0
        self.degraded_decisions = 0
        #: Decisions where some instance held blocks of the prompt on its device, in a lower tier.
        self.cached_decisions = 0
        self.lower_tier_decisions = 0
        self.event_batches = 0
        self.event_bytes = 0
        self.lost_batches = 0
        self.restarts = 0

    def _instance(self, instance_id: str, role: str) -> Instance:
        settings = attrs.evolve(self.settings, instance=InstanceSettings(instance_id, role))
        rt = Runtime(settings)
        engine_cls = DecodeReplay if role == "decode" else TimedReplay
        engine = engine_cls(rt, self.replay, self.cost)
        publisher = KVEventPublisher(rt.block_size, lambda seq, payload: self._deliver(instance_id, seq, payload))
        rt.host.pm.register(publisher, name="cluster:kv-events")
        return Instance(instance_id, role, rt, engine, publisher)

    # ------------------------------------------------------------- events --

    def _deliver(self, instance_id: str, seq: int, payload: bytes) -> None:
        self.event_batches += 1
        self.event_bytes += len(payload)
        if self.cluster.event_loss and self._random.random() < self.cluster.event_loss:
            self.lost_batches += 1
            return
        self.index.receive(instance_id, seq, payload)
        if not self.index.exact and not self._replay_due:
            self._replay_due = True
            self._schedule(self._now + self.cluster.event_replay_s, "replay", None)

    def _replay_events(self) -> None:
        self._replay_due = False
        for instance_id, start in self.index.degraded().items():
            self.index.replay(instance_id, self.by_id[instance_id].publisher.replay(start))

    def _restart_router(self) -> None:
        """The router starts again knowing nothing: degraded until every
        instance's batches are replayed to it."""
        self.index = KVIndex(self.by_id, known=False)
        self.restarts += 1
        if not self._replay_due:
            self._replay_due = True
            self._schedule(self._now + self.cluster.event_replay_s, "replay", None)

    def _schedule(self, when: float, kind: str, payload: Any) -> None:
        self._serial += 1
        heapq.heappush(self._events, (when, self._serial, kind, payload))

    # ------------------------------------------------------------ routing --

    def _load(self, instance: Instance, keys: tuple[int, ...]) -> InstanceLoad:
        engine = instance.engine
        prefill = decode_requests = decode_tokens = 0
        for state in engine.waiting:
            if instance.role == "decode":
                decode_requests += 1
                decode_tokens += state.request.num_prompt_tokens
            else:
                prefill += state.request.num_prompt_tokens - state.cached_tokens_hint
        for state in engine.running:
            if state.in_prefill and instance.role != "decode":
                prefill += state.num_tokens - state.num_computed_tokens
            else:
                decode_requests += 1
                decode_tokens += state.num_computed_tokens
        cached, lower = self.index.lookup(instance.id, keys) if keys else (0, 0)
        return InstanceLoad(instance.id, instance.role, prefill, decode_requests, decode_tokens, cached, lower)

    def _route(self, request: Request, now: float) -> None:
        first = self.instances[0].rt
        full = request.num_prompt_tokens // first.block_size
        keys = first.host.block_keys(request, 0, full) if full else ()
        loads = [self._load(i, keys) for i in self.instances]
        self.decisions += 1
        self.degraded_decisions += not self.index.exact
        self.cached_decisions += any(load.cached_blocks for load in loads)
        self.lower_tier_decisions += any(load.lower_tier_blocks for load in loads)
        route = self.router.route(request, loads, now)
        self.in_flight[request.request_id] = _InFlight(request, route)
        target = self.by_id[route.instance_id]
        if target.role == "prefill":
            request = attrs.evolve(request, output_tokens=1)
        if not target.engine.has_work() and target.engine.clock() < now:
            target.engine.wait_until(now)
        target.engine.add_request(request)

    # --------------------------------------------------------------- loop --

    def run(self, requests: Iterator[Request], on_request: Callable[[], None]) -> Recorder:
        self.recorder = recorder = Recorder(
            prefill_flops=(self.cost.model.flops_per_token, self.cost.model.flops_per_token_pair)
        )
        self.on_request = on_request
        self.arrivals = arrivals = Arrivals(requests, self.replay.closed_loop)
        self._now = 0.0
        self.view = _ClusterView(self.instances)
        self.slo_met = self.ttft_met = self.tpot_met = 0
        for instance in self.instances:
            instance.publisher.cleared()  # a fresh instance's first batch says its cache is empty
            instance.publisher.flush(0.0)
        if self.cluster.router_restart_s:
            self._schedule(self.cluster.router_restart_s, "restart", None)
        while True:
            upcoming = arrivals.next_arrival_s()
            t_arrival = math.inf if upcoming is None else upcoming
            t_event = self._events[0][0] if self._events else math.inf
            busy = [i for i in self.instances if i.engine.has_work()]
            stepper = min(busy, key=lambda i: i.engine.clock()) if busy else None
            t_step = stepper.engine.clock() if stepper is not None else math.inf
            now = min(t_arrival, t_event, t_step)
            if now == math.inf:
                break
            self._now = max(self._now, now)
            if t_event <= now:
                _, _, kind, payload = heapq.heappop(self._events)
                if kind == "replay":
                    self._replay_events()
                elif kind == "restart":
                    self._restart_router()
                else:
                    self._transferred(*payload)
            elif t_arrival <= now:
                for request in arrivals.due(now):
                    self._route(request, now)
            else:
                assert stepper is not None
                self._step(stepper)
        recorder.simulated_s = max(i.engine.clock() for i in self.instances)
        recorder.counters = self._counters()
        recorder.cluster = self._summary()
        for instance in self.instances:  # every instance's accounting whole, as a run's is
            try:
                assert not instance.rt.in_flight, f"{instance.rt.in_flight} requests still hold blocks"
                instance.rt.check_invariants()
            except AssertionError as exc:
                message = f"instance {instance.id}: the run ended with its block accounting broken ({exc})"
                raise PluginError(message) from None
        return recorder

    def _step(self, instance: Instance) -> None:
        engine, recorder = instance.engine, self.recorder
        start, steps = engine.clock(), engine.steps
        outputs = engine.step()
        end = engine.clock()
        instance.publisher.flush(end)
        for out in outputs:
            if out.finish_reason == "rejected":
                instance.rejected += 1
                self._end(out.request_id, end)
            elif out.finished and instance.role == "prefill":
                instance.finished += 1
                self._prefilled(instance, out.request_id, end, end - start)
            elif out.finished:
                instance.finished += 1
                assert out.outcome is not None
                recorder.record(out.outcome)
                self._count_slo(out.outcome)
                self._end(out.request_id, end)
        if engine.steps != steps:
            instance.busy_s += end - start
            usage = instance.rt.pool_usage()
            instance.used_block_sum += usage.num_used_blocks
            instance.samples += 1
            recorder.steps += 1
            recorder.batched_tokens += engine.batched_tokens - instance.batched_tokens
            instance.batched_tokens = engine.batched_tokens
            # The timeline's pool: the instances' mean (their pools are one size).
            usages = [i.rt.pool_usage() for i in self.instances]
            n, num_blocks = len(usages), usage.num_blocks
            used = round(sum(u.num_used_blocks for u in usages) / n)
            runs = max(1, round(sum(u.num_free_runs for u in usages) / n))
            recorder.sample(self.view, end, PoolUsage(num_blocks, num_blocks - used, runs))  # type: ignore[arg-type]

    def _prefilled(self, prefill: Instance, request_id: str, now: float, prefill_s: float) -> None:
        """``request_id``'s prompt is computed on ``prefill``: its KV goes to its decode instance."""
        flight = self.in_flight[request_id]
        decode = self.by_id[flight.route.decode_instance_id]
        request, size = flight.request, decode.rt.block_size
        # Full blocks only, at least one token left to compute (vLLM's decode side recomputes the tail).
        full_tokens = (request.num_prompt_tokens - 1) // size * size
        local = decode.rt.host.lookup(request).num_blocks * size
        pulled_blocks = max(0, full_tokens - local) // size
        num_bytes = pulled_blocks * size * self.cost.model.kv_bytes_per_token
        seconds = self.link.seconds(num_bytes, prefill_s)
        for side in (prefill, decode):
            side.transfers += 1
            side.transfer_blocks += pulled_blocks
            side.transfer_bytes += num_bytes
            side.transfer_s += seconds
        self._schedule(now + seconds, "kv", (decode, request, full_tokens))

    def _transferred(self, decode: Instance, request: Request, full_tokens: int) -> None:
        engine = decode.engine
        assert isinstance(engine, DecodeReplay)
        now = self._now
        if not engine.has_work() and engine.clock() < now:
            engine.wait_until(now)
        engine.add_transferred(request, now, full_tokens)

    def _end(self, request_id: str, now: float) -> None:
        flight = self.in_flight.pop(request_id)
        self.arrivals.done(flight.request, now)
        self.on_request()

    def _count_slo(self, outcome) -> None:  # type: ignore[no-untyped-def]
        ttft_ok = outcome.ttft_s <= self.cluster.ttft_slo_s
        tpot = outcome.tpot_s
        tpot_ok = tpot is None or tpot <= self.cluster.tpot_slo_s
        self.ttft_met += ttft_ok
        self.tpot_met += tpot_ok
        self.slo_met += ttft_ok and tpot_ok

    # ------------------------------------------------------------- report --

    def _counters(self) -> Counters:
        """The cluster's counters: admissions where prompts are computed,
        the rest from every instance, requests as the cluster ended them."""
        total = Counters()
        prompt_side = [i for i in self.instances if i.role != "decode"]
        admission_fields = (
            "query_blocks",
            "hit_blocks",
            "query_tokens",
            "hit_tokens",
            "query_token_pairs",
            "hit_token_pairs",
            "lost_waiting_blocks",
            "prefill_tokens",
            "host_hit_blocks",
        )
        every_fields = (
            "reprefill_tokens",
            "evicted_blocks",
            "preemptions",
            "transfers",
            "transfer_failures",
            "transferred_blocks",
            "transferred_bytes",
            "transfer_s",
            "admission_deferrals",
            "admission_rejections",
            "requests_rejected",
        )
        for name in admission_fields:
            setattr(total, name, sum(getattr(i.rt.counters, name) for i in prompt_side))
        for name in every_fields:
            setattr(total, name, sum(getattr(i.rt.counters, name) for i in self.instances))
        for instance in self.instances:
            c = instance.rt.counters
            for reason, n in c.rejections.items():
                total.rejections[reason] = total.rejections.get(reason, 0) + n
            if instance.role != "prefill":  # where outputs are generated and their lengths learnt
                total.lifetime_abs_error += c.lifetime_abs_error
                total.lifetime_predictions += c.lifetime_predictions
        for instance in prompt_side:
            for tenant, (query, hits) in instance.rt.counters.tenant_blocks.items():
                row = total.tenant_blocks.setdefault(tenant, [0, 0])
                row[0] += query
                row[1] += hits
        total.requests_finished = sum(i.finished for i in self.instances if i.role != "prefill")
        return total

    def _summary(self) -> dict[str, Any]:
        cluster, recorder = self.cluster, self.recorder
        span = recorder.simulated_s - (recorder.first_arrival_s if recorder.finished else 0.0)
        finished = recorder.finished
        rows = []
        for i in self.instances:
            c = i.rt.counters
            rows.append(
                {
                    "instance": i.id,
                    "role": i.role,
                    "requests": i.finished,
                    "rejected": i.rejected,
                    "block_hit_rate": round(c.hit_blocks / c.query_blocks, 6) if c.query_blocks else 0.0,
                    "prefill_tokens": c.prefill_tokens,
                    "reprefill_tokens": c.reprefill_tokens,
                    "evicted_blocks": c.evicted_blocks,
                    "preemptions": c.preemptions,
                    "busy": round(i.busy_s / span, 4) if span > 0 else 0.0,
                    "pool_utilisation_mean": round(i.used_block_sum / i.samples / i.rt.num_blocks, 4)
                    if i.samples
                    else 0.0,
                    "kv_transfers": i.transfers,
                    "kv_blocks": i.transfer_blocks,
                    "kv_bytes": i.transfer_bytes,
                    "kv_transfer_s_mean": round(i.transfer_s / i.transfers, 6) if i.transfers else None,
                }
            )
        decode_side = [i for i in self.instances if i.role == "decode"]
        return {
            "router": self.router.plugin_name,
            "instances": rows,
            "colocated": cluster.colocated,
            "prefill": cluster.prefill,
            "decode": cluster.decode,
            "link": cluster.link if cluster.prefill else None,
            "layerwise": cluster.layerwise if cluster.prefill else None,
            "slo": {"ttft_s": cluster.ttft_slo_s, "tpot_s": cluster.tpot_slo_s},
            "slo_attainment": round(self.slo_met / finished, 6) if finished else None,
            "ttft_attainment": round(self.ttft_met / finished, 6) if finished else None,
            "tpot_attainment": round(self.tpot_met / finished, 6) if finished else None,
            "goodput_requests_per_s": round(self.slo_met / span, 4) if span > 0 else None,
            "goodput_per_instance": round(self.slo_met / span / len(self.instances), 4) if span > 0 else None,
            "kv_transfers": sum(i.transfers for i in decode_side),
            "kv_bytes": sum(i.transfer_bytes for i in decode_side),
            "kv_transfer_s_mean": round(
                sum(i.transfer_s for i in decode_side) / max(1, sum(i.transfers for i in decode_side)), 6
            ),
            "routing": {
                "decisions": self.decisions,
                "degraded": self.degraded_decisions,
                "cached": self.cached_decisions,
                "lower_tier": self.lower_tier_decisions,
            },
            "events": {
                "batches": self.event_batches,
                "bytes": self.event_bytes,
                "lost": self.lost_batches,
                "gaps": self.index.gaps,
                "resets": self.index.resets,
                "router_restarts": self.restarts,
            },
            "router_hooks": summarise(self.router.timer) if self.router.timer else {},
        }
