"""What a run observed beyond the runtime's counters: every engine's
result (:class:`Recorder`), which the report is built from with them."""

from __future__ import annotations

import math
from array import array
from typing import TYPE_CHECKING, Any

import attrs

from sagellm_core.counters import Counters
from sagellm_core.types import PoolUsage, RequestOutcome

if TYPE_CHECKING:
    from sagellm_core.runtime import Runtime


@attrs.define
class Recorder:
    """What a run observed, beyond the runtime's counters: per finished
    request its latencies (numbers only: keeping the outcomes would keep every
    prompt's tokens alive), and a timeline (at most ``max_samples`` points)."""

    ttft_s: array = attrs.field(factory=lambda: array("d"))
    #: Tenant -> the TTFTs of its requests.
    tenant_ttft_s: dict[str, array] = attrs.field(factory=dict)
    tpot_s: array = attrs.field(factory=lambda: array("d"))
    e2e_s: array = attrs.field(factory=lambda: array("d"))
    finished: int = 0
    #: Finished requests that had a deadline, and those whose first token
    #: came by it.
    deadlines: int = 0
    deadlines_met: int = 0
    output_tokens: int = 0
    first_arrival_s: float = math.inf
    #: (time s, cumulative block hit rate, used blocks, cached blocks)
    timeline: list[tuple[float, float, int, int]] = attrs.field(factory=list)
    steps: int = 0
    batched_tokens: int = 0
    used_block_sum: float = 0.0
    used_block_samples: int = 0
    used_block_peak: int = 0
    fragmentation_sum: float = 0.0
    simulated_s: float = 0.0
    #: The engine's prefill cost: (FLOPs per token, FLOPs per causal token
    #: pair), for the share of prefill compute that cache hits saved.
    prefill_flops: tuple[float, float] | None = None
    #: An engine that runs several runtimes (a cluster) counts the run
    #: here, in place of the runtime's counters; and what the report's
    #: ``cluster`` section shows (its instances, transfers, goodput).
    counters: Counters | None = None
    cluster: dict[str, Any] | None = None
    max_samples: int = 2000
    _every: int = 1
    _events: int = 0

    def record(self, outcome: RequestOutcome) -> None:
        self.finished += 1
        self.output_tokens += outcome.num_output_tokens
        self.first_arrival_s = min(self.first_arrival_s, outcome.arrival_s)
        self.ttft_s.append(outcome.ttft_s)
        tenant = self.tenant_ttft_s.get(outcome.request.tenant)
        if tenant is None:
            tenant = self.tenant_ttft_s[outcome.request.tenant] = array("d")
        tenant.append(outcome.ttft_s)
        deadline = outcome.request.deadline_s
        if deadline is not None:
            self.deadlines += 1
            self.deadlines_met += outcome.first_token_s <= deadline
        self.e2e_s.append(outcome.finish_s - outcome.arrival_s)
        if outcome.tpot_s is not None:
            self.tpot_s.append(outcome.tpot_s)

    def sample(self, rt: Runtime, now_s: float, usage: PoolUsage) -> None:
        used_blocks = usage.num_used_blocks
        self.fragmentation_sum += usage.external_fragmentation
        self.used_block_sum += used_blocks
        self.used_block_samples += 1
        self.used_block_peak = max(self.used_block_peak, used_blocks)
        self._events += 1
        if self._events % self._every:
            return
        c = rt.counters
        rate = c.hit_blocks / c.query_blocks if c.query_blocks else 0.0
        self.timeline.append((now_s, rate, used_blocks, rt.num_cached_blocks))
        if len(self.timeline) >= self.max_samples:
            self.timeline = self.timeline[::2]
            self._every *= 2
