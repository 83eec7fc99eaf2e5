"""Property-based: random request streams through the real runtime and
first-party plugins never leak a block, never free one twice, and keep every
cached block's reference count equal to the requests holding it."""

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.runtime import Runtime
from sagellm_core.types import Request

BLOCK = 4
# A few shared bases, so prompts share prefixes of every length.
BASES = [list(range(b * 1000, b * 1000 + 40)) for b in range(3)]

CONFIG = """
[prefix_cache]
plugin = "{cache}"
block_size = 4
{cache_params}
[kv_pool]
plugin = "paged"
num_blocks = 20
[eviction]
plugin = "{policy}"
[lifetime]
plugin = "stat"
[kv_stores]
tiers = ["host"]
bytes_per_block = 16
[kv_stores.host]
capacity_blocks = 8
"""


def machine(policy: str, cache: str = "radix"):
    cache, _, cache_params = cache.partition(" ")  # "radix pin_after_hits = 2"

    class RuntimeMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.rt = Runtime(
                settings_from_toml(CONFIG.format(policy=policy, cache=cache, cache_params=cache_params)),
                hook_timing=False,
            )
            self.cache = self.rt.host.plugins["prefix_cache"][0].instance
            self.running = []
            self.waiting = []
            self.serial = 0

        @rule(
            base=st.integers(0, len(BASES) - 1),
            shared=st.integers(0, 40),
            tail=st.lists(st.integers(0, 50), max_size=12),
            outputs=st.one_of(st.none(), st.lists(st.integers(60, 90), min_size=1, max_size=9)),
            budget=st.integers(1, 64),
            slo=st.one_of(st.none(), st.integers(0, 5)),
        )
        def arrive_and_admit(self, base, shared, tail, outputs, budget, slo):
            prompt = BASES[base][:shared] + tail or [7]
            self.serial += 1
            self.rt.set_time(float(self.serial))  # one request a second; some deadlines pass while waiting
            request = Request(
                request_id=f"r{self.serial}",
                prompt_token_ids=prompt,
                output_tokens=len(outputs) if outputs else 3,
                output_token_ids=outputs,
                arrival_s=self.rt.now_s,
                deadline_s=None if slo is None else self.rt.now_s + slo,
            )
            state = self.rt.arrive(request)
            self._admit(state, budget)

        def _admit(self, state, budget):
            n = self.rt.admit(state, budget)
            if n:
                state.num_computed_tokens += n
                self.running.append(state)
            else:
                self.waiting.append(state)

        @precondition(lambda self: self.waiting)
        @rule(index=st.integers(0, 100), budget=st.integers(1, 64))
        def readmit(self, index, budget):
            state = self.waiting.pop(index % len(self.waiting))
            self._admit(state, budget)

        @precondition(lambda self: self.running)
        @rule(index=st.integers(0, 100), n=st.integers(1, 16))
        def grow(self, index, n):
            state = self.running[index % len(self.running)]
            n = min(n, state.num_tokens - state.num_computed_tokens)
            if n and self.rt.grow(state, n):
                state.num_computed_tokens += n
            if state.num_computed_tokens == state.num_tokens and state.num_output_tokens < state.request.output_tokens:
                state.num_output_tokens += 1

        @precondition(lambda self: self.running)
        @rule(index=st.integers(0, 100))
        def cache_blocks(self, index):
            self.rt.cache(self.running[index % len(self.running)])

        @precondition(lambda self: self.running)
        @rule(index=st.integers(0, 100))
        def preempt(self, index):
            state = self.running.pop(index % len(self.running))
            self.rt.preempt(state)
            self.waiting.append(state)

        @precondition(lambda self: self.running)
        @rule(index=st.integers(0, 100))
        def finish(self, index):
            self.rt.finish(self.running.pop(index % len(self.running)))

        @invariant()
        def blocks_are_accounted_for(self):
            self.rt.check_invariants()

        @invariant()
        def refcounts_match_holders(self):
            holders = Counter(b for s in self.running for b in s.block_ids if b not in s.private_block_ids)
            for block_id in self.rt.ledger.cached:
                assert self.cache.refcount(block_id) == holders[block_id], block_id
            assert len(self.cache) == len(self.rt.ledger.cached)

        @invariant()
        def tables_cover_computed_tokens(self):
            for s in self.running:
                assert len(s.block_ids) * BLOCK >= s.num_computed_tokens
                assert len(set(s.block_ids)) == len(s.block_ids)

    RuntimeMachine.__name__ = f"RuntimeMachine_{policy}_{cache}{'_pinned' if cache_params else ''}"
    return RuntimeMachine


@pytest.mark.parametrize(
    "policy, cache",
    [
        ("lru", "radix"),
        ("lfu", "radix"),
        ("s3fifo", "radix"),
        ("arc", "radix"),
        ("predictive", "radix"),
        ("continuation", "radix"),
        ("cost", "radix"),
        ("slo", "radix"),
        ("fair", 'radix isolate = "tenant"'),
        ("lru", "hash"),
        ("s3fifo", "hash"),
        ("continuation", "hash"),
        ("lru", "radix pin_after_hits = 2"),
        ("predictive", "radix pin_after_hits = 2"),
        ("continuation", "radix pin_after_hits = 2"),
    ],
)
def test_runtime_block_accounting(policy, cache):
    case = machine(policy, cache).TestCase
    case.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
    case("runTest").runTest()


def test_a_refused_admission_tells_the_policy_what_its_match_pinned(bad_plugins):
    """Hardening class 4: with ``pin_after_hits``, a prefix matched by an
    admission that memory then refuses was pinned and the policy never
    told; a policy that follows the protocol without filtering candidates
    (the template's way) then named a pinned block and the run died."""
    text = """
[prefix_cache]
plugin = "radix"
block_size = 4
pin_after_hits = 1
max_pinned_share = 1.0
[kv_pool]
plugin = "paged"
num_blocks = 8
[eviction]
plugin = "unfiltered"
"""
    rt = Runtime(settings_from_toml(text), hook_timing=False)

    def serve(rid, tokens):
        state = rt.arrive(Request(rid, tokens, 1))
        assert rt.admit(state, len(tokens)) == len(tokens)
        state.num_computed_tokens = len(tokens)
        rt.finish(state)

    serve("a", list(range(13)))  # 3 cached blocks, released first
    serve("e", list(range(500, 505)))  # 1 cached block, released last
    refused = rt.arrive(Request("b", list(range(12)) + list(range(100, 140)), 1))
    assert rt.admit(refused, 64) == 0  # matched a's 3 blocks (now pinned), then 13 blocks > 4 free + 1 evictable
    assert len(rt.pinned_blocks()) == 3 and len(rt.evictable()) == 1
    rt.check_invariants()
    fits = rt.arrive(Request("c", list(range(200, 217)), 1))
    assert rt.admit(fits, 17) == 17  # 5 blocks: 4 free and e's, which the policy must name, not a's
    assert rt.counters.evicted_blocks == 1
    rt.check_invariants()
