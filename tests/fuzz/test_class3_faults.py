"""Classes 2 and 3: a plugin that raises, exits, hangs, answers the wrong type
or bad contents, or edits what it was given, in any hook, is named with the
hook in one line and exit status 2 (the run never ends with 0 and no
report); in-process, the runtime's block accounting holds after each such
error, for the faults that do not edit state (a pass that does is named)."""

from __future__ import annotations

import pytest
from faults import FAULTY
from harness import judge, run_cli

from sagellm_core.drivers.engines import build_engine
from sagellm_core.errors import PluginError, RequestError
from sagellm_core.kit.testing import settings_from_toml
from sagellm_core.replay import session, workloads

#: A timed replay small enough to take a fraction of a second and tight
#: enough that every hook is called: evictions, preemptions, the host store,
#: compaction. The admission quota never defers (it is asked, and answers
#: victims while tenant-0 has cached blocks within its guarantee).
CONFIG = """
[engine]
name = "replay"
mode = "timed"
max_num_batched_tokens = 256
[workload]
tenants = 2
sessions_per_tenant = 3
turns = 3
system_prompt_tokens = 64
user_tokens = 32
output_tokens = 5
session_rate = 50.0
think_time_s = 0.01
[prefix_cache]
plugin = "{prefix_cache}"
block_size = 8
pin_after_hits = 2
[kv_pool]
plugin = "{kv_pool}"
num_blocks = 48
compact = true
max_fragmentation = 0.0
min_steps_between = 1
[eviction]
plugin = "{eviction}"
[lifetime]
plugin = "{lifetime}"
[scheduler]
passes = ["{scheduler}"]
[admission]
plugin = "{admission}"
guarantees = {{"tenant-0" = 0.5}}
[kv_stores]
tiers = ["{kv_stores}"]
prefetch = true
[kv_stores.{kv_stores}]
capacity_blocks = 64
[limits]
hook_time_limit_s = 0.3
"""
FIRST_PARTY = {
    "prefix_cache": "radix",
    "kv_pool": "runs",
    "eviction": "lru",
    "lifetime": "stat",
    "scheduler": "fcfs",
    "admission": "quota",
    "kv_stores": "host",
}
#: Faults whose answer the runtime does not read (the pool's free, a
#: pass's return, observations): those runs must be correct instead.
IGNORED = {"sagellm_free_blocks", "sagellm_schedule_pass"}
OBSERVATIONS = {
    "sagellm_blocks_cached",
    "sagellm_blocks_touched",
    "sagellm_blocks_released",
    "sagellm_blocks_evicted",
    "sagellm_blocks_moved",
    "sagellm_request_arrived",
    "sagellm_request_finished",
}


def config(section: str, hook: str, fault: str, after: int = 0) -> str:
    names = dict(FIRST_PARTY, **{section: FAULTY[section][0]})
    text = CONFIG.format(**names)
    header = "[scheduler]" if section != "scheduler" else "[scheduler.faulty-fcfs]"
    params = f'hook = "{hook}"\nfault = "{fault}"\nafter = {after}\n'
    if section == "scheduler":
        return text + f"{header}\n{params}"
    if section == "kv_stores":
        table = f"[kv_stores.{names[section]}]\n"
        return text.replace(table, table + params, 1)
    return text.replace(f'plugin = "{names[section]}"\n', f'plugin = "{names[section]}"\n{params}', 1)


def cases():
    for section, (_, _, hooks) in FAULTY.items():
        for hook in hooks:
            for fault in ("raise", "exit", "hang", "type", "contents", "mutate"):
                if fault == "mutate" and hook not in ("sagellm_schedule_pass", "sagellm_select_preemption"):
                    continue
                if fault in ("type", "contents") and hook in OBSERVATIONS:
                    continue
                yield pytest.param(section, hook, fault, id=f"{hook.removeprefix('sagellm_')}-{fault}")


