"""KV stores under the device pool (``[kv_stores] tiers``): the plugin
guide's dict store runs as a tier and finds what the host store finds, a
block whose bytes were altered in a store (or on disk) never enters the
device pool (counted, dropped, recomputed), each block comes from the first
store that holds it, the hit figures add up for any workload, a
restarted process finds the disk store's blocks, and each store holds what
its write rule offers it (``write``, ``write_on``), the same bytes either way."""

from __future__ import annotations

import re
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from sagellm_core.errors import PluginError
from sagellm_core.kit.testing import declare_plugins, settings_from_toml
from sagellm_core.replay import session
from sagellm_core.runtime import Runtime
from sagellm_core.types import Request

HERE = Path(__file__).parent
GUIDE = HERE.parents[1] / "docs" / "plugin-guide.md"

CONFIG = """
[engine]
mode = "{mode}"
[workload]
source = "generator"
seed = {seed}
tenants = 1
sessions_per_tenant = {sessions}
turns = 3
system_prompt_tokens = 64
user_tokens = 64
output_tokens = 32
[prefix_cache]
plugin = "radix"
block_size = 16
[kv_pool]
plugin = "paged"
num_blocks = {blocks}
[eviction]
plugin = "lru"
[report]
hook_timing = false
"""


#: Dict stores (they keep all they are offered), one per write rule.
RULES = {
    "evicted": ("all", "eviction"),
    "reused": ("reused", "eviction"),
    "through": ("all", "through"),
    "reused-through": ("reused", "through"),
}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stores")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(HERE))
        patch.syspath_prepend(str(folder))
        yield declare_plugins(
            folder,
            {
                "sagellm.kv_stores": {
                    "dict": "dict_store:DictStore",
                    # The same store under more names: several tiers, each with its write rule.
                    **{name: "dict_store:DictStore" for name in RULES},
                    "corrupting": "store_faults:CorruptingStore",
                    "short-reads": "store_faults:ShortReads",
                }
            },
            name="sagellm-test-stores",
        )


def run(tiers: str, mode: str = "cache-only", seed: int = 0, sessions: int = 24, blocks: int = 64, prefetch=False):
    text = CONFIG.format(mode=mode, seed=seed, sessions=sessions, blocks=blocks)
    if tiers:
        text += f"[kv_stores]\ntiers = [{tiers}]\nbytes_per_block = 32\nprefetch = {str(prefetch).lower()}\n"
    if '"host"' in tiers:
        text += "[kv_stores.host]\ncapacity_blocks = 100000\n"
    result = session.run(settings_from_toml(text))
    return result.report, result.runtime


def test_the_plugin_guide_prints_the_dict_store_in_full_under_60_lines():
    source = re.search(r"## A KV store.*?```python\n(.*?)```", GUIDE.read_text(), re.S).group(1)
    assert source == (HERE / "dict_store.py").read_text() and len(source.splitlines()) < 60


def test_the_dict_store_runs_as_a_tier_and_finds_what_the_host_store_finds(stores):
    device_only, _ = run("")
    with_dict, rt = run('"dict"')
    with_host, _ = run('"host"')
    assert device_only["host_hit_blocks"] == 0 and device_only["evicted_blocks"] > 0
    assert with_dict["host_hit_blocks"] > 0
    assert with_dict["host_hit_blocks"] == with_host["host_hit_blocks"]
    assert with_dict["kv_stores"]["dict"]["loaded_blocks"] == with_dict["host_hit_blocks"]
    # Device hits are counted apart; the stores' blocks are not prefilled again.
    assert with_dict["block_hit_rate"] == device_only["block_hit_rate"]
    assert with_dict["prefill_tokens"] == device_only["prefill_tokens"] - with_dict["host_hit_blocks"] * 16
    rt.check_invariants()


