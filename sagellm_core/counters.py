"""What the runtime counts: the report is built from these."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from sagellm_core.types import SequenceState


@attrs.define
class TierCounters:
    """What the runtime counted of one KV store."""

    #: Eviction rounds offered to it, and the blocks it wrote or declined of them.
    put_rounds: int = 0
    written_blocks: int = 0
    declined_blocks: int = 0
    #: Reads, and the blocks of them that entered the device pool.
    get_rounds: int = 0
    loaded_blocks: int = 0
    #: Blocks read back whose bytes failed their checksum (dropped, recomputed).
    corrupt_blocks: int = 0
    #: Blocks it held that load-or-recompute computed instead (the load was slower).
    recomputed_blocks: int = 0
    #: Prefetches started, their blocks, and those not ready when their
    #: request was admitted (late: waited for, or given up past the time
    #: limit) or never loaded (wasted).
    prefetch_rounds: int = 0
    prefetched_blocks: int = 0
    late_prefetches: int = 0
    wasted_prefetched_blocks: int = 0
    #: Seconds the engine's costs charge for its loads (replay adds them to the steps).
    load_s: float = 0.0
    bytes_written: int = 0
    bytes_read: int = 0
    #: Seconds in its put and get calls (a copy it overlaps is not in them).
    seconds: float = 0.0

    def summary(self) -> dict[str, int | float]:
        return {**attrs.asdict(self), "seconds": round(self.seconds, 6), "load_s": round(self.load_s, 6)}


@attrs.define
class Counters:
    """What the runtime itself counts; the report is built from these."""

    requests_finished: int = 0
    requests_rejected: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    #: Causal (query, key) token pairs of the prompts and of their cached
    #: prefixes, n(n+1)/2 each: the attention part of prefill compute, which
    #: grows with depth, so a deep hit saves more than a shallow one.
    query_token_pairs: int = 0
    hit_token_pairs: int = 0
    #: Cached blocks a request found at arrival but not at admission: its
    #: prefix was evicted while it waited.
    lost_waiting_blocks: int = 0
    prefill_tokens: int = 0
    reprefill_tokens: int = 0
    evicted_blocks: int = 0
    preemptions: int = 0
    transfers: int = 0
    transfer_failures: int = 0
    transferred_blocks: int = 0
    transferred_bytes: int = 0
    transfer_s: float = 0.0
    #: Blocks found below the device after its cache hit (loaded back from
    #: a KV store, or by an engine's KV connector, instead of recomputed),
    #: first admissions.
    host_hit_blocks: int = 0
    #: KV store name -> what was counted of it.
    tiers: dict[str, TierCounters] = attrs.field(factory=dict)
    lifetime_abs_error: float = 0.0
    lifetime_predictions: int = 0
    #: Predictions the fallback made because the picked predictor failed,
    #: and the first failure, naming the plugin.
    lifetime_fallbacks: int = 0
    lifetime_failure: str | None = None
    #: reason -> requests rejected for it.
    rejections: dict[str, int] = attrs.field(factory=dict)
    #: Admission decisions that deferred a waiting request (one a step it
    #: was asked and deferred), and the rejections among ``rejections``.
    admission_deferrals: int = 0
    admission_rejections: int = 0
    #: tenant -> its requests' deferrals.
    tenant_deferrals: dict[str, int] = attrs.field(factory=dict)
    #: Compaction rounds (``Runtime.compact``) and the cached blocks they moved.
    compactions: int = 0
    moved_blocks: int = 0
    #: tenant -> [query blocks, hit blocks], first admissions only.
    tenant_blocks: dict[str, list[int]] = attrs.field(factory=dict)

    def count_rejection(self, reason: str) -> None:
        self.requests_rejected += 1
        self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def count_deferral(self, tenant: str) -> None:
        self.admission_deferrals += 1
        self.tenant_deferrals[tenant] = self.tenant_deferrals.get(tenant, 0) + 1

    def count_finish(self, state: SequenceState) -> None:
        self.requests_finished += 1
        if state.prediction is not None:
            self.lifetime_predictions += 1
            self.lifetime_abs_error += abs(state.prediction.output_tokens - state.num_output_tokens)

    def count_admission(self, state: SequenceState, hit_blocks: int, host_blocks: int, block_size: int) -> None:
        """A request admitted with ``hit_blocks`` of its prefix cached and
        the next ``host_blocks`` loaded from the host tier: its first
        admission in the hit rates, a later one (after preemption) as
        re-prefill."""
        request, c = state.request, self
        cached = hit_blocks * block_size
        if state.num_preemptions == 0:
            c.host_hit_blocks += host_blocks
            query = -(-request.num_prompt_tokens // block_size)
            c.query_blocks += query
            c.hit_blocks += hit_blocks
            c.lost_waiting_blocks += max(0, state.cached_tokens_hint // block_size - hit_blocks)
            tenant = c.tenant_blocks.setdefault(request.tenant, [0, 0])
            tenant[0] += query
            tenant[1] += hit_blocks
            c.query_tokens += request.num_prompt_tokens
            c.hit_tokens += cached
            c.query_token_pairs += request.num_prompt_tokens * (request.num_prompt_tokens + 1) // 2
            c.hit_token_pairs += cached * (cached + 1) // 2
            c.prefill_tokens += state.num_tokens - cached - host_blocks * block_size
        else:
            c.reprefill_tokens += state.num_tokens - cached
