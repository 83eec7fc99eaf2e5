"""Prometheus metrics and KV stats.

Names follow vLLM's where vLLM has the metric, with ``vllm:`` swapped for
``sagellm:`` (so a vLLM dashboard needs one substitution); sagellm's own add
what it decides: evictions by policy, host-tier hits and bytes moved, hook
latency per hook, lifetime prediction error.

The runtime's counters are read on the engine thread (a snapshot per
scrape), so a scrape never sees a step half done; the latency histograms
and finish reasons are observed there too, as each request ends (aborted
ones included).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from sagellm_plugin_torch.engine import EngineCore

from sagellm_core.drivers.step_engine import StepOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)


def kv_stats(core: EngineCore) -> dict[str, Any]:
    """The pool and the prefix cache now, and the hit rates so far (on the
    engine thread)."""
    rt = core.rt
    c = rt.counters
    usage = rt.pool_usage()
    held = set()
    for state in core.running:
        held.update(state.block_ids)
    return {
        "num_blocks": rt.num_blocks,
        "block_size": rt.block_size,
        "used_blocks": usage.num_used_blocks,
        "free_blocks": usage.num_free_blocks,
        "cached_blocks": rt.num_cached_blocks,
        "evictable_blocks": len(rt.evictable()),
        "pinned_blocks": len(rt.pinned_blocks()),
        "blocks_held_by_requests": len(held),
        "requests_running": len(core.running),
        "requests_waiting": len(core.waiting),
        "block_hit_rate": round(c.hit_blocks / c.query_blocks, 6) if c.query_blocks else 0.0,
        "token_hit_rate": round(c.hit_tokens / c.query_tokens, 6) if c.query_tokens else 0.0,
        "host_hit_blocks": c.host_hit_blocks,
        "evicted_blocks": c.evicted_blocks,
        # Per KV store: its writes, loads and prefetches (started, late, wasted).
        "stores": {name: tier.summary() for name, tier in c.tiers.items()},
        "tenants": {
            tenant: {"query_blocks": q, "hit_blocks": h, "block_hit_rate": round(h / q, 6) if q else 0.0}
            for tenant, (q, h) in sorted(c.tenant_blocks.items())
        },
    }


def _numbers(figures: dict[str, Any], path: str = "") -> Iterator[tuple[tuple[str, str], float]]:
    """The numbers among the plugins' figures: ((name, dotted key), value)."""
    for key, value in figures.items():
        where = f"{path}.{key}" if path else key
        if isinstance(value, dict):
            yield from _numbers(value, where)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            name, _, figure = where.partition(".")
            yield (name, figure), float(value)


