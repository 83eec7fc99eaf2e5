"""What engine drivers share (``sagellm_core.drivers``): the block observer
of an engine that keeps its own blocks, the request-at-a-time loop, and the
rule that no driver reaches into the runtime (a scan of the sources)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from sagellm_core import hookimpl, hookspecs
from sagellm_core.drivers.blocks import BlockObserver
from sagellm_core.drivers.recorder import Recorder
from sagellm_core.drivers.serial import serve_serially
from sagellm_core.errors import RequestError
from sagellm_core.kit.testing import declare_plugins, settings_from_toml
from sagellm_core.runtime import Runtime
from sagellm_core.types import CachedBlock, PoolUsage, PrefixMatch, Request, SequenceState

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
[kv_pool]
num_blocks = 64

[prefix_cache]
block_size = 4

[eviction]
plugin = "oldest"

[report]
hook_timing = false
"""


class Observations:
    """Every block observation, as (hook, block ids, now_s)."""

    def __init__(self):
        self.seen: list[tuple[str, tuple[int, ...], float]] = []

    def _add(self, hook, blocks, now_s):
        self.seen.append((hook, tuple(b.block_id for b in blocks), now_s))

    @hookimpl
    def sagellm_blocks_cached(self, blocks, now_s):
        self._add("cached", blocks, now_s)

    @hookimpl
    def sagellm_blocks_touched(self, blocks, now_s):
        self._add("touched", blocks, now_s)

    @hookimpl
    def sagellm_blocks_released(self, blocks, now_s):
        self._add("released", blocks, now_s)

    @hookimpl
    def sagellm_blocks_evicted(self, blocks, now_s):
        self._add("evicted", blocks, now_s)


@pytest.fixture
def rt(tmp_path):
    declare_plugins(tmp_path, {"sagellm.eviction": {"oldest": "sagellm_core.kit.testing:OldestFirstPreemption"}})
    runtime = Runtime(settings_from_toml(CONFIG), engine_owns=("prefix_cache", "kv_pool"))
    runtime.observations = Observations()
    runtime.host.pm.register(runtime.observations, name="test:observations")
    return runtime


def chain(*ids: int, parent: int | None = None, depth: int = 0) -> list[CachedBlock]:
    """Blocks ``ids`` chained one under the other (below ``parent``)."""
    out = []
    for i, block_id in enumerate(ids):
        out.append(CachedBlock(block_id, depth + i, parent, block_id * 1000, ""))
        parent = block_id
    return out


# ------------------------------------------------------------ block observer --


def test_the_observer_reports_what_the_engine_did(rt):
    observer = BlockObserver(rt)
    rt.set_time(3.0)
    root, child = observer.add(chain(1, 2)[0]), observer.add(chain(1, 2)[1])
    observer.report_cached([root, child])
    assert observer.children == {1: {2}} and observer.evictable == set()
    observer.release([2, 1, 99])  # 99 is not cached: not reported
    assert observer.evictable == {1, 2}
    observer.release([1])  # already evictable: not reported again
    observer.touch([2, 98])
    assert observer.evictable == {1}
    observer.report_cached([])  # nothing to report: nothing observed
    assert rt.observations.seen == [("cached", (1, 2), 3.0), ("released", (2, 1), 3.0), ("touched", (2,), 3.0)]


def test_evictions_are_forgotten_at_once_and_reported_and_counted_at_the_flush(rt):
    observer = BlockObserver(rt)
    for block in chain(1, 2, 3):
        observer.add(block)
    observer.release([1, 2, 3])
    assert observer.evict(2).block_id == 2 and observer.evict(42) is None
    assert 2 not in observer.cached and observer.evictable == {1, 3} and observer.children == {1: set()}
    assert rt.observations.seen[-1][0] == "released" and rt.counters.evicted_blocks == 0
    observer.evict(3)
    observer.flush_evicted()
    observer.flush_evicted()  # nothing more
    assert rt.observations.seen[-1] == ("evicted", (2, 3), 0.0) and rt.counters.evicted_blocks == 2


def test_a_victim_takes_its_evictable_descendants_along(rt):
    observer = BlockObserver(rt)
    #    1 - 2 - 3        7 (alone)
    #         \
    #          4 - 5
    for block in [*chain(1, 2, 3), *chain(4, 5, parent=2, depth=2), *chain(7)]:
        observer.add(block)
    observer.release([1, 2, 3, 4, 7])  # 5 is held by a request: it and what is under it stay
    chosen = observer.with_descendants([2, 3, 7, 1])
    assert chosen[0] == 2 and sorted(chosen[1:3]) == [3, 4] and chosen[3:] == [7, 1]
    # The whole subtree, held blocks too, each block before its descendants:
    subtree = observer.subtree(1)
    assert sorted(subtree) == [1, 2, 3, 4, 5] and subtree[:2] == [1, 2] and subtree.index(4) < subtree.index(5)
    # In the engine's own order of children (depth first: the last child first):
    order = {1: [2], 2: [4, 3], 4: [5]}
    assert observer.subtree(1, lambda b: order.get(b, [])) == [1, 2, 3, 4, 5]


