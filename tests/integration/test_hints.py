"""Client KV hints through the real runtime and the ``hints`` eviction
policy: random request streams with random hints (pins, unpins, releases,
retention) never evict a pinned block, never take a tenant past its pin
budget, and keep the block accounting; without hints the policy is its
fallback, block for block."""

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sagellm_core import hookimpl
from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.replay import session
from sagellm_core.runtime import Runtime
from sagellm_core.types import KVHints, Request

BLOCK = 4
TENANTS = ("a", "b")
BASES = [list(range(b * 1000, b * 1000 + 40)) for b in range(3)]

CONFIG = """
[prefix_cache]
plugin = "radix"
block_size = 4
[kv_pool]
plugin = "paged"
num_blocks = {num_blocks}
[eviction]
{eviction}
"""


def config(num_blocks: int, fallback: str = "lru", hinted: bool = True):
    """The runtime's settings: ``hints`` on ``fallback``, or the fallback alone."""
    eviction = f'plugin = "hints"\nfallback = "{fallback}"\npin_ttl_s = 6.0' if hinted else f'plugin = "{fallback}"'
    return settings_from_toml(CONFIG.format(num_blocks=num_blocks, eviction=eviction))


class PinWatch:
    """Registered beside the plugins: every eviction is checked against the
    policy's pins as they are when the blocks go, and every tenant against
    its pin budget."""

    def __init__(self, policy):
        self.policy = policy
        self.evicted = 0
        self.evicted_once_pinned = 0

    @hookimpl
    def sagellm_blocks_evicted(self, blocks):
        pinned = self.policy.pinned_keys()
        for block in blocks:
            assert block.key not in pinned, f"pinned block {block.block_id} (key {block.key}) evicted"
        self.evicted += len(blocks)
        self.check_budgets()

    def check_budgets(self):
        policy = self.policy
        for tenant in TENANTS:
            assert len(policy.pinned_keys(tenant)) <= policy.pin_budget, tenant
        assert len(policy.pinned_keys()) <= policy.max_pinned


class Victims:
    """Registered beside the plugins: every eviction, in order."""

    def __init__(self):
        self.seen: list[tuple[int, ...]] = []

    @hookimpl
    def sagellm_blocks_evicted(self, blocks):
        self.seen.append(tuple(b.block_id for b in blocks))


hints = st.one_of(
    st.none(),
    st.builds(lambda n: ("pin", n), st.integers(0, 30)),
    st.builds(lambda n: ("unpin", n), st.integers(0, 30)),
    st.just(("release", True)),
    st.builds(lambda s: ("retain_s", s), st.floats(0.5, 8.0)),
)


class HintMachine(RuleBasedStateMachine):
    """Requests of two tenants on shared bases, each with at most one hint,
    admitted, grown, cached, preempted and finished at random while the
    clock moves (so pins and retention expire)."""

    fallback = "lru"

    def __init__(self):
        super().__init__()
        self.rt = Runtime(config(24, self.fallback), hook_timing=False)
        self.policy = self.rt.plugins["eviction"][0].instance
        self.watch = PinWatch(self.policy)
        self.rt.pm.register(self.watch)
        self.running, self.waiting, self.serial, self.now = [], [], 0, 0.0

    @rule(
        base=st.integers(0, len(BASES) - 1),
        shared=st.integers(0, 40),
        tail=st.lists(st.integers(0, 50), max_size=12),
        outputs=st.one_of(st.none(), st.lists(st.integers(60, 90), min_size=1, max_size=9)),
        tenant=st.sampled_from(TENANTS),
        session=st.integers(0, 3),
        hint=hints,
        budget=st.integers(1, 64),
        wait=st.floats(0.0, 3.0),
    )
    def arrive_and_admit(self, base, shared, tail, outputs, tenant, session, hint, budget, wait):
        prompt = BASES[base][:shared] + tail or [7]
        self.serial += 1
        self.now += wait
        self.rt.set_time(self.now)
        kv_hints = None
        if hint is not None:
            name, value = hint
            if name in ("pin", "unpin"):
                value = min(value, len(prompt))
            kv_hints = KVHints(**{name: value})
        request = Request(
            request_id=f"r{self.serial}",
            prompt_token_ids=prompt,
            output_tokens=len(outputs) if outputs else 3,
            output_token_ids=outputs,
            arrival_s=self.now,
            tenant=tenant,
            session_id=f"{tenant}{session}",
            kv_hints=kv_hints,
        )
        self._admit(self.rt.arrive(request), budget)

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
        self._admit(self.waiting.pop(index % len(self.waiting)), budget)

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
    def preempt(self, index):
        state = self.running.pop(index % len(self.running))
        self.rt.preempt(state)
        self.waiting.append(state)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def finish(self, index):
        self.rt.finish(self.running.pop(index % len(self.running)))

    @invariant()
    def accounted_and_within_budget(self):
        self.rt.check_invariants()
        self.watch.check_budgets()


