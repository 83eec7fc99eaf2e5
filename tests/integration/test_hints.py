"""Client KV hints through the real runtime and the ``hints`` eviction
policy: random request streams with random hints (pins, unpins, releases,
retention) never evict a pinned block, never take a tenant past its pin
budget, and keep the block accounting; without hints the policy is its
fallback, block for block."""

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sagellm_plugin_eviction.hints import HintSettings

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
        self.policy = self.rt.host.plugins["eviction"][0].instance
        self.watch = PinWatch(self.policy)
        self.rt.host.pm.register(self.watch)
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


@pytest.mark.parametrize("fallback", ["lru", "s3fifo", "adaptive", "revisit"])
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


def play(rt: Runtime, requests: list[Request]) -> None:
    """Each request at its arrival, admitted whole and finished (or rejected)."""
    for request in requests:
        rt.set_time(request.arrival_s)
        state = rt.arrive(request)
        if rt.admit(state, 10**6):
            state.num_computed_tokens = state.num_tokens
            rt.finish(state)
        else:
            rt.reject(state)


def test_pins_make_a_difference_the_watch_can_see():
    """The property above is not vacuous: in a stream with pins, blocks are
    evicted (each checked by the watch) while pins are taken."""
    rt = Runtime(config(24), hook_timing=False)
    policy = rt.host.plugins["eviction"][0].instance
    watch = PinWatch(policy)
    rt.host.pm.register(watch)
    play(rt, _stream(3, hinted=True))
    assert watch.evicted > 50 and policy.pins_taken > 0
    rt.check_invariants()


@pytest.mark.parametrize("fallback", ["lru", "s3fifo", "adaptive", "revisit"])
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(12, 40))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_without_hints_it_is_its_fallback_block_for_block(fallback, seed, num_blocks):
    """The same stream without hints under ``hints`` and under its fallback:
    the same victims at every choice, so the same hits and evictions."""
    runs = []
    for hinted in (True, False):
        rt = Runtime(config(num_blocks, fallback, hinted), hook_timing=False)
        victims = Victims()
        rt.host.pm.register(victims)
        play(rt, _stream(seed, hinted=False))
        runs.append((victims.seen, rt.counters.hit_blocks))
    assert runs[0] == runs[1] and runs[0][0]


SUITE_WORKLOAD = """
[engine]
name = "replay"
mode = "cache-only"
[workload]
source = "{source}"
sessions_per_tenant = {sessions}
{hints}
[prefix_cache]
plugin = "radix"
block_size = 64
[kv_pool]
plugin = "paged"
num_blocks = {num_blocks}
[eviction]
{eviction}
"""


def replay_report(source: str, sessions: int, num_blocks: int, eviction: str, hints: str = "") -> dict:
    text = SUITE_WORKLOAD.format(
        source=source, sessions=sessions, hints=hints, num_blocks=num_blocks, eviction=eviction
    )
    return session.run(settings_from_toml(text)).report


@pytest.mark.parametrize("source", ["agentic", "tenant-mix"])
def test_without_hints_a_suite_workload_replays_as_its_fallback(source):
    """``hints`` with its default fallback, and that fallback alone."""
    reports = [replay_report(source, 4, 300, f'plugin = "{p}"') for p in ("hints", HintSettings().fallback)]
    for key in ("block_hit_rate", "evicted_blocks", "hit_blocks"):
        assert reports[0][key] == reports[1][key], key
    assert reports[0]["evicted_blocks"] > 0


def hinted_report(source: str, spoiled: str, window: float, num_blocks: int = 150, fallback: str = "") -> tuple:
    eviction = f'plugin = "hints"\nrelease_window = {window}' + (f'\nfallback = "{fallback}"' if fallback else "")
    r = replay_report(source, 10, num_blocks, eviction, hints=f"hints = true\n{spoiled}")
    return r["block_hit_rate"], r["evicted_blocks"], r["hit_blocks"]


@pytest.mark.parametrize("fallback", ["lru", "revisit"])
@pytest.mark.parametrize("source", ["generator", "rag"])
def test_releases_that_prove_right_are_always_followed(source, fallback):
    """Truthful releases (and those left when some are missing) cost few
    hits: the generator's name blocks no later request uses, RAG's a
    document another question may use, mostly before following the release
    would have evicted it. So the release judge (``release_window``) never
    turns them off, on LRU or on ``revisit`` (whose victims come back as
    often): the policy chooses as with every release followed, block for
    block."""
    for spoiled in ("", "hints_missing = 0.3"):
        judged = hinted_report(source, spoiled, 1.0, fallback=fallback)
        assert judged == hinted_report(source, spoiled, 0.0, fallback=fallback), spoiled


