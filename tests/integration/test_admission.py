"""The admission decision (``sagellm_admit_request``): the step scheduler
moves on past a deferred request, rejects what the decision rejects, never
stalls on a rule that defers forever, and with no admission plugin (or one
that never binds) packs exactly as before; the runtime's tenant ledger is
exact after every step."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from sagellm_core import hookimpl
from sagellm_core.drivers.engines import build_engine
from sagellm_core.errors import PluginError
from sagellm_core.kit.testing import declare_plugins, settings_from_toml
from sagellm_core.replay import session
from sagellm_core.replay.engine import TimedReplay
from sagellm_core.types import Admission, AdmissionDecision, Request

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = Path(__file__).parent / "admission_example.py"
GUIDE = ROOT / "docs" / "plugin-guide.md"

CONFIG = """
[engine]
name = "replay"
max_num_batched_tokens = {budget}
[prefix_cache]
plugin = "radix"
block_size = 4
[kv_pool]
plugin = "paged"
num_blocks = {blocks}
[eviction]
plugin = "lru"
[report]
hook_timing = false
"""
QUOTA_SECTION = '[admission]\nplugin = "tenant-cap"\nmax_blocks = {quota}\ntenants = ["a"]\n'


def engine(extra: str = "", budget: int = 512, blocks: int = 64) -> TimedReplay:
    settings = settings_from_toml(CONFIG.format(budget=budget, blocks=blocks) + extra)
    plugin, _ = build_engine(settings)
    return TimedReplay(session.build_runtime(settings, plugin), plugin.settings, plugin.cost)


PROMPTS = itertools.count()


def request(name: str, tenant: str, prompt: int = 40, output: int = 4) -> Request:
    start = next(PROMPTS) * 1000  # no two prompts share a prefix
    return Request(name, list(range(start, start + prompt)), output, tenant=tenant)


def drain(e: TimedReplay) -> list[tuple[str, str | None]]:
    ended = []
    while e.has_work():
        ended += [(o.request_id, o.finish_reason) for o in e.step() if o.finished]
        e.rt.check_invariants()  # the tenant ledger included
    return ended


@pytest.fixture(autouse=True, scope="module")
def rules(tmp_path_factory):
    """The example rule and the test rules below, declared as installed plugins."""
    folder = tmp_path_factory.mktemp("rules")
    rules = {
        "tenant-cap": "admission_example:TenantCap",
        "defer-all": "test_admission:DeferEverything",
        "garbage": "test_admission:Garbage",
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).parent))
        patch.syspath_prepend(str(folder))
        declare_plugins(folder, {"sagellm.admission": rules})
        yield


def test_the_plugin_guide_prints_the_example_rule_in_full_under_60_lines():
    source = re.search(r"## An admission rule.*?```python\n(.*?)```", GUIDE.read_text(), re.S).group(1)
    assert source == EXAMPLE.read_text() and len(source.splitlines()) < 60


def test_a_tenant_at_its_quota_waits_and_the_tenant_behind_it_is_admitted():
    e = engine(QUOTA_SECTION.format(quota=12))  # one 10-block request of tenant a at a time
    for i in range(3):
        e.add_request(request(f"a{i}", "a"))
    e.add_request(request("b0", "b"))
    e.step()
    assert [s.request_id for s in e.running] == ["a0", "b0"]  # b0 is not held behind a1, a2
    assert [s.request_id for s in e.waiting] == ["a1", "a2"]  # the deferred keep their order
    assert dict(e.rt.ledger.tenants.blocks) == {"a": 10, "b": 10} and e.rt.counters.admission_deferrals == 2
    ended = drain(e)
    assert sorted(ended) == [("a0", "length"), ("a1", "length"), ("a2", "length"), ("b0", "length")]
    assert ended.index(("b0", "length")) < ended.index(("a1", "length"))


def test_without_the_decision_a_full_pool_stops_admission_at_the_first_that_does_not_fit():
    e = engine(blocks=24)  # a0 takes 10 (and grows); a1 does not fit beside it; b0 would
    for name, tenant in (("a0", "a"), ("a1", "a"), ("b0", "b")):
        e.add_request(request(name, tenant, prompt=60 if name == "a1" else 40))
    e.step()
    assert [s.request_id for s in e.running] == ["a0"] and [s.request_id for s in e.waiting] == ["a1", "b0"]


def test_a_request_over_the_quota_alone_is_rejected_and_counted():
    e = engine(QUOTA_SECTION.format(quota=8))
    e.add_request(request("a0", "a", prompt=40))  # 10 blocks > 8
    e.add_request(request("b0", "b"))
    outputs = e.step()
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finished] == [("a0", "rejected")]
    c = e.rt.counters
    assert c.rejections == {"needs more blocks than its tenant's cap": 1} and c.admission_rejections == 1
    assert drain(e) == [("b0", "length")]


class DeferEverything:
    """An admission rule that never admits anything."""

    def __init__(self, settings, context):
        pass

    @hookimpl
    def sagellm_admit_request(self, state):
        return AdmissionDecision(Admission.DEFER)


class Garbage:
    def __init__(self, settings, context):
        pass

    @hookimpl
    def sagellm_admit_request(self, state):
        return "admit"


def test_a_rule_that_defers_forever_cannot_stall_the_engine():
    e = engine('[admission]\nplugin = "defer-all"\n')
    for i in range(3):
        e.add_request(request(f"r{i}", "a"))
    # Nothing runs: each step rejects the first deferred request.
    assert drain(e) == [("r0", "rejected"), ("r1", "rejected"), ("r2", "rejected")]
    assert e.rt.counters.rejections == {"deferred with nothing running": 3}


def test_an_admission_answer_that_is_not_a_decision_is_named_in_one_line():
    e = engine('[admission]\nplugin = "garbage"\n')
    e.add_request(request("r0", "a"))
    with pytest.raises(PluginError) as err:
        e.step()
    message = str(err.value)
    assert "admission plugin 'garbage'" in message and "sagellm_admit_request returned 'admit'" in message
    assert "\n" not in message and e.rt.in_flight == 0


WORKLOAD = """
[workload]
tenants = {tenants}
sessions_per_tenant = 3
turns = 2
system_prompt_tokens = {system}
user_tokens = 24
output_tokens = 12
session_rate = 40.0
think_time_s = 0.05
seed = {seed}
"""


def report_of(text: str) -> dict:
    report = session.run(settings_from_toml(text)).report
    for key in ("wall_s", "hooks", "plugins", "plugin_distributions", "admission", "transfers"):
        report.pop(key)
    return report


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 1000),
    tenants=st.integers(1, 3),
    system=st.integers(8, 120),
    blocks=st.integers(40, 160),
    budget=st.integers(32, 512),
)
def test_a_quota_that_never_binds_packs_exactly_as_no_admission_plugin(seed, tenants, system, blocks, budget):
    base = CONFIG.format(budget=budget, blocks=blocks) + WORKLOAD.format(tenants=tenants, system=system, seed=seed)
    never_binds = QUOTA_SECTION.format(quota=1 << 30).replace('tenants = ["a"]', "tenants = []")
    assert report_of(base + never_binds) == report_of(base)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 1000),
    quota=st.integers(1, 60),
    blocks=st.integers(40, 160),
    budget=st.integers(32, 512),
    sizes=st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 120), st.integers(1, 20)), min_size=1, max_size=14),
)
def test_every_request_ends_and_the_ledger_and_quota_hold_after_every_step(seed, quota, blocks, budget, sizes):
    e = engine(QUOTA_SECTION.format(quota=quota), budget=budget, blocks=blocks)
    for i, (tenant, prompt, output) in enumerate(sizes):
        e.add_request(request(f"{tenant}{i}-{seed}", tenant, prompt, output))
    ended, steps = {}, 0
    while e.has_work():
        before = {s.request_id for s in e.running}
        for out in e.step():
            if out.finished:
                ended[out.request_id] = out.finish_reason
        e.rt.check_invariants()
        admitted_a = [s for s in e.running if s.request_id not in before and s.request.tenant == "a"]
        if admitted_a:  # within the quota: what tenant a held before and what it was admitted with
            held = sum(len(s.block_ids) for s in e.running if s.request.tenant == "a")
            assert held <= quota
        steps += 1
        assert steps < 10_000
    assert len(ended) == len(sizes)
    assert set(ended.values()) <= {"length", "rejected"}
    c = e.rt.counters
    assert c.requests_finished + c.requests_rejected == len(sizes) and e.rt.in_flight == 0
    assert set(c.rejections) <= {"never fits the pool", "needs more blocks than its tenant's cap"}
