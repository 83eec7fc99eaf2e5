"""Whom the adaptive eviction policy follows, per setting of the policy suite.

    .venv/bin/python benchmarks/adaptive_leaders.py [WORKLOAD:BLOCKS ...]

Replays each setting (a workload of the suite in
``sagellm_plugin_eviction/suite.toml`` and a pool size) cache-only with
``adaptive`` and prints its block hit rate, how many times the lead changed
and the first changes, the leader at the end, and each expert's decayed
shadow hits at the end. Defaults: the settings ``docs/benchmarks/policy-suite.md``
quotes (Mooncake at 2,754 blocks, the agents at 335, the tenant mix at 311
and 480, RAG at 761).
"""

from __future__ import annotations

import sys

from sagellm_plugin_eviction import suite
from sagellm_plugin_eviction.adaptive import AdaptiveEviction

from sagellm_core.replay import session

DEFAULT = ["mooncake:2754", "agentic:335", "tenant-mix:311", "tenant-mix:480", "rag:761"]


def main(settings: list[str]) -> None:
    parsed, where = suite.read_suite(None)
    entries = {entry["name"]: entry for entry in parsed["workload"]}
    for setting in settings:
        name, _, blocks = setting.partition(":")
        config = suite._settings(entries[name], where, suite.default_traces(), int(blocks), "adaptive")
        result = session.run(config)
        (policy,) = [p.instance for p in result.runtime.host.plugins["eviction"]]
        assert isinstance(policy, AdaptiveEviction)
        scores = ", ".join(f"{e.name} {s:,.1f}" for e, s in zip(policy.experts, policy.scores))
        first = ", ".join(f"{name} at {at:,}" for at, name in policy.switches[:6])
        print(
            f"{name} {int(blocks):,} blocks: hit rate {result.report['block_hit_rate']:.4f};"
            f" {len(policy.switches)} changes of leader (first: {first or 'none'});"
            f" leader at the end {policy.leader_name}; shadow hits at the end: {scores}"
        )


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT)