@pytest.mark.parametrize("mode", ["cache-only", "timed"])
def test_a_disk_store_in_replay_finds_what_the_host_store_finds(tmp_path, mode):
    """Replay's clock is simulated: a put is waited for as it is made, so a
    disk store (whose writes run on a thread) holds every block written by
    the time it is asked, as the host store does, whatever this machine's
    disk and load. Before, the replay ran ahead of the writer and the disk
    store loaded a few percent of what the host store loaded."""
    with_host, _ = run('"host"', mode=mode, sessions=48)
    text = CONFIG.format(mode=mode, seed=0, sessions=48, blocks=64)
    text += f'[kv_stores]\ntiers = ["disk"]\nbytes_per_block = 32\n[kv_stores.disk]\npath = "{tmp_path}"\n'
    text += "capacity_blocks = 100000\n"
    with_disk = session.run(settings_from_toml(text)).report
    assert with_host["host_hit_blocks"] > 100
    assert with_disk["kv_stores"]["disk"]["loaded_blocks"] == with_host["kv_stores"]["host"]["loaded_blocks"]


def test_a_block_altered_in_its_store_never_enters_the_device_pool(stores):
    clean, _ = run('"dict"', mode="timed")
    report, rt = run('"corrupting"', mode="timed")
    tier = report["kv_stores"]["corrupting"]
    assert tier["corrupt_blocks"] > 0
    assert tier["loaded_blocks"] == report["host_hit_blocks"] < clean["host_hit_blocks"]
    store = rt.host.plugins["kv_stores"][0].instance
    assert store.reads > tier["loaded_blocks"]  # more were read than were let in
    assert report["requests"] == clean["requests"] and report["rejected"] == 0  # recomputed instead
    # Every token of a prompt is computed, loaded or hit, exactly once.
    saved = report["host_hit_blocks"] * 16 + report["tokens_saved"]
    assert (
        report["prefill_tokens"] + saved
        == clean["prefill_tokens"] + clean["host_hit_blocks"] * 16 + clean["tokens_saved"]
    )
    rt.check_invariants()


def test_a_store_that_reads_back_fewer_blocks_than_asked_is_named(stores):
    with pytest.raises(PluginError, match=r"kv_stores plugin 'short-reads' .*get gave \(\d+, \d+, \d+\) rows"):
        run('"short-reads"')


def test_each_block_comes_from_the_first_store_that_holds_it(stores):
    report, rt = run('"dict", "host"')
    dict_tier, host_tier = report["kv_stores"]["dict"], report["kv_stores"]["host"]
    # Both are offered every eviction; the dict holds all of it, so the host store is never read.
    assert dict_tier["written_blocks"] == host_tier["written_blocks"] + host_tier["declined_blocks"] > 0
    assert dict_tier["loaded_blocks"] == report["host_hit_blocks"] > 0 and host_tier["get_rounds"] == 0


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), sessions=st.integers(2, 16), blocks=st.integers(24, 96))
def test_store_loads_add_up_for_any_workload(stores, seed, sessions, blocks):
    device_only, _ = run("", seed=seed, sessions=sessions, blocks=blocks)
    report, rt = run('"dict"', seed=seed, sessions=sessions, blocks=blocks)
    loaded = report["kv_stores"]["dict"]["loaded_blocks"]
    assert loaded == report["host_hit_blocks"]
    assert report["block_hit_rate"] == device_only["block_hit_rate"]  # cache-only: the device's hits do not move
    assert report["prefill_tokens"] == device_only["prefill_tokens"] - loaded * 16
    assert report["kv_stores"]["dict"]["written_blocks"] == report["evicted_blocks"]
    rt.check_invariants()
    # A prefetch starts copies early; it never changes what is loaded or computed.
    prefetched, rt = run('"dict"', seed=seed, sessions=sessions, blocks=blocks, prefetch=True)
    tier = prefetched["kv_stores"]["dict"]
    assert tier["loaded_blocks"] == loaded and prefetched["prefill_tokens"] == report["prefill_tokens"]
    assert tier["wasted_prefetched_blocks"] <= tier["prefetched_blocks"] and bool(tier["prefetch_rounds"]) == bool(
        loaded
    )
    rt.check_invariants()