def expect_error(hook: str, fault: str) -> bool:
    if fault in ("raise", "exit", "hang"):
        return True
    if fault == "mutate":
        return hook == "sagellm_schedule_pass"  # the preemption choice reads a copy: nothing to corrupt
    return hook not in IGNORED or (hook == "sagellm_schedule_pass" and fault == "contents")


def test_class3_every_hook_is_called_by_the_fault_config(fault_plugins):
    """The faults below mean something only if the run calls every hook."""
    from sagellm_core.timing import HOOK_NAMES

    result = session.run(settings_from_toml(config("eviction", "", "raise")))
    called = {name for name, stats in result.report["hooks"].items() if stats["calls"]}
    wanted = {h for section, (_, _, hooks) in FAULTY.items() if section != "kv_stores" for h in hooks}
    assert wanted <= called, sorted(wanted - called)
    assert wanted <= set(HOOK_NAMES)
    assert result.report["preemptions"] and result.report["evicted_blocks"]
    host = result.report["kv_stores"]["host"]
    assert host["get_rounds"] and host["prefetch_rounds"]  # (a get follows contains; put each eviction)


@pytest.mark.parametrize("section, hook, fault", list(cases()))
def test_class3_a_faulty_hook_is_named_in_one_line(fault_plugins, tmp_path, section, hook, fault):
    path = tmp_path / "faulty.toml"
    path.write_text(config(section, hook, fault))
    outcome = run_cli(["replay", "--config", str(path), "--quiet", "--json", "{tmp}/report.json"])
    plugin = FAULTY[section][0]
    assert "failed to start" not in outcome.stderr, outcome  # the fault, not a plugin that cannot start
    if expect_error(hook, fault):
        judge("3: faulty plugins", outcome, culprits=[repr(plugin), hook], may_run=False)
    else:
        judge("3: faulty plugins", outcome)


@pytest.mark.parametrize(
    "section, hook, fault",
    [
        c.values
        for c in cases()
        if c.values[2] in ("raise", "type", "contents")
        and expect_error(*c.values[1:])
        and c.values[1] != "sagellm_report_figures"  # asked by the report, after the run
    ],
)
def test_class3_the_runtime_keeps_its_accounting_after_a_plugin_error(fault_plugins, section, hook, fault):
    """In-process, after the fault has fired a few calls in: the error
    names the plugin and hook, and the blocks are all accounted for (the
    runtime's records rolled back)."""
    settings = settings_from_toml(config(section, hook, fault, after=0 if hook in FEW_CALLS else 3))
    engine, _ = build_engine(settings)
    rt = session.build_runtime(settings, engine)
    with pytest.raises(PluginError) as err:
        engine.run(rt, workloads.load(settings.workload))
    assert "\n" not in str(err.value) and FAULTY[section][0] in str(err.value) and hook in str(err.value)
    if hook in PLUGIN_STATE_UNKNOWN.get(fault, ()) or hook in CHECK_ASKS:
        runtime_consistent(rt)  # the plugin's own state may be half-changed; the runtime's is whole
    else:
        rt.check_invariants()  # and agrees with the plugins'


#: Faults after which the plugin's own state is not what its answer says
#: (it changed its state, then answered garbage or raised), so only the
#: runtime's records can be checked.
PLUGIN_STATE_UNKNOWN = {
    "raise": {"sagellm_free_blocks", "sagellm_release_prefix", "sagellm_remove_blocks", "sagellm_insert_prefix"},
    "type": {
        *("sagellm_allocate_blocks", "sagellm_remove_blocks", "sagellm_insert_prefix", "sagellm_release_prefix"),
        "sagellm_move_blocks",
    },
    "contents": {
        *("sagellm_allocate_blocks", "sagellm_remove_blocks", "sagellm_insert_prefix", "sagellm_release_prefix"),
        "sagellm_move_blocks",
    },
}


#: Hooks the fault config calls fewer than four times (compaction rounds, preemptions).
FEW_CALLS = {"sagellm_move_blocks", "sagellm_blocks_moved", "sagellm_select_preemption"}

#: Hooks the whole check asks itself (it would meet the fault again).
CHECK_ASKS = {"sagellm_pool_usage", "sagellm_evictable_blocks", "sagellm_pinned_blocks"}


