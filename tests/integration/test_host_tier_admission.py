"""The host store's admission (sagellm_plugin_kv_stores.host), driven by
the runtime: offloads that never come back stop after a whole turnover of
the store, a probe round in PROBE_EVERY still goes, and a block loaded back
opens the store again."""

from sagellm_plugin_kv_stores.host import PROBE_EVERY

from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.runtime import Runtime
from sagellm_core.types import Request

CONFIG = """
[prefix_cache]
plugin = "radix"
block_size = 4
[kv_pool]
plugin = "paged"
num_blocks = 8
[eviction]
plugin = "lru"
[kv_stores]
tiers = ["host"]
bytes_per_block = 8
[kv_stores.host]
capacity_blocks = 16
"""


def serve(rt: Runtime, rid: str, prompt: list[int]) -> int:
    """Admit, cache and finish one request; return the blocks it found on the host tier."""
    state = rt.arrive(Request(request_id=rid, prompt_token_ids=prompt, output_tokens=1))
    before = rt.counters.host_hit_blocks
    assert rt.admit(state, 1024) > 0
    state.num_computed_tokens = state.num_tokens
    rt.cache(state)
    rt.finish(state)
    return rt.counters.host_hit_blocks - before


def prompt(n: int) -> list[int]:
    return [n * 100 + i for i in range(17)]  # four full blocks, nothing shared with another n


def test_offloads_that_never_return_are_declined_and_a_load_back_reopens_the_store():
    rt = Runtime(settings_from_toml(CONFIG), hook_timing=False)
    host = rt.host.plugins["kv_stores"][0].instance
    tier = rt.counters.tiers["host"]
    c = rt.counters
    served = 0
    # Distinct prompts: every evicted block goes to the store until twice the
    # blocks it holds went there with none loaded back.
    while not host.declining:
        serve(rt, f"r{served}", prompt(served))
        served += 1
        assert tier.declined_blocks == 0
    assert tier.written_blocks == host.written_since_read >= 2 * len(host.index) > 0
    written, evicted, rounds = tier.written_blocks, c.evicted_blocks, tier.put_rounds
    for _ in range(4 * PROBE_EVERY):
        serve(rt, f"r{served}", prompt(served))
        served += 1
    assert tier.declined_blocks > 0
    # One round in PROBE_EVERY is written, at most (each round evicts at most the pool).
    probes = tier.written_blocks - written
    assert 0 < probes <= (1 + (tier.put_rounds - rounds) // PROBE_EVERY) * 8
    assert tier.written_blocks + tier.declined_blocks == c.evicted_blocks  # every evicted block accounted for
    assert c.evicted_blocks > evicted
    # A prompt whose blocks a probe put in the store loads them back: it takes every round again.
    on_store = next(n for n in range(served) if host.contains(rt.host.block_keys(Request(f"q{n}", prompt(n), 1), 0, 1)))
    assert serve(rt, "again", prompt(on_store)) > 0
    assert host.written_since_read == 0 and not host.declining
    declined = tier.declined_blocks
    serve(rt, f"r{served}", prompt(served))
    assert tier.declined_blocks == declined  # written again, not declined
    rt.check_invariants()


def test_a_store_blocks_come_back_to_never_declines():
    rt = Runtime(settings_from_toml(CONFIG), hook_timing=False)
    # Two prompts taking turns in a pool that holds one: each evicts the
    # other, which then loads back from the tier.
    for turn in range(40):
        serve(rt, f"r{turn}", prompt(turn % 2))
    assert rt.counters.host_hit_blocks > 0 and rt.counters.tiers["host"].declined_blocks == 0