DISK = """
[prefix_cache]
plugin = "radix"
block_size = 4
[kv_pool]
plugin = "paged"
num_blocks = 8
[eviction]
plugin = "lru"
[kv_stores]
tiers = ["disk"]
bytes_per_block = 256
[kv_stores.disk]
path = "{path}"
[report]
hook_timing = false
"""


def serve(rt: Runtime, rid: str, prompt: list[int]) -> int:
    """Admit, cache and finish one request; the blocks it loaded from the stores."""
    state = rt.arrive(Request(request_id=rid, prompt_token_ids=prompt, output_tokens=1))
    before = rt.counters.host_hit_blocks
    assert rt.admit(state, 1024) > 0
    state.num_computed_tokens = state.num_tokens
    rt.finish(state)
    return rt.counters.host_hit_blocks - before


def disk_runtime(folder) -> Runtime:
    rt = Runtime(settings_from_toml(DISK.format(path=folder)), hook_timing=False)
    rt.stores.device_kv().tensor[:] = np.arange(256, dtype=np.uint8)  # bytes worth checking
    return rt


def test_a_block_flipped_on_disk_is_not_served_and_a_restarted_process_finds_the_rest(tmp_path):
    a, b = list(range(100, 117)), list(range(200, 229))  # 4 and 7 full blocks
    rt = disk_runtime(tmp_path)
    serve(rt, "a", a)
    serve(rt, "b", b)  # the pool holds 8: a's blocks are evicted, written to disk
    assert rt.stores.report()["disk"]["written_blocks"] >= 4  # (waits for the writer)
    second = next(tmp_path.rglob(f"{rt.host.block_keys(Request('k', a, 1), 1, 2)[0]:016x}.kv"))
    data = bytearray(second.read_bytes())
    data[-1] ^= 0xFF  # a's second block, altered on disk
    second.write_bytes(bytes(data))
    assert serve(rt, "a again", a) == 1  # its first block only: the second failed its check
    report = rt.stores.report()["disk"]
    assert report["corrupt_blocks"] == 1 and report["store"]["removed"] == 1 and not second.exists()
    rt.check_invariants()
    # A new process on the same folder finds what the first left there.
    again = disk_runtime(tmp_path)
    assert again.stores.report()["disk"]["store"]["recovered"] == len(list(tmp_path.rglob("*.kv"))) > 0
    assert serve(again, "a", a) == 1  # a's first block, up to the one dropped
    again.check_invariants()


def test_a_prefetch_asked_for_a_waiting_request_is_loaded_at_its_admission_or_counted_wasted(tmp_path):
    """``rt.prefetch(state)``, the entry point a client's hint calls where
    ``[kv_stores] prefetch`` is off: once a request; the blocks it set
    moving are loaded at admission, or wasted if the request ends first."""
    a, b = list(range(100, 117)), list(range(200, 229))
    rt = disk_runtime(tmp_path)
    serve(rt, "a", a)
    serve(rt, "b", b)  # a's 4 blocks evicted to disk
    rt.stores.report()  # (the writes done)
    gone = rt.arrive(Request("gone", a, 1))
    assert not rt.stores.prefetch_started("gone")  # not configured: nothing moves at arrival
    assert rt.prefetch(gone) == 4 and rt.prefetch(gone) == 0
    rt.conclude(gone)  # ended while it waited (an abort)
    disk = rt.stores.report()["disk"]
    assert (disk["prefetch_rounds"], disk["prefetched_blocks"], disk["wasted_prefetched_blocks"]) == (1, 4, 4)
    state = rt.arrive(Request("a again", a, 1))
    assert rt.prefetch(state) == 4
    assert rt.admit(state, 1024) > 0 and not rt.stores.prefetch_started("a again")
    disk = rt.stores.report()["disk"]
    assert (disk["prefetch_rounds"], disk["loaded_blocks"], disk["wasted_prefetched_blocks"]) == (2, 4, 4)
    assert rt.prefetch(state) == 0  # admitted: nothing left to move
    state.num_computed_tokens = state.num_tokens
    rt.finish(state)
    rt.check_invariants()


