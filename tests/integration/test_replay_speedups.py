"""The cache-only replay's hot path asks less of its plugins and gets the
same answers: the evictable blocks are asked for only when an
admission is short of free blocks (and that answer serves the first eviction
round), a prompt goes to the prefix cache without a copy when only a partial
last block is cut off, and the radix cache follows the path a request holds
instead of looking it up again."""

from __future__ import annotations

import pytest

from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.replay import session
from sagellm_core.types import Request, SequenceState

CACHE_ONLY = """
[engine]
name = "replay"
mode = "cache-only"
[workload]
source = "generator"
tenants = 3
sessions_per_tenant = 8
turns = 4
system_prompt_tokens = 256
[prefix_cache]
plugin = "radix"
block_size = 16
[kv_pool]
plugin = "paged"
num_blocks = {blocks}
[eviction]
plugin = "lru"
[report]
hook_timing = true
"""


def calls(result, hook):
    stats = result.runtime.timer.stats.get(f"sagellm_{hook}")
    return stats.calls if stats is not None else 0


def test_the_evictable_blocks_are_asked_for_only_when_an_admission_is_short():
    roomy = session.run(settings_from_toml(CACHE_ONLY.format(blocks=100_000)))
    assert roomy.report["evicted_blocks"] == 0
    # Once: the end-of-run check of the block accounting (it was once per admission).
    assert calls(roomy, "acquire_prefix") > 50 and calls(roomy, "evictable_blocks") == 1
    tight = session.run(settings_from_toml(CACHE_ONLY.format(blocks=300)))
    assert tight.report["evicted_blocks"] > 0 and tight.report["rejected"] == 0
    # One ask per eviction round (the admission's own serves its first), and the end-of-run check.
    assert calls(tight, "evictable_blocks") == calls(tight, "select_victims") + 1 > 1


@pytest.mark.parametrize("computed_extra", [0, -20])
def test_a_prompt_goes_to_the_prefix_cache_uncopied_unless_whole_blocks_are_cut(computed_extra):
    result = session.run(settings_from_toml(CACHE_ONLY.format(blocks=1000)))
    rt = result.runtime
    seen = []
    insert = rt.host.insert_prefix

    def spy(request, token_ids, block_ids):
        seen.append((request, token_ids, len(block_ids)))
        return insert(request, token_ids, block_ids)

    rt.host.insert_prefix = spy
    request = Request("fresh", list(range(10_000, 10_000 + 100)), 1)  # 6 full blocks and 4 tokens
    state = SequenceState(request)
    assert rt.admit(state, state.num_tokens) > 0
    state.num_computed_tokens = request.num_prompt_tokens + computed_extra
    rt.cache(state)
    ((_, token_ids, num_blocks),) = seen
    if computed_extra == 0:
        assert token_ids is request.prompt_token_ids and num_blocks == 6  # the partial block stays, unread
    else:  # 80 tokens computed: the blocks past them are cut off
        assert num_blocks == 5 and list(token_ids) == list(request.prompt_token_ids[:80])
    rt.finish(state)
    rt.check_invariants()
