"""A tier lookup for a 2,000-token prompt (125 blocks of 16 tokens) with
every KV store configured (host, disk, Redis), as admission asks it
(``StoreTiers.match``: the prefix cache's content keys, then each store's
``contains`` in tier order), with a baseline in the same process: the
prefix cache's own lookup of the same prompt.

    .venv/bin/python benchmarks/tier_lookup.py

Cases: no store holds the prompt (most admissions: the first key is asked
of each store and the lookup stops), and every block is on the disk store
(asked of the host first), and every block is on the host store. Where
the blocks are held, a request's first lookup hashes its 125 block keys
(SHA-256, the prefix cache's ``sagellm_block_keys``); a waiting request
asked again (at its arrival's prefetch, then at each admission it waits
for) reuses them. Redis runs as a redis-server of its own on a free port
(skipped, said so, without the binary). Prints p50 and p99 per lookup over
many calls.
"""

from __future__ import annotations

import tempfile
import time

from sagellm_plugin_kv_stores.testing import redis_server

from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.runtime import Runtime
from sagellm_core.types import CachedBlock, Request

CONFIG = """
[prefix_cache]
plugin = "radix"
block_size = 16
[kv_pool]
plugin = "paged"
num_blocks = 4096
[eviction]
plugin = "lru"
[kv_stores]
tiers = {tiers}
bytes_per_block = 64
[kv_stores.disk]
path = "{disk}"
{redis}
[report]
hook_timing = false
"""
CALLS = 20_000


def timed(call, calls: int = CALLS) -> tuple[float, float]:
    """p50 and p99 of ``call()``, in µs."""
    for _ in range(1000):
        call()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2] * 1e6, samples[int(len(samples) * 0.99)] * 1e6


def main() -> None:
    with redis_server() as url, tempfile.TemporaryDirectory() as disk:
        tiers = ["host", "disk", *(["redis"] if url else [])]
        text = CONFIG.format(
            tiers=str(tiers).replace("'", '"'),
            disk=disk,
            redis=f'[kv_stores.redis]\nurl = "{url}"\nabsent_ttl_s = 3600.0' if url else "",
        )
        rt = Runtime(settings_from_toml(text), hook_timing=False)
        rt.stores.device_kv()
        prompt = Request("p", list(range(2001)), 1)  # 125 full blocks and one token to compute
        stores = [p.instance for p in rt.host.plugins["kv_stores"]]
        keys = rt.host.block_keys(prompt, 0, 125)
        rows = [
            ("the prefix cache's own lookup (baseline)", timed(lambda: rt.host.lookup(prompt))),
            (f"no store holds it ({', '.join(tiers)})", timed(lambda: rt.stores.match(prompt, 0))),
        ]
        blocks = [CachedBlock(i % 4096, i, None, key) for i, key in enumerate(keys)]

        def first() -> object:
            rt.stores.ended("p")  # a request not asked before: its 125 keys are hashed
            return rt.stores.match(prompt, 0)

        for store, where in ((stores[1], "disk"), (stores[0], "host")):  # disk only, then the host too
            store.put(blocks).result()
            rows.append((f"every block on the {where} store, first asked", timed(first, calls=2_000)))
            again = timed(lambda: rt.stores.match(prompt, 0))
            rows.append((f"every block on the {where} store, asked again", again))
        assert rt.stores.match(prompt, 0)[0].keys == tuple(keys)
    print(f"tier lookup of a 2,000-token prompt, stores {tiers}{'' if url else ' (no redis-server here)'}:")
    base = rows[0][1][0]
    for what, (p50, p99) in rows:
        print(f"  {what}: p50 {p50:.1f} µs, p99 {p99:.1f} µs ({p50 / base:.2f}x the baseline)")


if __name__ == "__main__":
    main()