def test_releases_that_prove_wrong_are_turned_off():
    """RAG with 30% of its hints wrong, at 600 blocks: released
    conversations come back for blocks following their release evicted, so
    the judge turns the releases off (the run differs from following them
    all) and stays above LRU."""
    judged = hinted_report("rag", "hints_wrong = 0.3", 1.0, 600)
    assert judged != hinted_report("rag", "hints_wrong = 0.3", 0.0, 600)
    assert judged[0] >= replay_report("rag", 10, 600, 'plugin = "lru"')["block_hit_rate"]


# ------------------------------------------------------------ torch engine --


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from sagellm_plugin_torch.testing import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-hints"))


def torch_engine(folder, model_dir, num_blocks: int):
    """The torch engine on the tiny model (CPU) with ``hints`` on LRU, on a
    clock the test moves; the pin watch registered beside the plugins."""
    from sagellm_plugin_torch import testing as helpers
    from sagellm_plugin_torch.engine import EngineCore, TorchSettings

    from sagellm_core import config as config_mod

    path = helpers.write_config(
        folder,
        model=str(model_dir),
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        eviction="hints",
    )
    path.write_text(path.read_text().replace('plugin = "hints"\n', 'plugin = "hints"\npin_ttl_s = 6.0\n'))
    loaded = config_mod.load(path)
    params = {k: v for k, v in loaded.engine.params.items() if k in helpers.attrs_fields()}
    clock = [0.0]
    core = EngineCore(Runtime(loaded), TorchSettings(**params), clock=lambda: clock[0])
    watch = PinWatch(core.rt.host.plugins["eviction"][0].instance)
    core.rt.host.pm.register(watch)
    return core, watch, clock


engine_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(0, len(BASES) - 1),
            st.integers(0, 40),
            st.lists(st.integers(2, 120), max_size=10),
            st.integers(1, 6),
            st.sampled_from(TENANTS),
            hints,
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("wait"), st.floats(0.5, 4.0)),
        st.tuples(st.just("abort"), st.integers(0, 40)),
    ),
    max_size=40,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(ops=engine_ops, num_blocks=st.integers(12, 30))
def test_pins_hold_and_budgets_hold_in_the_torch_engine(tmp_path, tiny_model_dir, ops, num_blocks):
    """Random requests with random hints, steps, waits (pins expire) and
    aborts through the torch engine: no pinned block is evicted, no tenant
    passes its pin budget, the accounting holds, and every request ends."""
    from sagellm_core.errors import RequestError

    core, watch, clock = torch_engine(tmp_path, tiny_model_dir, num_blocks)
    added, ended, refused = [], set(), set()
    for op in ops:
        if op[0] == "add":
            _, base, shared, tail, max_tokens, tenant, hint = op
            prompt = [t % 120 for t in BASES[base][:shared]] + tail or [7]
            kv_hints = None
            if hint is not None:
                name, value = hint
                kv_hints = KVHints(**{name: min(value, len(prompt)) if name in ("pin", "unpin") else value})
            rid = f"q{len(added)}"
            try:
                core.add_request(Request(rid, prompt, max_tokens, tenant=tenant, kv_hints=kv_hints))
            except RequestError:
                refused.add(rid)
            added.append(rid)
        elif op[0] == "step":
            ended.update(out.request_id for out in core.step() if out.finished)
        elif op[0] == "wait":
            clock[0] += op[1]
        elif added:
            out = core.abort(added[op[1] % len(added)])
            if out is not None:
                ended.add(out.request_id)
        core.rt.check_invariants()
        watch.check_budgets()
    while core.has_work():
        ended.update(out.request_id for out in core.step() if out.finished)
        core.rt.check_invariants()
    assert ended | refused == set(added) and not ended & refused


def test_pins_are_taken_and_blocks_evicted_around_them_in_the_torch_engine(tmp_path, tiny_model_dir):
    """The property above is not vacuous in the engine: a stream with pins
    evicts blocks (each checked by the watch) while pins are held."""
    core, watch, clock = torch_engine(tmp_path, tiny_model_dir, 16)
    for request in _stream(5, hinted=True)[:60]:
        clock[0] = request.arrival_s
        core.add_request(attrs.evolve(request, prompt_token_ids=[t % 120 for t in request.prompt_token_ids]))
        while core.has_work():
            core.step()
    assert watch.evicted > 20 and watch.policy.pins_taken > 0
    core.rt.check_invariants()
