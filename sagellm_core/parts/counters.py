"""What the runtime counts: the report is built from these."""

from __future__ import annotations

import attrs


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
    #: Blocks found on the host tier after the device-cache hit (loaded back
    #: by an engine's KV connector instead of recomputed), first admissions.
    host_hit_blocks: int = 0
    lifetime_abs_error: float = 0.0
    lifetime_predictions: int = 0
    #: Predictions the fallback made because the picked predictor failed,
    #: and the first failure, naming the plugin.
    lifetime_fallbacks: int = 0
    lifetime_failure: str | None = None
    #: reason -> requests rejected for it.
    rejections: dict[str, int] = attrs.field(factory=dict)
    #: tenant -> [query blocks, hit blocks], first admissions only.
    tenant_blocks: dict[str, list[int]] = attrs.field(factory=dict)