def runtime_consistent(rt) -> None:
    """The runtime's own records agree with each other: every block it took
    from the pool is a request's or the cache's, and the holders of cached
    blocks are counted right."""
    from collections import Counter

    private, holders = set(), Counter()
    for state in rt.ledger.active.values():
        assert not private & state.private_block_ids
        private |= state.private_block_ids
        holders.update(b for b in state.block_ids if b not in state.private_block_ids)
        assert set(state.block_ids) <= rt.ledger.in_use
    assert not private & rt.ledger.cached
    assert private | rt.ledger.cached == rt.ledger.in_use
    assert dict(holders) == {b: n for b in rt.ledger.taken if (n := rt.ledger.holders(b))}


def test_class3_a_plugin_that_exits_while_starting_is_named(fault_plugins, tmp_path):
    path = tmp_path / "exit.toml"
    path.write_text(CONFIG.format(**dict(FIRST_PARTY, lifetime="exit-at-start")))
    outcome = run_cli(["replay", "--config", str(path), "--quiet"])
    judge("2: exits and lost requests", outcome, culprits=["'exit-at-start'", "SystemExit"], may_run=False)


@pytest.mark.parametrize("hook", ["sagellm_predict_lifetime", "sagellm_request_arrived", "sagellm_request_finished"])
@pytest.mark.parametrize("fault", ["raise", "exit"])
def test_class7_a_predictor_with_a_fallback_fails_in_any_hook_without_stopping_the_run(
    fault_plugins, tmp_path, hook, fault
):
    text = config("lifetime", hook, fault).replace(
        'plugin = "faulty-stat"\n', 'plugin = "faulty-stat"\nfallback = "stat"\n'
    )
    path = tmp_path / "fallback.toml"
    path.write_text(text)
    outcome = run_cli(["replay", "--config", str(path), "--quiet", "--json", "{tmp}/report.json"])
    judge("7: smaller", outcome, may_run=True)
    assert outcome.status == 0
    report = __import__("json").loads(outcome.report_text)
    assert report["lifetime_fallbacks"] > 0 and "'faulty-stat'" in report["lifetime_failure"]
    assert hook in report["lifetime_failure"] or hook == "sagellm_predict_lifetime"


def test_class7_a_predictor_that_cannot_start_leaves_its_fallback_to_answer(fault_plugins):
    text = CONFIG.format(**dict(FIRST_PARTY, lifetime="exit-at-start")).replace(
        'plugin = "exit-at-start"\n', 'plugin = "exit-at-start"\nfallback = "stat"\n'
    )
    result = session.run(settings_from_toml(text))
    report = result.report
    assert report["requests"] + report["rejected"] == report["requests_read"] == 18
    assert report["lifetime_fallbacks"] == 18 and "failed to start" in report["lifetime_failure"]
    assert report["lifetime_mae"] is not None  # the fallback's predictions were scored


def test_class7_a_duplicate_request_id_is_the_workload_s_fault(fault_plugins):
    settings = settings_from_toml(config("eviction", "", "raise"))
    engine, _ = build_engine(settings)
    rt = session.build_runtime(settings, engine)
    first = next(iter(workloads.load(settings.workload)))
    a, b = rt.arrive(first), rt.arrive(first)
    assert rt.admit(a, 64)
    with pytest.raises(RequestError, match=r"request id '.*' arrived while another request with that id is in flight"):
        rt.admit(b, 64)
    rt.check_invariants()


def test_class3_a_prefix_cache_that_removes_a_locked_block_is_named(fault_plugins, tmp_path):
    path = tmp_path / "lying.toml"
    path.write_text(CONFIG.format(**dict(FIRST_PARTY, prefix_cache="lying-radix")))
    outcome = run_cli(["replay", "--config", str(path), "--quiet"])
    judge(
        "3: faulty plugins",
        outcome,
        culprits=["'lying-radix'", "sagellm_remove_blocks", "removed blocks that requests hold"],
        may_run=False,
    )
