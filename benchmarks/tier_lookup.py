"""A tier lookup for a 2,000-token prompt (125 blocks of 16 tokens) with
every KV store configured (host, disk, Redis), as admission asks it
(``StoreTiers.match``: the prefix cache's content keys, then each store's
``contains`` in tier order), with a baseline in the same process: the
prefix cache's own lookup of the same prompt.

    .venv/bin/python benchmarks/tier_lookup.py [--prefix-cache radix|hash]

Cases: no store holds the prompt (most admissions: the first key is asked
of each store and the lookup stops); the prompt served and its blocks
evicted from the device (removed from the prefix cache and written to a
store, as the runtime evicts them), then held by the disk store only, and
by the host store too; and a process that never held it (a restart: a new
runtime on the same disk folder). A request's first lookup is a request
id not seen before, after the prefix cache's lookup at its arrival
(untimed: every request has it, stores or not), and it asks the prefix
cache for the prompt's 125 block keys (``sagellm_block_keys``): ``radix``
reads them off its memory of the blocks it removed, or hashes them
(SHA-256) where it never held them; ``hash`` has them from its lookup at
the arrival (it hashes every prompt there, memoised per request). A
waiting request asked again (at its arrival's prefetch, then at each
admission it waits for) reuses them. Each first lookup is checked to have
found all 125 blocks on the store of its row. Redis runs as a
redis-server of its own on a free port (skipped, said so, without the
binary). Prints p50 and p99 per lookup over many calls.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time

from sagellm_plugin_kv_stores.testing import redis_server

from sagellm_core.kit.testing import BlockIds, serve_prompt, settings_from_toml
from sagellm_core.runtime import Runtime
from sagellm_core.types import Request

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


def runtime(prefix_cache: str, tiers: list[str], disk: str, url: str | None) -> Runtime:
    text = CONFIG.format(
        prefix_cache=prefix_cache,
        tiers=str(tiers).replace("'", '"'),
        disk=disk,
        redis=f'[kv_stores.redis]\nurl = "{url}"\nabsent_ttl_s = 3600.0' if url else "",
    )
    rt = Runtime(settings_from_toml(text), hook_timing=False)
    rt.stores.device_kv()
    return rt


def first_asked(rt: Runtime, prompt: Request, tier: int) -> tuple[float, float]:
    """p50 and p99 of a request's first tier lookup, the prompt ``prompt``'s
    under a request id not seen before, looked up as at its arrival (untimed);
    each lookup checked to have found every block on the store ``tier``."""
    ids = itertools.count()
    found = []

    def arrived() -> Request:
        if found:  # the previous request ends (as each is admitted or ends): its keys are dropped
            rt.stores.ended(f"new {len(found) - 1}")
        request = Request(f"new {next(ids)}", prompt.prompt_token_ids, 1)
        rt.host.lookup(request)
        return request

    def looked_up(request: Request) -> None:
        runs = rt.stores.match(request, 0)
        found.append(len(runs) == 1 and runs[0].tier == tier and len(runs[0].keys) == 125)

    figures = timed(looked_up, calls=2_000, before=arrived)
    assert all(found), f"not every lookup found the prompt's 125 blocks on store {tier}"
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-cache", choices=["radix", "hash"], default="radix")
    args = parser.parse_args()
    with redis_server() as url, tempfile.TemporaryDirectory() as disk:
        tiers = ["host", "disk", *(["redis"] if url else [])]
        rt = runtime(args.prefix_cache, tiers, disk, url)
        prompt = Request("p", list(range(2001)), 1)  # 125 full blocks and one token to compute
        stores = [p.instance for p in rt.host.plugins["kv_stores"]]
        cache = rt.host.plugins["prefix_cache"][0].instance
        rows = [
            ("the prefix cache's own lookup (baseline)", timed(lambda _: rt.host.lookup(prompt))),
            (f"no store holds it ({', '.join(tiers)})", timed(lambda _: rt.stores.match(prompt, 0))),
        ]
        # The prompt served and its blocks evicted from the device, as the
        # runtime evicts them: removed from the prefix cache and written to
        # a store (which reads their keys).
        served = Request("served", prompt.prompt_token_ids, 1)
        serve_prompt(cache, served, 16, BlockIds())
        removed = cache.sagellm_remove_blocks(block_ids=list(cache.sagellm_evictable_blocks()))
        assert len(removed) == 125 and rt.host.lookup(prompt).num_blocks == 0, "the prompt is still on the device"
        for tier, where in ((1, "disk"), (0, "host")):  # disk only, then the host too
            stores[tier].put(removed).result()
            rows.append((f"every block on the {where} store, first asked", first_asked(rt, prompt, tier)))
            again = timed(lambda _: rt.stores.match(prompt, 0))
            rows.append((f"every block on the {where} store, asked again", again))
        assert rt.stores.match(prompt, 0)[0].keys == tuple(b.key for b in removed)
        # A process that never held the prompt (a restart): the disk store
        # recovers its blocks from the folder; its prefix cache has no keys
        # of them.
        restarted = runtime(args.prefix_cache, tiers, disk, url)
        assert restarted.host.plugins["kv_stores"][1].instance.stats()["recovered"] == 125
        rows.append(("every block on the disk store, first asked after a restart", first_asked(restarted, prompt, 1)))
    print(
        f"tier lookup of a 2,000-token prompt, prefix cache {args.prefix_cache!r}, stores {tiers}"
        f"{'' if url else ' (no redis-server here)'}:"
    )
    base = rows[0][1][0]
    for what, (p50, p99) in rows:
        print(f"  {what}: p50 {p50:.1f} µs, p99 {p99:.1f} µs ({p50 / base:.2f}x the baseline)")


if __name__ == "__main__":
    main()