def test_a_waiting_request_s_keys_are_hashed_once(tmp_path):
    """A request asked of the stores at its arrival's prefetch and again at
    each admission it waits for hashes its block keys once; once admitted
    or ended, a request with the same id hashes its own."""
    a, b = list(range(100, 117)), list(range(200, 229))
    rt = Runtime(settings_from_toml(DISK.format(path=tmp_path)), hook_timing=True)
    serve(rt, "a", a)
    serve(rt, "b", b)  # a's blocks on disk
    rt.stores.report()
    hashed = rt.timer.stats["sagellm_block_keys"]
    state = rt.arrive(Request("a again", a, 1))
    before = hashed.calls
    expected = rt.stores.match(state.request, 0)
    assert [len(run.keys) for run in expected] == [4] and hashed.calls == before + 2  # the first key, then all
    assert rt.prefetch(state) == 4 and rt.stores.match(state.request, 0) == expected and hashed.calls == before + 2
    assert rt.admit(state, 1024) > 0
    state.num_computed_tokens = state.num_tokens
    rt.finish(state)
    other = Request("a again", b, 1)  # the same id, another prompt: its own keys
    assert rt.stores.match(other, 0) != expected and hashed.calls > before + 2


TIMED = """
[engine]
mode = "timed"
[workload]
tenants = 2
sessions_per_tenant = 16
turns = 4
seed = 3
[prefix_cache]
plugin = "radix"
block_size = 16
[kv_pool]
plugin = "paged"
num_blocks = 1200
[eviction]
plugin = "lru"
[kv_stores]
tiers = ["host"]
bytes_per_block = 16
[report]
hook_timing = false
"""


def timed(**sets) -> dict:
    text = TIMED
    for key, value in sets.items():
        section, name = key.split("__")
        text = text.replace(f"[{section}]\n", f"[{section}]\n{name} = {value}\n", 1)
    return session.run(settings_from_toml(text)).report


def test_load_or_recompute_computes_what_a_slow_link_would_load_slower():
    free = timed()["kv_stores"]["host"]
    assert free["loaded_blocks"] > 0 and free["load_s"] == 0  # no link: loads cost nothing, every one is taken
    always = timed(engine__tier_links='{host = "network"}', kv_stores__load_or_recompute="false")
    weighed = timed(engine__tier_links='{host = "network"}')
    assert always["kv_stores"]["host"]["recomputed_blocks"] == 0 and always["kv_stores"]["host"]["load_s"] > 0
    # Llama-3.1-8B on an H100 computes a 16-token block faster than 25 GbE brings its 2 MiB.
    assert weighed["kv_stores"]["host"]["loaded_blocks"] == 0 < weighed["kv_stores"]["host"]["recomputed_blocks"]
    assert weighed["ttft_s"]["mean"] < always["ttft_s"]["mean"]  # the modelled clock: loads are in TTFT


def test_a_prefetch_started_at_arrival_makes_slow_loads_worth_it():
    without = timed(engine__tier_links='{host = "network"}')["kv_stores"]["host"]
    report = timed(engine__tier_links='{host = "network"}', kv_stores__prefetch="true")
    tier = report["kv_stores"]["host"]
    assert without["prefetch_rounds"] == 0 and tier["prefetch_rounds"] > 0
    assert tier["loaded_blocks"] > without["loaded_blocks"] == 0  # loads whose copy was done while they waited
    assert 0 < tier["late_prefetches"] < tier["prefetch_rounds"]
    # What was prefetched was loaded or wasted (admitted without it, or recomputed).
    assert tier["prefetched_blocks"] >= tier["loaded_blocks"] and tier["wasted_prefetched_blocks"] > 0


class FixedCosts:
    """Loads from the store ``slow`` cost 1 s, from any other nothing; a token costs 0.01 s."""

    simulated = True

    def __init__(self, slow: str):
        self.slow = slow

    def load_s(self, tier, num_blocks):
        return 1.0 if tier == self.slow else 0.0

    def recompute_s(self, num_tokens, num_cached_tokens):
        return 0.01 * num_tokens

    def loaded(self, tier, num_blocks, seconds):
        pass


