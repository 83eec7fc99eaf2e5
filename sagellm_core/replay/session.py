"""One replay run, from settings to report: what ``sagellm replay`` and
``sagellm compare`` do for each config, and what tests call directly."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Protocol

import attrs
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sagellm_core import config as config_mod
from sagellm_core import registry
from sagellm_core.config import Settings
from sagellm_core.drivers.engines import EnginePlugin, build_engine, engine_sections, sized_pool
from sagellm_core.drivers.recorder import Recorder
from sagellm_core.errors import ConfigError, PluginError, PluginStartError
from sagellm_core.replay import workloads
from sagellm_core.replay.report import build
from sagellm_core.runtime import Runtime
from sagellm_core.types import Request


def default_config_path() -> Path:
    return Path(str(resources.files("sagellm_core") / "default.toml"))


def load_settings(path: str | Path | None, trace: str | None = None, overrides: dict | None = None) -> Settings:
    settings = config_mod.load(path or default_config_path(), overrides)
    if trace is not None:
        source = "azure" if trace.endswith(".csv") else "mooncake"
        settings = config_mod.with_workload(settings, source=source, path=trace)
    return settings


def check_same_workload(all_settings: list[Settings]) -> None:
    """``compare`` puts runs side by side: they must replay one workload."""

    def key(s: Settings):
        w = s.workload
        return attrs.evolve(w, path=os.path.realpath(w.path) if w.path else None)

    first = all_settings[0]
    for other in all_settings[1:]:
        if key(other) != key(first):
            raise ConfigError(
                f"{other.path}: [workload] differs from {first.path}'s; compare replays one workload"
                " (align the [workload] sections, or pass --trace)"
            )


@attrs.frozen
class RunResult:
    report: dict
    recorder: Recorder
    #: The runtime with its plugins' state (a whole cache): for tests and
    #: tools that inspect it; dropped by commands that run many configs.
    runtime: Runtime | None

    def without_runtime(self) -> RunResult:
        return attrs.evolve(self, runtime=None)


def build_runtime(settings: Settings, engine: EnginePlugin, hook_timing: bool | None = None) -> Runtime:
    """The runtime that replays ``settings``'s workload on ``engine``. An
    adapter around a real engine serves some sections with the engine's own
    machinery (``owns``, e.g. vLLM's prefix cache and block pool), some only
    where the config names no plugin (``owns_unless_configured``)."""
    settings = sized_pool(settings, engine)
    owns = engine_sections(settings, engine.owns, engine.owns_unless_configured)
    return Runtime(
        settings, hook_timing=hook_timing, engine_owns=owns, future_requests=lambda: workloads.load(settings.workload)
    )


class _Counted:
    """The workload's requests, counted as the engine reads them."""

    def __init__(self, requests: Iterator[Request]):
        self._requests = requests
        self.read = 0

    def __iter__(self) -> Iterator[Request]:
        for request in self._requests:
            self.read += 1
            yield request


def _account(rt: Runtime, recorder: Recorder, read: int, engine: str) -> None:
    """Every request read ends finished or rejected (counted, with a
    reason), and a run leaves its block accounting whole: a plugin that
    changed state it does not own (a pass editing a SequenceState) is
    caught here at the latest, not left to exit 0."""
    c = rt.counters if recorder.counters is None else recorder.counters
    if c.requests_finished + c.requests_rejected != read:
        raise PluginError(
            f"engine {engine!r} read {read} requests but finished {c.requests_finished}"
            f" and rejected {c.requests_rejected}; every request must end one way or the other"
        )
    if "kv_pool" in rt.engine_owns or "prefix_cache" in rt.engine_owns:
        return
    try:
        assert not rt.in_flight, f"{rt.in_flight} requests still hold blocks"
        rt.check_invariants()
    except AssertionError as exc:
        plugins = " / ".join(str(p) for loaded in rt.host.plugins.values() for p in loaded)
        raise PluginError(f"the run ended with its block accounting broken ({exc}); plugins: {plugins}") from None


def run(settings: Settings, *, label: str | None = None, progress: bool = False) -> RunResult:
    engine, engine_settings = build_engine(settings)
    rt = build_runtime(settings, engine)
    counted = _Counted(workloads.load(settings.workload))
    requests = iter(counted)
    label = label or Path(settings.path).stem
    start = time.perf_counter()
    if progress:
        columns = (TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, transient=True) as bar:
            task = bar.add_task(label, total=workloads.count(settings.workload))
            recorder = engine.run(rt, requests, lambda: bar.advance(task))
    else:
        recorder = engine.run(rt, requests)
    wall = time.perf_counter() - start
    _account(rt, recorder, counted.read, settings.engine.name)
    mode = getattr(engine_settings, "mode", settings.engine.name)
    return RunResult(build(rt, recorder, mode, wall, label, counted.read), recorder, rt)


def _run_quietly(job: tuple[Settings, str]) -> RunResult:
    settings, label = job
    return run(settings, label=label).without_runtime()


#: The entry point group of the executors that replay several runs at once
#: (``--executor``): ``local`` here, others from plugins (``ray``).
EXECUTORS = "sagellm.executors"


class Executor(Protocol):
    """Replays runs that share nothing, several at a time: an executor
    plugin (group ``sagellm.executors``) is this class, built with no
    arguments."""

    def map(
        self, run: Callable[[tuple[Settings, str]], RunResult], jobs: Sequence[tuple[Settings, str]], workers: int
    ) -> list[RunResult]:
        """``run`` of each of ``jobs``, at most ``workers`` at once; the
        results in the order of ``jobs``. An error raised by a run is raised
        here as it was raised there."""
        ...


class LocalProcesses:
    """The ``local`` executor: fresh local interpreters (``spawn``), so a
    plugin's state never crosses runs."""

    def map(
        self, run: Callable[[tuple[Settings, str]], RunResult], jobs: Sequence[tuple[Settings, str]], workers: int
    ) -> list[RunResult]:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=context) as pool:
            return list(pool.map(run, jobs))


def load_executor(name: str) -> Executor:
    """The executor plugin ``name``; a ConfigError naming ``--executor`` when
    none is installed by that name."""
    where = f"--executor {name}"
    ep = registry.find(EXECUTORS, name, where)
    if ep is None:
        names = ", ".join(sorted(registry.installed(EXECUTORS))) or "none"
        raise ConfigError(f"{where}: no such executor; installed: {names} (Ray tasks: pip install sagellm-plugin-ray)")
    try:
        cls = ep.load()
    except (Exception, SystemExit) as exc:  # an import error inside a third-party plugin
        raise PluginStartError(f"{where}: {ep.value} failed to import: {type(exc).__name__}: {exc}") from exc
    return cls()


def run_many(
    jobs: Sequence[tuple[Settings, str]], *, workers: int = 1, executor: str = "local", progress: bool = False
) -> list[RunResult]:
    """Run each ``(settings, label)`` of ``jobs`` and return their results
    (without runtimes: each holds a whole cache) in the order given. Runs
    share nothing, so ``executor`` may replay them ``workers`` at once: the
    ``local`` one in that many local processes, an executor plugin where it
    places them (``ray``: Ray tasks); the figures are the same as one at a
    time. One local worker replays here, one run after another."""
    if type(workers) is not int or workers < 1:
        raise ConfigError(f"--workers {workers!r}: a whole number of processes, at least 1")
    chosen = load_executor(executor)
    if isinstance(chosen, LocalProcesses) and (workers == 1 or len(jobs) < 2):
        return [run(settings, label=label, progress=progress).without_runtime() for settings, label in jobs]
    return chosen.map(_run_quietly, jobs, workers)
