"""Classes 3 and 4: a long randomized run of the runtime's public API with
radix pinning on (``pin_after_hits``), a host tier, and two policies: LRU
and the plugin template's random policy (which follows the documented
protocol to the letter, so a pinned block it names is the runtime's bug);
and LRU over the compacting ``runs`` pool with the ``quota`` admission rule
asked before each admission. After every operation the block accounting is
checked whole.

Seeded and time-boxed: ``SAGELLM_FUZZ_API_SECONDS`` per policy (3 by
default, 600 nightly); the seed is printed on failure."""

from __future__ import annotations

import os
import random
import time

import pytest
from conftest import API_SECONDS
from harness import TALLY

from sagellm_core.errors import RequestError
from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.registry import find
from sagellm_core.runtime import Runtime
from sagellm_core.types import Admission, Request

CONFIG = """
[prefix_cache]
plugin = "radix"
block_size = 4
pin_after_hits = 2
max_pinned_share = 0.25
[kv_pool]
{pool}
num_blocks = 32
[eviction]
plugin = "{policy}"
[lifetime]
plugin = "stat"
[kv_stores]
tiers = ["host"]
bytes_per_block = 16
[kv_stores.host]
capacity_blocks = 12
{admission}"""
POOLS = {
    "paged": ('plugin = "paged"', ""),
    "buddy": ('plugin = "buddy"', ""),
    "gathering": (
        'plugin = "runs"\ncompact = true\nmoves = "gather"\nmax_fragmentation = 0.0\nmin_steps_between = 1',
        "",
    ),
    "pieces": (
        'plugin = "runs"\ncompact = true\nmoves = "pieces"\nmax_fragmentation = 0.0\nmin_steps_between = 1\ngrow_room = 2',
        "",
    ),
    "compacting": (
        'plugin = "runs"\ncompact = true\nmax_fragmentation = 0.0\nmin_steps_between = 1',
        '[admission]\nplugin = "quota"\nguarantees = {"0" = 0.3, "1" = 0.3}\ncaps = {"2" = 0.25}\nlend = 0.5\n',
    ),
}
BASES = [list(range(b * 1000, b * 1000 + 48)) for b in range(4)]


class Driver:
    """Drives the runtime as an engine would, choosing each step at random."""

    def __init__(self, rt: Runtime, rng: random.Random):
        self.rt, self.rng = rt, rng
        self.waiting, self.running = [], []
        self.serial = 0
        self.operations = 0
        self.rejected = 0

    def new_request(self) -> Request:
        self.serial += 1
        rng = self.rng
        prompt = BASES[rng.randrange(len(BASES))][: rng.randrange(0, 48)] + [
            rng.randrange(50) for _ in range(rng.randrange(1, 9))
        ]
        outputs = [rng.randrange(60, 90) for _ in range(rng.randrange(1, 8))]
        tenant = str(rng.randrange(3))
        return Request(
            f"r{self.serial}",
            prompt,
            len(outputs),
            arrival_s=float(self.serial),
            output_token_ids=outputs,
            tenant=tenant,
        )

    def admit(self, state) -> None:
        if self.rt.decides_admission:
            verdict = self.rt.decide_admission(state).verdict
            if verdict is Admission.REJECT:
                self.rt.reject(state, "rejected at admission")
                self.rejected += 1
                return
            if verdict is Admission.DEFER:
                self.waiting.append(state)
                return
        n = self.rt.admit(state, self.rng.randrange(1, 64))
        if n:
            state.num_computed_tokens += n
            if state.num_computed_tokens >= state.request.num_prompt_tokens:
                self.rt.cache(state)
            self.running.append(state)
        else:
            self.waiting.append(state)

    def step(self) -> None:
        rt, rng = self.rt, self.rng
        actions = ["arrive", "readmit", "advance", "preempt", "reset", "duplicate", "compact"]
        action = rng.choices(actions, [5, 3, 8, 1, 0.2, 0.3, 2])[0]
        if action == "arrive":
            self.admit(rt.arrive(self.new_request()))
        elif action == "readmit" and self.waiting:
            state = self.waiting.pop(rng.randrange(len(self.waiting)))
            if len(self.waiting) > 20:  # one that may never fit: rejected, counted
                rt.reject(state, "the random driver gave up")
                self.rejected += 1
            else:
                self.admit(state)
        elif action == "advance" and self.running:
            state = self.running[rng.randrange(len(self.running))]
            n = min(state.num_tokens - state.num_computed_tokens, rng.randrange(1, 16)) or 1
            if not rt.grow(state, n):
                self.running.remove(state)
                rt.preempt(state)
                self.waiting.append(state)
                return
            state.num_computed_tokens += n
            if state.num_computed_tokens >= state.num_tokens:
                state.num_output_tokens += 1
                if state.num_output_tokens >= state.request.output_tokens:
                    self.running.remove(state)
                    rt.finish(state)
                elif rng.random() < 0.3:
                    rt.cache(state)
        elif action == "preempt" and self.running:
            state = self.running.pop(rng.randrange(len(self.running)))
            rt.preempt(state)
            self.waiting.append(state)
        elif action == "reset":
            rt.reset_prefix_cache()
        elif action == "compact":
            rt.compact()
        elif action == "duplicate" and self.running:
            twin = rt.arrive(self.running[0].request)
            with pytest.raises(RequestError, match="is in flight"):
                rt.admit(twin, 64)
        self.operations += 1


@pytest.mark.parametrize(
    "policy, pool",
    [("lru", "paged"), ("random", "paged"), ("lru", "compacting"), ("lru", "buddy"), ("lru", "gathering")],
)
def test_class4_a_long_random_run_of_the_public_api_with_pinning_finds_nothing(policy, pool):
    if find("sagellm.eviction", policy, "-") is None:
        pytest.skip(f"eviction plugin {policy!r} is not installed")
    seed = int(os.environ.get("SAGELLM_FUZZ_SEED", "0")) or random.randrange(1 << 30)
    rng = random.Random(seed)
    kv_pool, admission = POOLS[pool]
    rt = Runtime(settings_from_toml(CONFIG.format(policy=policy, pool=kv_pool, admission=admission)), hook_timing=False)
    driver = Driver(rt, rng)
    deadline = time.monotonic() + API_SECONDS
    try:
        while time.monotonic() < deadline:
            for _ in range(50):
                driver.step()
                rt.check_invariants()
        while driver.running or driver.waiting:  # drain: everything ends finished or rejected
            for state in driver.running:
                rt.preempt(state)
            driver.waiting += driver.running
            driver.running = []
            for state in driver.waiting:
                rt.reject(state, "drained")
            driver.rejected += len(driver.waiting)
            driver.waiting = []
        rt.check_invariants()
    except BaseException:
        print(f"SAGELLM_FUZZ_SEED={seed} reproduces this run")
        raise
    c = rt.counters
    assert rt.in_flight == 0 and rt.ledger.in_use == rt.ledger.cached
    assert c.requests_finished + c.requests_rejected == driver.serial  # every request ended one way or the other
    assert driver.operations > 100 and c.requests_finished > 10 and c.evicted_blocks > 0
    assert (c.moved_blocks > 0) == (pool in ("compacting", "gathering"))
    tally = TALLY["4: random API run (operations)"]
    tally["cases"] += driver.operations
    tally["correct runs"] += driver.operations