def test_runs_are_loaded_up_to_the_first_one_slower_than_recompute(stores):
    from sagellm_core.stores import ExternalRun

    text = CONFIG.format(mode="cache-only", seed=0, sessions=2, blocks=64) + '[kv_stores]\ntiers = ["dict", "host"]\n'
    rt = Runtime(settings_from_toml(text), hook_timing=False)
    runs = (ExternalRun(0, (1, 2)), ExternalRun(1, (3,)), ExternalRun(0, (4,)))
    assert rt.stores.worth_loading("r", runs, 0, 0.0) == (runs, ())  # no costs: every run is loaded
    rt.set_load_costs(FixedCosts(slow="nobody"))
    assert rt.stores.worth_loading("r", runs, 0, 0.0) == (runs, ())
    rt.set_load_costs(FixedCosts(slow="host"))  # 1 s against 0.16 s for its one block: computed, and all after it
    assert rt.stores.worth_loading("r", runs, 0, 0.0) == (runs[:1], runs[1:])


def test_the_report_shows_each_store_s_hits_loads_recomputes_and_prefetches():
    from sagellm_core.replay.report import markdown

    report = timed(engine__tier_links='{host = "network"}', kv_stores__prefetch="true")
    report["label"] = "prefetch"
    host = report["kv_stores"]["host"]
    row = next(line for line in markdown([report]).splitlines() if line.startswith("| prefetch | host |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == f"{host['loaded_blocks'] / report['query_blocks']:.4f}"
    assert cells[3:8] == [
        f"{host['loaded_blocks']:,}",
        f"{host['get_rounds']:,}",
        f"{host['recomputed_blocks']:,}",
        f"{host['prefetch_rounds']:,} / {host['late_prefetches']:,}",
        f"{host['wasted_prefetched_blocks']:,}",
    ]
    assert host["loaded_blocks"] and host["recomputed_blocks"] and host["prefetch_rounds"]


# -------------------------------------------------- what each tier writes --

RULED = """
[prefix_cache]
plugin = "radix"
block_size = 4
[kv_pool]
plugin = "paged"
num_blocks = 16
[eviction]
plugin = "lru"
[kv_stores]
tiers = [{tiers}]
bytes_per_block = 8
[report]
hook_timing = false
"""


def ruled_runtime(names: list[str]) -> Runtime:
    text = RULED.format(tiers=", ".join(f'"{n}"' for n in names))
    for name in names:
        write, write_on = RULES[name]
        text += f'[kv_stores.{name}]\nwrite = "{write}"\nwrite_on = "{write_on}"\n'
    return Runtime(settings_from_toml(text), hook_timing=False)


def content(key: int) -> np.ndarray:
    """The bytes the test's engine computes for the block of content key ``key``."""
    return np.frombuffer(key.to_bytes(8, "little"), dtype=np.uint8)


def drive(rt: Runtime, prompts: list[list[int]]) -> tuple[set[int], set[int], int]:
    """Serve ``prompts`` one after another, writing each computed block's
    bytes (its key's :func:`content`) into the device rows and checking the
    bytes of each loaded block. Returns the keys the device hit, the keys it
    cached, and the blocks loaded."""
    hit, cached, loaded = set(), set(), 0
    rows = rt.stores.device_kv().tensor
    for i, prompt in enumerate(prompts):
        request = Request(f"r{i}", prompt, 1)
        full = len(prompt) // 4
        keys = rt.host.block_keys(request, 0, full)
        state = rt.arrive(request)
        device = rt.host.lookup(request).num_blocks
        hit.update(keys[:device])
        assert rt.admit(state, 1024) > 0
        n = rt.counters.host_hit_blocks - loaded
        loaded += n
        for key, block_id in zip(keys[device : device + n], state.block_ids[device : device + n]):
            assert (rows[block_id] == content(key)).all()  # a loaded block holds its own bytes
        for key, block_id in zip(keys[device + n :], state.block_ids[device + n : full]):
            rows[block_id] = content(key)  # computed
        cached.update(keys)
        state.num_computed_tokens = state.num_tokens
        rt.finish(state)
    rt.stores.report()  # (every write counted)
    return hit, cached, loaded


def held(rt: Runtime, name: str) -> set[int]:
    return set(next(s.instance for s in rt.stores.stores if s.selection.name == name).blocks)


shared_prompts = st.lists(
    st.tuples(st.integers(0, 3), st.integers(4, 40), st.integers(0, 8)), min_size=1, max_size=24
).map(lambda picks: [[p * 1000 + t for t in range(n)] + [9000 + i] * extra for i, (p, n, extra) in enumerate(picks)])


@settings(max_examples=25, deadline=None)
@given(prompts=shared_prompts)
def test_each_tier_holds_what_its_write_rule_offers_it(stores, prompts):
    """Four dict stores (they keep all they are offered) under the four
    rules: a reused-only tier never holds a block the device did not hit;
    written through, a tier holds every block cached (or every block hit)
    as soon as it is."""
    rt = ruled_runtime(list(RULES))
    hit, cached, _ = drive(rt, prompts)
    assert held(rt, "reused") <= hit and held(rt, "reused") <= held(rt, "evicted")
    assert held(rt, "reused-through") == hit
    assert held(rt, "through") == cached
    report = rt.stores.report()
    assert report["evicted"]["written_blocks"] == rt.counters.evicted_blocks
    rt.check_invariants()


@settings(max_examples=25, deadline=None)
@given(prompts=shared_prompts)
def test_a_tier_written_through_serves_the_same_bytes_as_one_written_on_eviction(stores, prompts):
    on_eviction = ruled_runtime(["evicted"])
    through = ruled_runtime(["through"])
    # drive checks every loaded block's bytes; both load the same blocks.
    assert drive(on_eviction, prompts) == drive(through, prompts)
    on_eviction.check_invariants()
    through.check_invariants()


def test_a_reused_only_tier_writes_fewer_blocks_and_an_eviction_copies_nothing_to_a_write_through_tier(stores):
    prompts = [[p * 1000 + t for t in range(24)] + [9000 + i] * 4 for i, p in enumerate([0, 1, 0, 2, 3, 0, 1, 2])]
    rt = ruled_runtime(list(RULES))
    hit, cached, loaded = drive(rt, prompts)
    report = rt.stores.report()
    assert 0 < report["reused"]["written_blocks"] < report["evicted"]["written_blocks"]
    # Written through: every block cached (one loaded back is offered again as it is cached again).
    assert held(rt, "through") == cached and len(cached) > len(held(rt, "evicted"))
    rounds = report["through"]["put_rounds"]
    rt.reset_prefix_cache()  # every cached block evicted
    assert rt.stores.report()["through"]["put_rounds"] == rounds  # already written: no copy at eviction
    assert loaded > 0


def test_a_write_rule_not_known_is_named():
    from sagellm_core.errors import ConfigError

    bad = RULED.format(tiers='"host"') + '[kv_stores.host]\nwrite = "hot"\n'
    with pytest.raises(ConfigError, match=r"\[kv_stores\.host\] write = 'hot': one of all, reused"):
        settings_from_toml(bad)
    bad = RULED.format(tiers='"host"') + '[kv_stores.host]\nwrite_on = "admission"\n'
    with pytest.raises(ConfigError, match=r"\[kv_stores\.host\] write_on = 'admission': one of eviction, through"):
        settings_from_toml(bad)
    # The runtime's keys are taken out; the store gets its own.
    good = settings_from_toml(
        RULED.format(tiers='"host"') + '[kv_stores.host]\nwrite = "reused"\ncapacity_blocks = 8\n'
    )
    assert good.kv_stores.tiers[0].params == {"capacity_blocks": 8}
    assert good.kv_stores.rules[0].write == "reused"