class ServerMetrics:
    def __init__(self, policy: str):
        self.policy = policy
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "sagellm:time_to_first_token_seconds",
            "Time to first token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "sagellm:time_per_output_token_seconds",
            "Time per output token after the first.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "sagellm:e2e_request_latency_seconds", "Arrival to finish.", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.lifetime_error = Histogram(
            "sagellm:lifetime_abs_error_tokens",
            "|predicted - actual| output length per finished request.",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000),
            registry=self.registry,
        )
        self.params_n = Histogram(
            "sagellm:request_params_n",
            "The n (choices) of each completion request.",
            buckets=(1, 2, 5, 10, 20),
            registry=self.registry,
        )
        self.success: dict[str, int] = {}
        self._snapshot: dict[str, Any] = {}
        self.registry.register(self)

    def observe(self, out: StepOutput) -> None:
        """A request produced an output (on the engine thread; the
        histograms are thread-safe, ``success`` is written there only)."""
        if not out.finished:
            return
        self.success[out.finish_reason or "unknown"] = self.success.get(out.finish_reason or "unknown", 0) + 1
        o = out.outcome
        if o is None:
            return
        self.ttft.observe(max(0.0, o.ttft_s))
        self.e2e.observe(max(0.0, o.finish_s - o.arrival_s))
        if o.tpot_s is not None:
            self.tpot.observe(max(0.0, o.tpot_s))
        if o.prediction is not None:
            self.lifetime_error.observe(abs(o.prediction.output_tokens - o.num_output_tokens))

    def snapshot(self, core: EngineCore) -> dict[str, Any]:
        """Read the runtime's counters (on the engine thread)."""
        rt = core.rt
        c = rt.counters
        usage = rt.pool_usage()
        timer = rt.timer
        hooks = {}
        if timer is not None:
            for name, stats in timer.stats.items():
                if stats.calls:
                    hooks[name.removeprefix("sagellm_")] = (stats.calls, stats.total_s, stats.percentile_us(0.99) / 1e6)
        return {
            "running": len(core.running),
            "waiting": len(core.waiting),
            "kv_usage": usage.num_used_blocks / rt.num_blocks,
            "query_tokens": c.query_tokens,
            "hit_tokens": c.hit_tokens,
            "preemptions": c.preemptions,
            "prompt_tokens": c.query_tokens,
            "generation_tokens": core.generated_tokens,
            "evicted_blocks": c.evicted_blocks,
            "host_hit_blocks": c.host_hit_blocks,
            "transferred_bytes": c.transferred_bytes,
            "transfers": c.transfers,
            "transfer_failures": c.transfer_failures,
            "hooks": hooks,
            "tenant_blocks": dict(rt.ledger.tenants.blocks),
            "tenant_deferrals": dict(c.tenant_deferrals),
            "moved_blocks": c.moved_blocks,
            "plugin_figures": dict(_numbers(rt.host.plugin_figures())),
        }

    def render(self, snapshot: dict[str, Any]) -> str:
        self._snapshot = snapshot
        return generate_latest(self.registry).decode()

    # The runtime's figures, as a prometheus_client collector.
    def collect(self):
        s = self._snapshot
        if not s:
            return
        yield GaugeMetricFamily("sagellm:num_requests_running", "Requests in the running batch.", value=s["running"])
        yield GaugeMetricFamily("sagellm:num_requests_waiting", "Requests waiting to be admitted.", value=s["waiting"])
        yield GaugeMetricFamily(
            "sagellm:kv_cache_usage_perc", "Share of KV blocks in use (1 = full).", value=s["kv_usage"]
        )

        def counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None):
            family = CounterMetricFamily(name, doc, labels=list(labels or {}))
            family.add_metric(list((labels or {}).values()), value)
            return family

        yield counter("sagellm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s["query_tokens"])
        yield counter("sagellm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s["hit_tokens"])
        yield counter("sagellm:num_preemptions", "Requests preempted (recomputed later).", s["preemptions"])
        yield counter("sagellm:prompt_tokens", "Prompt tokens of admitted requests.", s["prompt_tokens"])
        yield counter("sagellm:generation_tokens", "Tokens generated.", s["generation_tokens"])
        success = CounterMetricFamily(
            "sagellm:request_success", "Requests finished, by reason.", labels=["finished_reason"]
        )
        for reason, count in sorted(self.success.items()):
            success.add_metric([reason], count)
        yield success
        yield counter(
            "sagellm:evicted_blocks",
            "Cached blocks evicted, by eviction policy.",
            s["evicted_blocks"],
            {"policy": self.policy},
        )
        yield counter(
            "sagellm:host_tier_hit_blocks",
            "Blocks loaded back from the host tier instead of recomputed.",
            s["host_hit_blocks"],
        )
        yield counter("sagellm:kv_transfer_bytes", "KV bytes moved between tiers.", s["transferred_bytes"])
        transfers = CounterMetricFamily("sagellm:kv_transfers", "KV transfers, by outcome.", labels=["outcome"])
        transfers.add_metric(["ok"], s["transfers"] - s["transfer_failures"])
        transfers.add_metric(["failed"], s["transfer_failures"])
        yield transfers
        held = GaugeMetricFamily(
            "sagellm:tenant_kv_blocks", "KV blocks in each tenant's admitted requests' block tables.", labels=["tenant"]
        )
        for tenant, blocks in sorted(s["tenant_blocks"].items()):
            held.add_metric([tenant], blocks)
        yield held
        deferred = CounterMetricFamily(
            "sagellm:tenant_admission_deferrals", "Admission deferrals of each tenant's requests.", labels=["tenant"]
        )
        for tenant, count in sorted(s["tenant_deferrals"].items()):
            deferred.add_metric([tenant], count)
        yield deferred
        yield counter("sagellm:compaction_moved_blocks", "Cached blocks a compacting pool moved.", s["moved_blocks"])
        figures = GaugeMetricFamily(
            "sagellm:plugin_figure", "Plugins' own figures (the report's plugin_figures).", labels=["name", "figure"]
        )
        for (name, figure), value in sorted(s["plugin_figures"].items()):
            figures.add_metric([name, figure], value)
        yield figures
        latency = SummaryMetricFamily(
            "sagellm:hook_latency_seconds", "Time in each hook (all its plugins).", labels=["hook"]
        )
        p99 = GaugeMetricFamily(
            "sagellm:hook_latency_p99_seconds", "Each hook's 99th percentile call time (sampled).", labels=["hook"]
        )
        for hook, (calls, total, q99) in sorted(s["hooks"].items()):
            latency.add_metric([hook], count_value=calls, sum_value=total)
            p99.add_metric([hook], q99)
        yield latency
        yield p99