def test_the_policy_picks_among_the_evictable_blocks_by_default(rt):
    observer = BlockObserver(rt)
    for block in chain(1, 2, 3):
        observer.add(block)
    observer.release([2, 3])  # this policy takes a released chain's leaf first
    assert observer.select_victims(1) == (3,)
    assert observer.select_victims(2, candidates={2}) == (2,)


# ---------------------------------------------------------- serial driver --


def requests(n: int, prompt: int = 8) -> list[Request]:
    return [Request(f"r{i}", list(range(prompt)), 2, arrival_s=float(i)) for i in range(n)]


def test_requests_are_served_one_at_a_time_in_arrival_order(rt):
    served, done = [], []

    def serve(state: SequenceState):
        served.append((state.request_id, rt.now_s))
        if state.request_id == "r1":
            return None  # never fits
        state.num_output_tokens = 2
        rt.count_admission(state, 1)
        return PoolUsage(64, 60)

    recorder = serve_serially(rt, requests(3), serve, Recorder(), lambda: done.append(rt.now_s))
    assert served == [("r0", 0.0), ("r1", 1.0), ("r2", 2.0)] and done == [0.0, 1.0, 2.0]
    c = rt.counters
    assert (c.requests_finished, c.requests_rejected, c.rejections) == (2, 1, {"never fits the pool": 1})
    assert (c.query_blocks, c.hit_blocks) == (4, 2)
    assert recorder.finished == 2 and recorder.output_tokens == 4 and recorder.simulated_s == 2.0
    assert recorder.used_block_samples == 2 and recorder.used_block_peak == 4


def test_the_engine_may_make_the_state_and_end_the_request_itself(rt):
    arrived, ended = [], []

    def arrive(request):
        arrived.append(request.request_id)
        return SequenceState(request)

    def finish(state):
        ended.append(state.request_id)
        return None  # the engine recorded it

    recorder = serve_serially(rt, requests(2), lambda s: PoolUsage(64, 64), Recorder(), arrive=arrive, finish=finish)
    assert arrived == ended == ["r0", "r1"]
    assert recorder.finished == 0 and rt.counters.requests_finished == 0 and recorder.simulated_s == 1.0


class ArrivalsSeen:
    def __init__(self):
        self.matches = []

    @hookimpl
    def sagellm_request_arrived(self, request, match):
        self.matches.append((request.request_id, match.block_ids))


def test_an_engine_that_matched_itself_may_give_only_the_length(rt):
    """An engine's own match enters as its blocks, or as only their number
    while no plugin observes arrivals (collecting the blocks costs more than
    the engine's own admission): the hint is the same either way."""
    assert not rt.observes_arrivals
    state = rt.arrive(Request("r0", list(range(12)), 1), match=2)
    assert state.cached_tokens_hint == 2 * rt.block_size
    seen = ArrivalsSeen()
    rt.host.pm.register(seen, name="test:arrivals")
    assert rt.observes_arrivals
    with pytest.raises(RequestError, match="'r1': arrival observers need the matched blocks"):
        rt.arrive(Request("r1", list(range(12)), 1), match=2)
    blocks = tuple(chain(5, 6))
    state = rt.arrive(Request("r2", list(range(12)), 1), match=PrefixMatch(blocks))
    assert state.cached_tokens_hint == 2 * rt.block_size and seen.matches == [("r2", (5, 6))]


def test_an_observation_no_plugin_takes_is_not_called_or_timed(tmp_path):
    declare_plugins(tmp_path, {"sagellm.eviction": {"oldest": "sagellm_core.kit.testing:OldestFirstPreemption"}})
    runtime = Runtime(
        settings_from_toml(CONFIG.replace("hook_timing = false", "hook_timing = true")),
        engine_owns=("prefix_cache", "kv_pool"),
    )
    runtime.arrive(Request("r0", list(range(12)), 1), match=PrefixMatch())
    assert runtime.timer.stats["sagellm_request_arrived"].calls == 0
    runtime.host.pm.register(ArrivalsSeen(), name="test:arrivals")  # seen from the next call on
    runtime.arrive(Request("r1", list(range(12)), 1), match=PrefixMatch())
    assert runtime.timer.stats["sagellm_request_arrived"].calls == 1


# ------------------------------------------- no driver reaches into the runtime --

#: The only modules that may write counters, call the private hook calls or
#: set the clock's field: the runtime, its checked hook calls and its
#: compaction round; and a KV store's eviction policy, which its own plugin
#: manager (one policy, no runtime) tells of the store's blocks.
OWNERS = {
    *(ROOT / "sagellm_core" / name for name in ("runtime.py", "plugin_host.py", "stores.py", "compaction.py")),
    ROOT / "sagellm_core" / "kit" / "store_eviction.py",
}
#: The runtime's hooks (the CLI's own plugin manager calls sagellm_register_commands).
RUNTIME_HOOKS = {name for name in dir(hookspecs) if name.startswith("sagellm_") and name != "sagellm_register_commands"}


