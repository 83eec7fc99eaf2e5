"""The host tier's admission (sagellm_core.parts.tiers): offloads that never
come back stop after a whole turnover of the tier, a probe round in
PROBE_EVERY still goes, and a block loaded back opens the tier again."""

from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.parts.tiers import PROBE_EVERY
from sagellm_core.runtime import Runtime
from sagellm_core.types import PrefixMatch, Request

CONFIG = """
[prefix_cache]
plugin = "radix"
block_size = 4
[kv_pool]
plugin = "paged"
num_blocks = 8
[eviction]
plugin = "lru"
[transport]
plugin = "local"
offload_evicted = true
host_blocks = 16
bytes_per_block = 8
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


def test_offloads_that_never_return_bypass_the_tier_and_a_load_back_reopens_it():
    rt = Runtime(settings_from_toml(CONFIG), hook_timing=False)
    host = rt._host
    c = rt.counters
    served = 0
    # Distinct prompts: every evicted block goes to the tier until twice the
    # blocks it holds went there with none loaded back.
    while not host.bypassed:
        serve(rt, f"r{served}", prompt(served))
        served += 1
        assert c.host_bypassed_blocks == 0
    assert c.transferred_blocks == host.offloaded_since_load >= 2 * len(host.index) > 0
    rounds, blocks = c.transfers, c.evicted_blocks
    for _ in range(4 * PROBE_EVERY):
        serve(rt, f"r{served}", prompt(served))
        served += 1
    probes = c.transfers - rounds
    assert c.host_bypassed_blocks > 0
    assert 0 < probes <= 1 + (c.evicted_blocks - blocks) // PROBE_EVERY  # one round in PROBE_EVERY, at most
    assert c.transferred_blocks + c.host_bypassed_blocks == c.evicted_blocks  # every evicted block accounted for
    # A prompt whose blocks a probe put on the tier loads them back: the tier takes every round again.
    on_tier = next(n for n in range(served) if host.keys_after(Request(f"q{n}", prompt(n), 1), PrefixMatch(())))
    assert serve(rt, "again", prompt(on_tier)) > 0
    assert host.offloaded_since_load == 0 and not host.bypassed
    bypassed = c.host_bypassed_blocks
    serve(rt, f"r{served}", prompt(served))
    assert c.host_bypassed_blocks == bypassed  # offloaded again, not bypassed
    rt.check_invariants()


def test_a_tier_blocks_come_back_to_is_never_bypassed():
    rt = Runtime(settings_from_toml(CONFIG), hook_timing=False)
    # Two prompts taking turns in a pool that holds one: each evicts the
    # other, which then loads back from the tier.
    for turn in range(40):
        serve(rt, f"r{turn}", prompt(turn % 2))
    assert rt.counters.host_hit_blocks > 0 and rt.counters.host_bypassed_blocks == 0