@pytest.mark.parametrize("fallback", ["lru", "s3fifo", "adaptive"])
def test_pins_hold_and_budgets_hold_in_replay(fallback):
    machine = type(f"HintMachine_{fallback}", (HintMachine,), {"fallback": fallback})
    case = machine.TestCase
    case.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
    case("runTest").runTest()


def _stream(seed: int, hinted: bool) -> list[Request]:
    import random

    rng = random.Random(seed)
    out = []
    for i in range(120):
        base = BASES[rng.randrange(3)]
        prompt = base[: rng.randrange(41)] + [rng.randrange(60) for _ in range(rng.randrange(10))] or [7]
        hint = None
        if hinted and rng.random() < 0.5:
            hint = rng.choice(
                [KVHints(pin=min(len(prompt), 16)), KVHints(release=True), KVHints(retain_s=3.0), KVHints(unpin=16)]
            )
            if hint.unpin > len(prompt):
                hint = None
        out.append(
            Request(
                f"q{i}", prompt, 3, arrival_s=float(i), tenant=TENANTS[i % 2], session_id=f"s{i % 7}", kv_hints=hint
            )
        )
    return out


def test_pins_make_a_difference_the_watch_can_see():
    """The property above is not vacuous: in a stream with pins, blocks are
    evicted, pins are taken, and the pinned prefixes stay while LRU on the
    same stream evicts them."""
    rt = Runtime(config(24), hook_timing=False)
    policy = rt.plugins["eviction"][0].instance
    watch = PinWatch(policy)
    rt.pm.register(watch)
    for request in _stream(3, hinted=True):
        rt.set_time(request.arrival_s)
        state = rt.arrive(request)
        if rt.admit(state, 10**6):
            state.num_computed_tokens = state.num_tokens
            rt.finish(state)
        else:
            rt.reject(state)
    assert watch.evicted > 50 and policy.pins_taken > 0
    rt.check_invariants()


@pytest.mark.parametrize("fallback", ["lru", "s3fifo", "adaptive"])
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(12, 40))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_without_hints_it_is_its_fallback_block_for_block(fallback, seed, num_blocks):
    """The same stream without hints under ``hints`` and under its fallback:
    the same victims at every choice, so the same hits and evictions."""
    runs = []
    for hinted in (True, False):
        rt = Runtime(config(num_blocks, fallback, hinted), hook_timing=False)
        victims = Victims()
        rt.pm.register(victims)
        for request in _stream(seed, hinted=False):
            rt.set_time(request.arrival_s)
            state = rt.arrive(request)
            if rt.admit(state, 10**6):
                state.num_computed_tokens = state.num_tokens
                rt.finish(state)
            else:
                rt.reject(state)
        runs.append((victims.seen, rt.counters.hit_blocks))
    assert runs[0] == runs[1] and runs[0][0]


@pytest.mark.parametrize("source", ["agentic", "tenant-mix"])
def test_without_hints_a_suite_workload_replays_as_its_fallback(source):
    text = f"""
[engine]
name = "replay"
mode = "cache-only"
[workload]
source = "{source}"
sessions_per_tenant = 4
[prefix_cache]
plugin = "radix"
block_size = 64
[kv_pool]
plugin = "paged"
num_blocks = 300
[eviction]
plugin = "{{policy}}"
"""
    reports = [session.run(settings_from_toml(text.format(policy=p))).report for p in ("hints", "lru")]
    for key in ("block_hit_rate", "evicted_blocks", "hit_blocks"):
        assert reports[0][key] == reports[1][key], key
    assert reports[0]["evicted_blocks"] > 0
