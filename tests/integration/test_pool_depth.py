"""Quotas, admission by predicted footprint and compaction, end to end in
timed replay: what each promises holds on random workloads."""

from __future__ import annotations

import itertools
from pathlib import Path

import hypothesis.strategies as st
import numpy
import pytest
from hypothesis import given, settings

from sagellm_core import hookimpl
from sagellm_core.drivers.engines import build_engine
from sagellm_core.errors import ConfigError
from sagellm_core.kit.testing import declare_plugins, settings_from_toml
from sagellm_core.replay import session
from sagellm_core.replay.engine import TimedReplay
from sagellm_core.types import KVCaches, Request

CONFIG = """
[engine]
name = "replay"
max_num_batched_tokens = {budget}
[prefix_cache]
plugin = "{prefix_cache}"
block_size = 4
[kv_pool]
plugin = "{pool}"
num_blocks = {blocks}
[eviction]
plugin = "{eviction}"
[report]
hook_timing = false
"""


def config(budget=256, blocks=64, pool="paged", prefix_cache="radix", eviction="lru", extra="") -> str:
    return CONFIG.format(budget=budget, blocks=blocks, pool=pool, prefix_cache=prefix_cache, eviction=eviction) + extra


@pytest.fixture(autouse=True, scope="module")
def test_plugins(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plugins")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))
        patch.syspath_prepend(str(folder))
        declare_plugins(
            folder,
            {
                "sagellm.lifetime": {"oracle": "pool_depth_plugins:Oracle"},
                "sagellm.admission": {"recording-quota": "pool_depth_plugins:RecordingQuota"},
            },
        )
        yield


class Engine(TimedReplay):
    """Timed replay that keeps the tenant ledger as each step ran (after its admissions)."""

    ledger_at_execute: dict[str, int] = {}

    def execute(self, step):
        self.ledger_at_execute = dict(self.rt.ledger.tenants.blocks)
        return super().execute(step)


def engine(text: str) -> Engine:
    settings = settings_from_toml(text)
    plugin, _ = build_engine(settings)
    return Engine(session.build_runtime(settings, plugin), plugin.settings, plugin.cost)


PROMPTS = itertools.count()
requests = st.lists(
    st.tuples(st.sampled_from("abc"), st.integers(1, 60), st.integers(1, 40), st.integers(0, 3)),
    min_size=1,
    max_size=16,
)
#: A random run: its seed, pool size, step budget and requests.
POOL_RUNS = dict(seed=st.integers(0, 10**6), blocks=st.integers(30, 120), budget=st.integers(16, 256), sizes=requests)


def add(e: Engine, sizes, seed) -> None:
    for i, (tenant, prompt, output, shared) in enumerate(sizes):
        start = next(PROMPTS) * 1000
        system = list(range(10**6 * (shared + 1), 10**6 * (shared + 1) + 8 * shared))  # some share a prefix
        e.add_request(
            Request(f"{tenant}{i}-{seed}", system + list(range(start, start + prompt)), output, tenant=tenant)
        )


def drain(e: Engine, each_step=lambda: None) -> dict[str, str | None]:
    ended, steps = {}, 0
    while e.has_work():
        for out in e.step():
            if out.finished:
                ended[out.request_id] = out.finish_reason
        e.rt.check_invariants()
        each_step()
        steps += 1
        assert steps < 20_000
    return ended


@settings(max_examples=25, deadline=None)
@given(**POOL_RUNS)
def test_admission_by_an_exact_footprint_never_preempts(seed, blocks, budget, sizes):
    extra = '[lifetime]\nplugin = "oracle"\n[admission]\nplugin = "footprint"\nmax_wait_s = 1e9\n'
    e = engine(config(budget, blocks, extra=extra))
    add(e, sizes, seed)
    ended = drain(e)
    assert len(ended) == len(sizes) and set(ended.values()) <= {"length", "rejected"}
    assert e.rt.counters.preemptions == 0
    assert set(e.rt.counters.rejections) <= {"never fits the pool"}


QUOTA = """
[admission]
plugin = "recording-quota"
guarantees = {{a = {ga}, b = {gb}}}
caps = {{c = {cc}}}
lend = {lend}
"""


@settings(max_examples=25, deadline=None)
@given(
    **POOL_RUNS,
    shares=st.tuples(st.sampled_from([0.0, 0.2, 0.4]), st.sampled_from([0.0, 0.2, 0.5]), st.sampled_from([0.3, 1.0])),
    lend=st.sampled_from([0.0, 1.0]),
)
def test_a_guarantee_is_short_only_while_another_tenant_holds_a_loan_and_admissions_keep_to_caps(
    seed, blocks, budget, sizes, shares, lend
):
    ga, gb, cc = shares
    e = engine(config(budget, blocks, extra=QUOTA.format(ga=ga, gb=gb, cc=cc, lend=lend)))
    guarantee, cap = {"a": int(ga * blocks), "b": int(gb * blocks)}, int(cc * blocks)
    add(e, sizes, seed)
    within = e.rt.host.plugins["admission"][0].instance.within  # what the rule admitted within a guarantee
    within.clear()
    running: set[str] = set()

    def each_step():
        held = e.ledger_at_execute
        for state in within:
            if any(w is state for w in e.waiting):
                # memory refused a request within its tenant's guarantee: another held more than its own
                assert any(n > guarantee.get(t, 0) for t, n in held.items() if t != state.request.tenant), held
        within.clear()
        admitted = [s for s in e.running if s.request_id not in running]
        if any(s.request.tenant == "c" for s in admitted):  # the step's admissions took c at most to its cap
            assert held.get("c", 0) <= cap
        running.clear()
        running.update(s.request_id for s in e.running)

    ended = drain(e, each_step)
    assert len(ended) == len(sizes)
    assert set(e.rt.counters.rejections) <= {"never fits the pool", "needs more blocks than its tenant's cap"}


def test_a_compacting_pool_is_refused_beside_a_policy_that_cannot_follow_moves():
    text = config(pool="runs", eviction="arc").replace('plugin = "runs"\n', 'plugin = "runs"\ncompact = true\n')
    with pytest.raises(ConfigError) as err:
        engine(text)
    message = str(err.value)
    assert "[kv_pool]" in message and "'arc'" in message and "sagellm_blocks_moved" in message and "\n" not in message
    engine(config(pool="runs", eviction="arc"))  # without compaction: nothing to follow


COMPACT = 'plugin = "runs"\ncompact = true\nmax_fragmentation = 0.0\nmin_steps_between = 1\n'


def runs_config(compact: bool, prefix_cache: str, eviction: str, budget: int, blocks: int, moves="islands") -> str:
    text = config(budget, blocks, pool="runs", prefix_cache=prefix_cache, eviction=eviction)
    return text.replace('plugin = "runs"\n', COMPACT + f'moves = "{moves}"\n') if compact else text


@settings(max_examples=20, deadline=None)
@given(
    **POOL_RUNS,
    prefix_cache=st.sampled_from(["radix", "hash"]),
    eviction=st.sampled_from(["lru", "lfu", "fair"]),
    moves=st.sampled_from(["islands", "gather", "pieces"]),
)
def test_compaction_preserves_every_cached_block_s_bytes_and_keys(
    seed, blocks, budget, sizes, prefix_cache, eviction, moves
):
    """Each cached block's KV row holds its key from when it was cached; after
    every step, every cached block's row still does, and the run hits and
    preempts exactly as without compaction."""
    outcomes = []
    for compact in (False, True):
        e = engine(runs_config(compact, prefix_cache, eviction, budget, blocks, moves))
        kv = numpy.zeros((blocks,), dtype=numpy.uint64)

        def copy(src, src_ids, dst, dst_ids):
            dst[list(dst_ids)] = src[list(src_ids)]

        e.rt.register_kv_caches(KVCaches(kv, 0, copy))
        cache = e.rt.host.plugins["prefix_cache"][0].instance

        class Writer:
            @hookimpl
            def sagellm_blocks_cached(self, blocks, kv=kv):
                for b in blocks:
                    kv[b.block_id] = numpy.uint64(b.key)

        e.rt.host.pm.register(Writer())

        def check(kv=kv, cache=cache):
            records = cache._info if prefix_cache == "radix" else {b.block_id: b for b in cache._by_hash.values()}
            for block_id, block in records.items():
                assert kv[block_id] == numpy.uint64(block.key)

        add(e, sizes, seed)
        ended = drain(e, check)
        c = e.rt.counters
        outcomes.append((ended, c.hit_blocks, c.query_blocks, c.preemptions, c.evicted_blocks, c.reprefill_tokens))
    assert outcomes[0] == outcomes[1]


@settings(max_examples=20, deadline=None)
@given(**POOL_RUNS, reserve=st.integers(1, 6), compact=st.booleans())
def test_reservations_end_every_request_as_without_and_stay_free_blocks(seed, blocks, budget, sizes, reserve, compact):
    """With blocks set aside for requests to grow into, every request ends
    as without them, the runtime's and the pool's accounts agree after every
    step, and every reservation is free blocks right after its request's
    last block, that request running."""
    ended = []
    for kept in (0, reserve):
        text = runs_config(compact, "radix", "lru", budget, blocks, "pieces")
        if kept:
            text = text.replace('plugin = "runs"\n', f'plugin = "runs"\nreserve = {kept}\n')
        e = engine(text)
        pool = e.rt.host.plugins["kv_pool"][0].instance
        assert e.rt.reserves == bool(kept)

        def check(pool=pool, rt=e.rt):
            running = rt.ledger.active
            for owner, (start, length) in pool._reserved.items():
                assert all(pool._is_free[start : start + length])
                assert owner in running and running[owner].block_ids[-1] == start - 1
            assert pool._num_reserved == sum(length for _, length in pool._reserved.values())

        add(e, sizes, seed)
        ended.append(drain(e, check))
    assert ended[0] == ended[1]


def test_compaction_rejoins_the_holes_finished_requests_leave_and_their_prefixes_still_hit():
    moved = []
    for compact in (False, True):
        e = engine(runs_config(compact, "radix", "lru", 256, 32))
        prompts = [list(range(100 * i, 100 * i + 9)) for i in range(6)]  # two full blocks and a partial one
        for i, prompt in enumerate(prompts):
            e.add_request(Request(f"first{i}", prompt, 1))
        drain(e)  # each leaves its two full blocks cached, and its partial block a hole between them
        assert e.rt.pool_usage().num_free_runs == 6
        for i, prompt in enumerate(prompts):
            e.add_request(Request(f"again{i}", prompt, 1))
        e.step()  # a compacting pool moves the cached islands out first
        assert e.rt.counters.moved_blocks == (8 if compact else 0)  # all but the island beside the run they went to
        drain(e)
        c = e.rt.counters
        moved.append((c.compactions, c.moved_blocks, c.hit_blocks, c.query_blocks))
    assert moved[0][2:] == moved[1][2:] == (12, 36)  # every prefix hit again, moved or not
    assert moved[0][:2] == (0, 0) and moved[1][1] == 8


WORKLOAD = """
[workload]
tenants = 3
sessions_per_tenant = 4
turns = 3
system_prompt_tokens = 24
user_tokens = 12
output_tokens = 10
session_rate = 20.0
think_time_s = 0.2
"""


def test_the_report_has_each_tenant_s_deferrals_ttft_and_the_quota_s_figures():
    quota = '[admission]\nplugin = "quota"\nguarantees = {"tenant-0" = 0.4}\ncaps = {"tenant-1" = 0.5}\n'
    report = session.run(settings_from_toml(config(128, 48, extra=quota) + WORKLOAD)).report
    figures = report["plugin_figures"]["quota"]
    assert set(figures) <= {"tenant-0", "tenant-1", "tenant-2"} and set(report["tenant_ttft_s"]) == set(figures)
    deferred = report["admission"]["tenant_deferrals"]
    assert sum(deferred.values()) == report["admission"]["deferrals"]
    assert {t: f["deferred"] for t, f in figures.items() if f["deferred"]} == deferred and deferred
