"""A tier lookup for a 2,000-token prompt (125 blocks of 16 tokens) with
every KV store configured (host, disk, Redis), as admission asks it
(``StoreTiers.match``: the prefix cache's content keys, then each store's
``contains`` in tier order), with a baseline in the same process: the
prefix cache's own lookup of the same prompt.

    .venv/bin/python benchmarks/tier_lookup.py [--prefix-cache radix|hash]

Cases: no store holds the prompt (most admissions: the first key is asked
of each store and the lookup stops), and every block is on the disk store
(asked of the host first), and every block is on the host store. Where
the blocks are held, a request's first lookup (a request id not seen
before, after the prefix cache's lookup at its arrival, untimed) asks the
prefix cache for its 125 block keys (``sagellm_block_keys``): ``radix``
hashes them then (SHA-256; its own lookup walks tokens and hashes
nothing), ``hash`` has them from its lookup at the arrival (it hashes
every prompt there, memoised per request); a waiting request asked again
(at its arrival's prefetch, then at each admission it waits for) reuses
them. Redis runs as a redis-server of its own on a free port
(skipped, said so, without the binary). Prints p50 and p99 per lookup over
many calls.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time

from sagellm_plugin_kv_stores.testing import redis_server

from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.runtime import Runtime
from sagellm_core.types import CachedBlock, Request

CONFIG = """
[prefix_cache]
plugin = "{prefix_cache}"
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


def timed(call, calls: int = CALLS, before=None) -> tuple[float, float]:
    """p50 and p99 of ``call(x)``, in µs, ``x = before()`` untimed each time."""
    for _ in range(1000):
        call(before() if before else None)
    samples = []
    for _ in range(calls):
        x = before() if before else None
        start = time.perf_counter()
        call(x)
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2] * 1e6, samples[int(len(samples) * 0.99)] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-cache", choices=["radix", "hash"], default="radix")
    args = parser.parse_args()
    with redis_server() as url, tempfile.TemporaryDirectory() as disk:
        tiers = ["host", "disk", *(["redis"] if url else [])]
        text = CONFIG.format(
            prefix_cache=args.prefix_cache,
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
            ("the prefix cache's own lookup (baseline)", timed(lambda _: rt.host.lookup(prompt))),
            (f"no store holds it ({', '.join(tiers)})", timed(lambda _: rt.stores.match(prompt, 0))),
        ]
        blocks = [CachedBlock(i % 4096, i, None, key) for i, key in enumerate(keys)]
        ids = itertools.count()

        def arrived() -> Request:
            """The same prompt under a request id not seen before, looked up as at its arrival."""
            request = Request(f"new {next(ids)}", prompt.prompt_token_ids, 1)
            rt.host.lookup(request)
            return request

        for store, where in ((stores[1], "disk"), (stores[0], "host")):  # disk only, then the host too
            store.put(blocks).result()
            first = timed(lambda request: rt.stores.match(request, 0), calls=2_000, before=arrived)
            rows.append((f"every block on the {where} store, first asked", first))
            again = timed(lambda _: rt.stores.match(prompt, 0))
            rows.append((f"every block on the {where} store, asked again", again))
        assert rt.stores.match(prompt, 0)[0].keys == tuple(keys)
    print(
        f"tier lookup of a 2,000-token prompt, prefix cache {args.prefix_cache!r}, stores {tiers}"
        f"{'' if url else ' (no redis-server here)'}:"
    )
    base = rows[0][1][0]
    for what, (p50, p99) in rows:
        print(f"  {what}: p50 {p50:.1f} µs, p99 {p99:.1f} µs ({p50 / base:.2f}x the baseline)")


if __name__ == "__main__":
    main()