def _root_attr(node: ast.AST) -> list[str]:
    """The attribute names of an access chain, outermost last
    (``a.counters.hits[k]`` -> ``["counters", "hits"]``, root ``a``)."""
    names = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        node = node.value
    names.reverse()
    return names


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def reaches_into_the_runtime(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` writes runtime counters (directly or through a name
    bound to ``….counters``), assigns ``.now_s``, calls ``_observe`` /
    ``_call``, names an observation by string (``observe("sagellm_…")``) or
    calls a runtime hook directly (``….hook.sagellm_…``)."""
    tree = ast.parse(source, filename)
    aliases = set()  # names bound to something's counters (c = rt.counters)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and node.value.attr == "counters":
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))

    def writes_counters(target: ast.AST) -> bool:
        names = _root_attr(target)
        if "counters" in names[:-1] or ("counters" in names and isinstance(target, ast.Subscript)):
            return True  # x.counters.hits = / x.counters.rejections[k] =
        return bool(names) and _root_name(target) in aliases  # c.hits =

    found = []
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if writes_counters(t):
                    found.append(f"{where}: writes runtime counters ({ast.unparse(t)})")
                elif isinstance(t, ast.Attribute) and t.attr == "now_s":
                    found.append(f"{where}: assigns {ast.unparse(t)} (use set_time)")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if func.attr in ("_observe", "_call"):
                found.append(f"{where}: calls the runtime's private {func.attr}")
            elif (
                func.attr == "observe"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("sagellm_")
            ):
                found.append(f"{where}: observes {node.args[0].value!r} by name")
            elif func.attr in RUNTIME_HOOKS and isinstance(func.value, ast.Attribute) and func.value.attr == "hook":
                found.append(f"{where}: calls the hook {func.attr} directly")
            elif "counters" in _root_attr(func.value) or _root_name(func.value) in aliases:
                if func.attr in ("setdefault", "update", "pop", "clear", "append", "extend", "__setitem__"):
                    found.append(f"{where}: writes runtime counters ({ast.unparse(func)})")
    return found


def driver_sources() -> list[Path]:
    files = [
        *ROOT.glob("plugins/*/sagellm_plugin_*/**/*.py"),
        *ROOT.glob("contrib/**/*.py"),
        *ROOT.glob("sagellm_core/**/*.py"),
    ]
    return sorted(f for f in files if f not in OWNERS and "/build/" not in f.as_posix())


def test_no_driver_reaches_into_the_runtime():
    files = driver_sources()
    assert any("sagellm_plugin_vllm" in f.as_posix() for f in files) and len(files) > 50
    found = [hit for f in files for hit in reaches_into_the_runtime(f.read_text(), str(f.relative_to(ROOT)))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "rt.counters.evicted_blocks += 3",
        "self.runtime.counters.host_hit_blocks = 1",
        "rt.counters.rejections['x'] = 1",
        "rt.counters.rejections.setdefault('x', 0)",
        "c = rt.counters\nc.hit_blocks += 1",
        "rt.now_s = 4.0",
        "rt.sagellm.now_s, y = 4.0, 1",
        "rt._observe('sagellm_blocks_evicted', blocks=())",
        "rt._call('eviction', 'sagellm_select_victims')",
        "rt.observe('sagellm_request_arrived', request=r)",
        "rt.hook.sagellm_blocks_evicted(blocks=(), now_s=0.0)",
    ],
)
def test_the_scan_finds_a_planted_violation(line):
    source = "def drive(rt):\n    x = 1\n" + "".join(f"    {piece}\n" for piece in line.split("\n"))
    assert len(reaches_into_the_runtime(source)) == 1


def test_the_scan_lets_the_driver_api_through():
    source = """
def drive(rt, state, blocks, pm, sub):
    c = rt.counters
    rate = c.hit_blocks / c.query_blocks
    rt.set_time(rt.now_s + 1)
    rt.count_admission(state, 2, host_blocks=1)
    rt.blocks_evicted(blocks)
    histogram.observe(0.5)
    pm.hook.sagellm_register_commands(subparsers=sub)
    state.first_token_s = rt.now_s
"""
    assert reaches_into_the_runtime(source) == []


GUIDE = ROOT / "docs" / "plugin-guide.md"


def test_the_runtime_s_public_names_are_the_plugin_guide_s_table(rt):
    """The drivers' facade is exactly what docs/plugin-guide.md lists: a
    name added to Runtime without the table (or the reverse) fails here."""
    text = GUIDE.read_text()
    table = text[text.index("| the engine | calls |") :]
    table = table[: table.index("\n\n")]
    listed = set(re.findall(r"`(?:state = )?rt\.(\w+)", table))
    public = {name for name in [*dir(type(rt)), *vars(rt)] if not name.startswith("_")} - {"observations"}
    assert listed == public, f"not in the table: {sorted(public - listed)}; not in Runtime: {sorted(listed - public)}"
