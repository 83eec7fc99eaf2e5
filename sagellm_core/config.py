"""The TOML config file, parsed into typed settings.

Every error is one line: the file, the section and key, the bad value and what
would be accepted. Plugin parameters are validated later, by each plugin's own
``Settings`` class (see :mod:`sagellm_core.registry`).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import attrs
from attrs import frozen

from sagellm_core import registry
from sagellm_core.errors import ConfigError

#: The sections the kernel reads. Any other names a section an installed
#: distribution declares (``sagellm.sections``: its name, and the attrs
#: class its keys fill, checked by the type of each field's default).
SECTIONS = (
    *("engine", "prefix_cache", "kv_pool", "eviction", "lifetime", "scheduler", "admission", "transport", "router"),
    "kv_stores",
    *("workload", "report", "instance", "limits"),
)
SECTION_GROUP = "sagellm.sections"
#: Bounds checked before anything is allocated (issue 16, class 5): a prompt
#: or reply longer, or a pool larger, is a typo, not a workload (a 4M-token
#: prompt's ids are 32 MB; a 16M-block pool's free list alone is 130 MB).
MAX_TOKENS = 1 << 22
MAX_NUM_BLOCKS = 1 << 24
#: Workload sources: the trace files the core reads (``path``), the
#: generator, and others from installed packages through this entry point
#: group (an object ``load(settings)`` yielding requests in arrival order,
#: with the attrs class of the ``[workload]`` keys it reads as ``Settings``:
#: the generator's is one).
WORKLOAD_SOURCES = ("generator", "mooncake", "azure")
WORKLOAD_GROUP = "sagellm.workloads"


@frozen
class Selection:
    """One plugin picked by the config, with its raw parameters."""

    section: str
    name: str
    params: dict[str, Any]
    #: Where it was picked, for error messages: ``file: [section]``.
    where: str


@frozen
class WorkloadSettings:
    source: str = "generator"
    path: str | None = None
    #: Tokens per ``hash_ids`` entry of a Mooncake trace.
    trace_block_tokens: int = 512
    max_requests: int | None = None
    #: Multiply arrival times by this: 2.0 replays a trace at half its load.
    time_scale: float = 1.0
    #: Keep only the sessions (conversations; a request without a session is
    #: its own) whose stable draw (``workloads.session_draw``, uniform in
    #: [0, 1)) falls in [session_from, session_to): a reproducible sample of
    #: whole conversations, e.g. a predictor's held-out ones.
    session_from: float = 0.0
    session_to: float = 1.0
    #: Give every request a deadline (``Request.deadline_s``) this many
    #: seconds after its (scaled) arrival: a TTFT SLO.
    ttft_slo_s: float | None = None
    seed: int = 0
    #: The source's own settings (``Settings`` of its entry point, filled
    #: from the other ``[workload]`` keys); ``None`` for a trace file.
    options: Any = None

    def __attrs_post_init__(self) -> None:
        # A ValueError names the key; the parser adds the file and section.
        if self.source not in WORKLOAD_SOURCES:
            try:  # refused if blocked, or registered by two distributions
                registry.find(WORKLOAD_GROUP, self.source, f"source = {self.source!r}")
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
            installed = sorted(ep.name for ep in metadata.entry_points(group=WORKLOAD_GROUP))
            if self.source not in installed:
                raise ValueError(
                    f"source = {self.source!r}: accepted: {', '.join([*WORKLOAD_SOURCES, *installed])}"
                    f" (others through {WORKLOAD_GROUP} entry points)"
                )
        if self.trace_block_tokens < 1:
            raise ValueError(f"trace_block_tokens = {self.trace_block_tokens!r}: a positive integer")
        if self.trace_block_tokens > MAX_TOKENS:
            raise ValueError(f"trace_block_tokens = {self.trace_block_tokens!r}: at most {MAX_TOKENS:,} tokens")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale = {self.time_scale!r}: a positive number")
        if not 0 <= self.session_from < self.session_to <= 1:
            raise ValueError(
                f"session_from = {self.session_from!r}, session_to = {self.session_to!r}:"
                " 0 <= session_from < session_to <= 1"
            )
        if self.source in ("mooncake", "azure") and self.path is None:
            raise ValueError(f"source = {self.source!r} needs path = FILE")
        if self.options is None and (options := source_options(self.source)) is not None:
            object.__setattr__(self, "options", options())  # the source's defaults


def source_options(source: str) -> type | None:
    """The attrs class of the ``[workload]`` keys ``source`` reads (``None``
    for a trace file, or a source that reads none)."""
    if source in ("mooncake", "azure"):
        return None
    where = f"source = {source!r}"
    entry = registry.find(WORKLOAD_GROUP, source, where)
    return None if entry is None else getattr(_load(entry, where), "Settings", None)


def _load(entry: metadata.EntryPoint, where: str) -> Any:
    try:
        return entry.load()
    except (Exception, SystemExit) as exc:
        raise ConfigError(f"{where} ({entry.value}) failed to import: {type(exc).__name__}: {exc}") from exc


@frozen
class LimitsSettings:
    #: Seconds one hook call (or KV store call) may run before it is stopped
    #: and its plugin named (a SIGALRM watchdog on the main thread); 0: no limit.
    hook_time_limit_s: float = 0.0


#: ``[kv_stores.NAME] write``: which blocks the runtime offers a store:
#: every one, or only those the device's prefix cache has hit.
WRITE_WHICH = ("all", "reused")
#: ``[kv_stores.NAME] write_on``: when: as the device evicts them, or as
#: soon as they qualify (cached, or hit for the first time).
WRITE_WHEN = ("eviction", "through")


@frozen
class TierRule:
    """The runtime's keys of one store (``[kv_stores.NAME]``, taken out
    before the rest reach the store): what it is offered, and when."""

    write: str = "all"
    write_on: str = "eviction"


@frozen
class KVStoreSettings:
    """``[kv_stores]``: the tiers below the device pool, fastest first."""

    tiers: tuple[Selection, ...] = ()
    #: Each tier's :class:`TierRule`, in the order of ``tiers`` (read from
    #: their tables, not a key of ``[kv_stores]``).
    rules: tuple[TierRule, ...] = attrs.field(default=(), metadata={"from_tables": True})
    #: Bytes of the rows stores copy when no engine has KV tensors (replay):
    #: the runtime gives them a stand-in device pool of this row size.
    bytes_per_block: int = 4096
    #: Load a store's blocks only where the engine's costs (``LoadCosts``)
    #: say loading them is faster than computing them; else recompute.
    load_or_recompute: bool = True
    #: Start moving a waiting request's blocks up from the stores when it
    #: arrives (``prefetch``), so the copy overlaps its wait; a prefetch not
    #: done this many seconds after arrival is given up (counted late).
    prefetch: bool = False
    prefetch_timeout_s: float = 1.0

    def __attrs_post_init__(self) -> None:
        if self.bytes_per_block < 1:
            raise ValueError(f"bytes_per_block = {self.bytes_per_block!r}: a positive number of bytes")


@frozen
class ReportSettings:
    hook_timing: bool = True


@frozen
class InstanceSettings:
    """Which runtime of a cluster this config runs (``PluginContext``)."""

    id: str = "0"
    role: str = "colocated"

    def __attrs_post_init__(self) -> None:
        if not self.id:
            raise ValueError("id = '': a name for this instance")
        if self.role not in registry.ROLES:
            raise ValueError(f"role = {self.role!r}: accepted: {', '.join(registry.ROLES)}")


@frozen
class Settings:
    path: str
    engine: Selection
    kv_pool: Selection | None
    prefix_cache: Selection | None
    eviction: Selection | None
    lifetime: Selection | None
    #: Answers, with its default settings, when ``lifetime`` fails.
    lifetime_fallback: Selection | None
    passes: tuple[Selection, ...]
    admission: Selection | None
    transport: Selection | None
    block_size: int
    #: Or "auto", until an engine that sizes its pool from memory resolves it (before a runtime is built).
    num_blocks: int
    workload: WorkloadSettings
    report: ReportSettings
    limits: LimitsSettings = LimitsSettings()
    instance: InstanceSettings = InstanceSettings()
    #: The routing decision across a cluster's instances (an engine that runs several reads it).
    router: Selection | None = None
    kv_stores: KVStoreSettings = KVStoreSettings()
    #: The declared sections the file has, by name: their settings.
    sections: dict[str, Any] = attrs.field(factory=dict)

    def decisions(self) -> list[Selection]:
        """The single-plugin decisions picked (scheduler passes aside)."""
        single = [self.prefix_cache, self.kv_pool, self.eviction, self.lifetime, self.admission, self.transport]
        return [s for s in single if s is not None]

    def section(self, name: str) -> Any:
        """The settings of the declared section ``[name]``: the file's, or
        its defaults where the file has none."""
        if name in self.sections:
            return self.sections[name]
        cls = _declared(name, f"{self.path}: [{name}]")
        if cls is None:
            raise ConfigError(f"{self.path}: no installed distribution declares a section [{name}]")
        return cls()


def _declared(section: str, where: str) -> type | None:
    """The settings class an installed distribution declares for ``[section]``."""
    entry = registry.find(SECTION_GROUP, section, where)
    return None if entry is None else _load(entry, where)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _nonempty_str(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


class _Table:
    """A TOML table being read: keys are taken one by one, leftovers are
    either plugin parameters or errors."""

    def __init__(self, path: str, section: str, data: Any):
        self.path, self.section = path, section
        self.where = f"{path}: [{section}]"
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: {section} must be a table [{section}], got {data!r}")
        self.data = dict(data)

    def fail(self, key: str, value: Any, accepted: str) -> ConfigError:
        return ConfigError(f"{self.where} {key} = {value!r}: {accepted}")

    def take(self, key: str, default: Any, check: Callable[[Any], bool], accepted: str) -> Any:
        if key not in self.data:
            return default
        value = self.data.pop(key)
        if not check(value):
            raise self.fail(key, value, accepted)
        return value

    def plugin(self, default: str | None = None) -> str | None:
        name: str | None = self.take("plugin", default, _nonempty_str, "a plugin name")
        return name

    def selection(self, name: str) -> Selection:
        return Selection(self.section, name, self.data, self.where)

    def no_leftovers(self) -> None:
        if self.data:
            key = next(iter(self.data))
            raise ConfigError(f"{self.where}: unknown key {key!r}")


def load(path: str | Path, overrides: dict[tuple[str, ...], Any] | None = None) -> Settings:
    """Load a config file; ``overrides`` set ``(section, ..., key)`` paths
    first, as if the file said so (``--set`` on the command line)."""
    path = str(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as exc:  # a folder, no permission
        raise ConfigError(f"{path}: cannot read the config: {exc.strerror}") from None
    try:
        # utf-8-sig: a byte-order mark (as some editors write) is not an error.
        raw = tomllib.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); a config is a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: arrays or tables nested too deeply") from None
    for keys, value in (overrides or {}).items():
        table = raw
        for key in keys[:-1]:
            table = table.setdefault(key, {})
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: --set {'.'.join(keys)}: {key} is not a table")
        table[keys[-1]] = value
    settings = parse(raw, path)
    trace = settings.workload.path
    if trace is not None and not Path(trace).is_absolute():
        # Trace paths in a config file are relative to that file.
        settings = with_workload(settings, path=str(Path(path).parent / trace))
    return settings


def parse(raw: dict[str, Any], path: str = "<config>") -> Settings:
    """Typed settings from a parsed TOML document: one small parser per
    section, each taking its keys and refusing leftovers."""
    declared: dict[str, type] = {}
    for section in raw:
        if section not in SECTIONS:
            cls = _declared(section, f"{path}: [{section}]")
            if cls is None:
                installed = sorted(ep.name for ep in metadata.entry_points(group=SECTION_GROUP))
                accepted = ", ".join([*SECTIONS, *installed])
                raise ConfigError(f"{path}: unknown section [{section}]; accepted: {accepted}")
            declared[section] = cls
    tables = {section: _Table(path, section, data) for section, data in raw.items()}
    num_blocks, kv_pool = _kv_pool(path, tables.get("kv_pool"))
    block_size, prefix_cache = _prefix_cache(tables.get("prefix_cache"))
    eviction = _single(tables.get("eviction"))
    if prefix_cache is not None and eviction is None:
        raise ConfigError(f"{path}: [prefix_cache] is set but [eviction] is missing; a cache needs a victim policy")
    lifetime, lifetime_fallback = _lifetime(tables.get("lifetime"))
    return Settings(
        path=path,
        engine=_engine(tables.get("engine") or _Table(path, "engine", {})),
        kv_pool=kv_pool,
        prefix_cache=prefix_cache,
        eviction=eviction,
        lifetime=lifetime,
        lifetime_fallback=lifetime_fallback,
        passes=_passes(path, tables.get("scheduler")),
        admission=_single(tables.get("admission")),
        transport=_single(tables.get("transport")),
        block_size=block_size,
        num_blocks=num_blocks,
        workload=_workload(tables.get("workload")),
        report=_typed(tables.get("report"), ReportSettings),
        limits=_typed(tables.get("limits"), LimitsSettings),
        instance=_typed(tables.get("instance"), InstanceSettings),
        router=_single(tables.get("router")),
        kv_stores=_kv_stores(path, tables.get("kv_stores")),
        sections={section: _typed(tables[section], cls) for section, cls in declared.items()},
    )


def _workload(t: _Table | None) -> WorkloadSettings:
    """The kernel's keys, then the source's own (its ``options``)."""
    if t is None:
        return WorkloadSettings()
    own = {f.name for f in attrs.fields(WorkloadSettings)} - {"options"}
    theirs = _Table(t.path, t.section, {k: v for k, v in t.data.items() if k not in own})
    t.data = {k: v for k, v in t.data.items() if k in own}
    settings: WorkloadSettings = _typed(t, WorkloadSettings)  # the source checked first
    if settings.options is None:
        theirs.no_leftovers()
        return settings
    return attrs.evolve(settings, options=_typed(theirs, type(settings.options)))


def _engine(t: _Table) -> Selection:
    return t.selection(t.take("name", "replay", _nonempty_str, "an engine name"))


def _kv_pool(path: str, t: _Table | None) -> tuple[int, Selection | None]:
    if t is None:
        raise ConfigError(f"{path}: missing section [kv_pool]; it picks the block allocator")
    in_range = lambda v: v == "auto" or (_positive_int(v) and v <= MAX_NUM_BLOCKS)  # noqa: E731
    num_blocks = t.take("num_blocks", None, in_range, f'a number of blocks from 1 to {MAX_NUM_BLOCKS:,}, or "auto"')
    if num_blocks is None:
        raise ConfigError(f"{t.where}: missing key 'num_blocks' (the pool size, in blocks)")
    # The plugin may be left out for an engine that allocates blocks itself
    # (the runtime says so when the engine needs one).
    name = t.plugin()
    return num_blocks, (t.selection(name) if name is not None else None)


def _prefix_cache(t: _Table | None) -> tuple[int, Selection | None]:
    if t is None:
        return 16, None
    in_range = lambda v: _positive_int(v) and v <= MAX_TOKENS  # noqa: E731
    block_size = t.take("block_size", 16, in_range, f"a positive number of tokens, at most {MAX_TOKENS:,}")
    name = t.plugin()
    if name is None:
        t.no_leftovers()
        return block_size, None
    return block_size, t.selection(name)


def _single(t: _Table | None) -> Selection | None:
    """A section that picks one plugin, the rest of its keys its parameters."""
    if t is None:
        return None
    name = t.plugin()
    if name is None:
        raise ConfigError(f"{t.where}: missing key 'plugin'")
    return t.selection(name)


def _lifetime(t: _Table | None) -> tuple[Selection | None, Selection | None]:
    if t is None:
        return None, None
    # The predictor used, with its default settings, when the picked one
    # raises or returns garbage.
    fallback = t.take("fallback", None, _nonempty_str, "a lifetime plugin name")
    lifetime = _single(t)
    assert lifetime is not None
    if fallback == lifetime.name:
        raise t.fail("fallback", fallback, "a plugin other than the one picked")
    return lifetime, (Selection("lifetime", fallback, {}, f"{t.where} fallback") if fallback else None)


def _plugin_names(value: Any) -> bool:
    return isinstance(value, list) and all(_nonempty_str(n) for n in value)


def _listed(path: str, t: _Table, key: str, what: str) -> tuple[Selection, ...]:
    """The plugins ``t`` lists under ``key``, in order, each with its
    parameters from the table ``[section.name]``."""
    names = t.take(key, [], _plugin_names, f"a list of {what} names")
    if len(set(names)) != len(names):
        raise t.fail(key, names, f"each {what} at most once")
    listed = []
    for name in names:
        params = t.data.pop(name, {})
        if not isinstance(params, dict):
            raise t.fail(name, params, f"a table [{t.section}.{name}] of parameters")
        listed.append(Selection(t.section, name, params, f"{path}: [{t.section}.{name}]"))
    return tuple(listed)


def _passes(path: str, t: _Table | None) -> tuple[Selection, ...]:
    if t is None:
        return ()
    passes = _listed(path, t, "passes", "pass")
    t.no_leftovers()
    return passes


def _kv_stores(path: str, t: _Table | None) -> KVStoreSettings:
    if t is None:
        return KVStoreSettings()
    tiers = _listed(path, t, "tiers", "store")
    stray = [name for name, value in t.data.items() if isinstance(value, dict)]
    if stray:
        raise ConfigError(f"{t.where}: [kv_stores.{stray[0]}] is not among tiers = {[s.name for s in tiers]}")
    settings: KVStoreSettings = _typed(t, KVStoreSettings)
    rules, stores = [], []
    for tier in tiers:
        own = _Table(path, f"kv_stores.{tier.name}", tier.params)
        write = own.take("write", "all", WRITE_WHICH.__contains__, f"one of {', '.join(WRITE_WHICH)}")
        write_on = own.take("write_on", "eviction", WRITE_WHEN.__contains__, f"one of {', '.join(WRITE_WHEN)}")
        rules.append(TierRule(write, write_on))
        stores.append(attrs.evolve(tier, params=own.data))
    return attrs.evolve(settings, tiers=tuple(stores), rules=tuple(rules))


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


Check = tuple[Callable[[Any], bool], str]
#: Fields that default to None but take a number.
_OPTIONAL_NUMBERS: dict[str, Check] = {
    "max_requests": (_positive_int, "a positive integer"),
    "ttft_slo_s": (_positive_number, "a positive number of seconds"),
}
#: Other types of default: the settings class checks the value itself.
_ANY: Check = (lambda v: True, "")
#: The check of a field by the type of its default (bool before int: a bool is an int).
_BY_DEFAULT: dict[type, Check] = {
    str: (lambda v: isinstance(v, str), "a string"),
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a non-negative integer"),
    float: (
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf,
        "a finite number >= 0",
    ),
}


def _typed(t: _Table | None, cls: type) -> Any:
    """Fill a core settings class from a table, checking each value against
    the type of the field's default."""
    if t is None:
        return cls()
    values = {}
    for field in attrs.fields(cls):
        if field.metadata.get("from_tables"):
            continue
        default = field.default
        if default is None:
            ok, accepted = _OPTIONAL_NUMBERS.get(field.name, _BY_DEFAULT[str])
        else:
            ok, accepted = _BY_DEFAULT.get(bool if isinstance(default, bool) else type(default), _ANY)
        if field.name in t.data:
            values[field.name] = t.take(field.name, default, ok, accepted)
    t.no_leftovers()
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:  # a settings class's own check: one line, naming the file
        raise ConfigError(f"{t.where} {exc}") from None


def with_workload(settings: Settings, **changes: Any) -> Settings:
    """``settings`` with ``changes`` to its workload (another ``source``
    reads its own options: its defaults, unless ``changes`` gives them)."""
    if changes.get("source", settings.workload.source) != settings.workload.source:
        changes.setdefault("options", None)
    return attrs.evolve(settings, workload=attrs.evolve(settings.workload, **changes))
