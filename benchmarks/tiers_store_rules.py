"""What a store's rules trade on the Mooncake conversation trace,
cache-only: its write rule (``[kv_stores.NAME] write``, ``write_on``) and
its eviction policy (``eviction``), as the hits a host store gives back
against the blocks and bytes written to it.

    cd benchmarks && ../.venv/bin/python tiers_store_rules.py [--max-requests N] [--host-blocks N]

The trace's own 512-token blocks, 10,000 device blocks (radix + paged +
LRU, as ``contrib/configs/mooncake-host-tier.toml``), then a host store
under the rules of the row; stand-in rows of 64 bytes (replay has no KV
tensors). Every row runs in this process, one after another. (A disk or
Redis store writes on its own thread, which a cache-only replay outruns:
what it holds at a lookup would be the machine's speed, not the rule's.)
"""

from __future__ import annotations

import argparse

from tiers_replay import TRACE

from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.replay import session

CONFIG = """
[engine]
mode = "cache-only"
[workload]
source = "mooncake"
path = "{trace}"
trace_block_tokens = 512
max_requests = {max_requests}
[prefix_cache]
plugin = "radix"
block_size = 512
[kv_pool]
plugin = "paged"
num_blocks = 10000
[eviction]
plugin = "lru"
[kv_stores]
tiers = ["host"]
bytes_per_block = 64
[kv_stores.host]
capacity_blocks = {host_blocks}
write = "{write}"
write_on = "{write_on}"
eviction = "{eviction}"
[report]
hook_timing = false
"""

#: (write, write_on, eviction): the write rules under the store's own
#: order, then every block on eviction under each policy.
ROWS = [
    ("all", "eviction", ""),
    ("reused", "eviction", ""),
    ("all", "through", ""),
    ("reused", "through", ""),
    *(("all", "eviction", policy) for policy in ("lru", "lfu", "s3fifo", "arc")),
]


def run(row: tuple[str, str, str], max_requests: int, host_blocks: int) -> dict:
    write, write_on, eviction = row
    text = CONFIG.format(
        trace=TRACE,
        max_requests=max_requests,
        host_blocks=host_blocks,
        write=write,
        write_on=write_on,
        eviction=eviction,
    )
    return session.run(settings_from_toml(text, f"<{row}>")).report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-requests", type=int, default=12031)
    parser.add_argument("--host-blocks", type=int, default=10000)
    args = parser.parse_args()
    print(
        "| write | write_on | eviction | device hit rate | host hit rate | blocks written | bytes written"
        " | put rounds |\n|---|---|---|---:|---:|---:|---:|---:|"
    )
    written: dict[tuple[str, str, str], int] = {}
    for row in ROWS:
        report = run(row, args.max_requests, args.host_blocks)
        host = report["kv_stores"]["host"]
        # Each row did what its label says: its store was written under its
        # rule and gave hits back, and reused-only wrote no more than all.
        written[row] = host["written_blocks"]
        assert host["written_blocks"] > 0 and report["host_hit_rate"] > 0, (row, host)
        if row[0] == "reused":
            assert written[row] <= written[("all", row[1], row[2])], (row, written)
        print(
            f"| {row[0]} | {row[1]} | {row[2] or 'its own (oldest written)'} | {report['block_hit_rate']:.4f}"
            f" | {report['host_hit_rate']:.4f} | {host['written_blocks']:,} | {host['bytes_written']:,}"
            f" | {host['put_rounds']:,} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
