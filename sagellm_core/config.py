"""The TOML config file, parsed into typed settings.

Every error is one line: the file, the section and key, the bad value and what
would be accepted. Plugin parameters are validated later, by each plugin's own
``Settings`` class (see :mod:`sagellm_core.registry`).
"""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import attrs
from attrs import frozen

from sagellm_core.errors import ConfigError

SECTIONS = (
    "engine",
    "prefix_cache",
    "kv_pool",
    "eviction",
    "lifetime",
    "scheduler",
    "transport",
    "workload",
    "report",
    "server",
)
#: Workload sources built into the core; others come from installed
#: packages through this entry point group (an object ``load(settings)``
#: yielding requests in arrival order).
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
    # The built-in generator: multi-tenant chat sessions.
    tenants: int = 4
    sessions_per_tenant: int = 12
    #: 0: every tenant has the same number of sessions; s > 0: a session
    #: belongs to tenant k with probability proportional to 1 / (k + 1)^s
    #: (Zipf), so a few tenants bring most of the load.
    tenant_skew: float = 0.0
    turns: int = 4
    system_prompt_tokens: int = 1024
    user_tokens: int = 256
    output_tokens: int = 192
    #: Mean new sessions per second (Poisson arrivals).
    session_rate: float = 2.0
    #: Mean think time between a reply and the next turn, seconds.
    think_time_s: float = 5.0


@frozen
class ReportSettings:
    hook_timing: bool = True


@frozen
class ServerSettings:
    """``sagellm serve`` (from ``sagellm-plugin-server``)."""

    #: Requests allowed to wait for admission; one more is answered 429.
    max_waiting: int = 256
    #: The model name clients send; empty: the engine's model setting.
    model_name: str = ""


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
    transport: Selection | None
    block_size: int
    num_blocks: int
    offload_evicted: bool
    workload: WorkloadSettings
    report: ReportSettings
    server: ServerSettings = ServerSettings()

    def decisions(self) -> list[Selection]:
        """The single-plugin decisions picked (scheduler passes aside)."""
        single = [self.prefix_cache, self.kv_pool, self.eviction, self.lifetime, self.transport]
        return [s for s in single if s is not None]


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


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
        return self.take("plugin", default, lambda v: isinstance(v, str) and v, "a plugin name")

    def selection(self, name: str) -> Selection:
        return Selection(self.section, name, self.data, self.where)

    def no_leftovers(self) -> None:
        if self.data:
            key = next(iter(self.data))
            raise ConfigError(f"{self.where}: unknown key {key!r}")


def parse_override(text: str) -> tuple[tuple[str, ...], list[Any]]:
    """``section.key=V1,V2`` (values in TOML syntax) -> (path, [values])."""
    where = f"--set {text}"
    if "=" not in text:
        raise ConfigError(f"{where}: expected SECTION.KEY=VALUE[,VALUE...]")
    dotted, _, values = text.partition("=")
    keys = tuple(k.strip() for k in dotted.split("."))
    if len(keys) < 2 or not all(keys):
        raise ConfigError(f"{where}: expected SECTION.KEY=VALUE[,VALUE...]")
    try:
        parsed = tomllib.loads(f"v = [{values}]")["v"]
    except tomllib.TOMLDecodeError:
        try:  # bare words: plugin names
            parsed = [v.strip() for v in values.split(",")]
            tomllib.loads("v = [" + ", ".join(f'"{v}"' for v in parsed) + "]")
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{where}: values must be TOML literals or bare words: {exc}") from None
    if not parsed:
        raise ConfigError(f"{where}: no value")
    return keys, parsed


def load(path: str | Path, overrides: dict[tuple[str, ...], Any] | None = None) -> Settings:
    """Load a config file; ``overrides`` set ``(section, ..., key)`` paths
    first, as if the file said so (``--set`` on the command line)."""
    path = str(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    try:
        # utf-8-sig: a byte-order mark (as some editors write) is not an error.
        raw = tomllib.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); a config is a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
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
    for section in raw:
        if section not in SECTIONS:
            raise ConfigError(
                f"{path}: unknown section [{section}]; accepted: {', '.join(SECTIONS)}"
            )

    def table(section: str) -> _Table | None:
        return _Table(path, section, raw[section]) if section in raw else None

    engine_t = table("engine") or _Table(path, "engine", {})
    engine_name = engine_t.take("name", "replay", lambda v: isinstance(v, str) and v, "an engine name")
    engine = engine_t.selection(engine_name)

    pool_t = table("kv_pool")
    if pool_t is None:
        raise ConfigError(f"{path}: missing section [kv_pool]; it picks the block allocator")
    num_blocks = pool_t.take("num_blocks", None, _positive_int, "a positive number of blocks")
    if num_blocks is None:
        raise ConfigError(f"{pool_t.where}: missing key 'num_blocks' (the pool size, in blocks)")
    # The plugin may be left out for an engine that allocates blocks itself
    # (the runtime says so when the engine needs one).
    pool_name = pool_t.plugin()
    kv_pool = pool_t.selection(pool_name) if pool_name is not None else None

    prefix_t = table("prefix_cache")
    block_size = 16
    prefix_cache = None
    if prefix_t is not None:
        block_size = prefix_t.take("block_size", 16, _positive_int, "a positive number of tokens")
        name = prefix_t.plugin()
        if name is not None:
            prefix_cache = prefix_t.selection(name)
        else:
            prefix_t.no_leftovers()

    def single(section: str) -> Selection | None:
        t = table(section)
        if t is None:
            return None
        name = t.plugin()
        if name is None:
            raise ConfigError(f"{t.where}: missing key 'plugin'")
        return t.selection(name)

    eviction = single("eviction")
    if prefix_cache is not None and eviction is None:
        raise ConfigError(
            f"{path}: [prefix_cache] is set but [eviction] is missing; a cache needs a victim policy"
        )
    lifetime_t = table("lifetime")
    lifetime = lifetime_fallback = None
    if lifetime_t is not None:
        # The predictor used, with its default settings, when the picked one
        # raises or returns garbage.
        fallback = lifetime_t.take("fallback", None, lambda v: isinstance(v, str) and v, "a lifetime plugin name")
        name = lifetime_t.plugin()
        if name is None:
            raise ConfigError(f"{lifetime_t.where}: missing key 'plugin'")
        if fallback == name:
            raise lifetime_t.fail("fallback", fallback, "a plugin other than the one picked")
        lifetime = lifetime_t.selection(name)
        if fallback is not None:
            lifetime_fallback = Selection("lifetime", fallback, {}, f"{lifetime_t.where} fallback")

    transport_t = table("transport")
    transport = None
    offload_evicted = False
    if transport_t is not None:
        offload_evicted = transport_t.take(
            "offload_evicted", False, lambda v: isinstance(v, bool), "true or false"
        )
        name = transport_t.plugin()
        if name is None:
            raise ConfigError(f"{transport_t.where}: missing key 'plugin'")
        transport = transport_t.selection(name)

    passes: list[Selection] = []
    sched_t = table("scheduler")
    if sched_t is not None:
        names = sched_t.take(
            "passes",
            [],
            lambda v: isinstance(v, list) and all(isinstance(n, str) and n for n in v),
            "a list of pass names",
        )
        if len(set(names)) != len(names):
            raise sched_t.fail("passes", names, "each pass at most once")
        for name in names:
            params = sched_t.data.pop(name, {})
            if not isinstance(params, dict):
                raise sched_t.fail(name, params, f"a table [scheduler.{name}] of parameters")
            passes.append(Selection("scheduler", name, params, f"{path}: [scheduler.{name}]"))
        sched_t.no_leftovers()

    workload = _typed(table("workload"), WorkloadSettings)
    if workload.source not in WORKLOAD_SOURCES:
        installed = sorted(ep.name for ep in metadata.entry_points(group=WORKLOAD_GROUP))
        if workload.source not in installed:
            raise ConfigError(
                f"{path}: [workload] source = {workload.source!r}: accepted: "
                f"{', '.join([*WORKLOAD_SOURCES, *installed])} (others through {WORKLOAD_GROUP} entry points)"
            )
    for key in ("tenants", "sessions_per_tenant", "turns"):
        if getattr(workload, key) < 1:
            raise ConfigError(f"{path}: [workload] {key} = {getattr(workload, key)!r}: a positive integer")
    if workload.time_scale <= 0:
        raise ConfigError(f"{path}: [workload] time_scale = {workload.time_scale!r}: a positive number")
    if not 0 <= workload.session_from < workload.session_to <= 1:
        raise ConfigError(
            f"{path}: [workload] session_from = {workload.session_from!r}, session_to = {workload.session_to!r}:"
            " 0 <= session_from < session_to <= 1"
        )
    if workload.source in ("mooncake", "azure") and workload.path is None:
        raise ConfigError(f"{path}: [workload] source = {workload.source!r} needs path = FILE")
    report = _typed(table("report"), ReportSettings)
    server = _typed(table("server"), ServerSettings)
    if server.max_waiting < 1:
        raise ConfigError(f"{path}: [server] max_waiting = {server.max_waiting!r}: a positive integer")

    return Settings(
        path=path,
        engine=engine,
        kv_pool=kv_pool,
        prefix_cache=prefix_cache,
        eviction=eviction,
        lifetime=lifetime,
        lifetime_fallback=lifetime_fallback,
        passes=tuple(passes),
        transport=transport,
        block_size=block_size,
        num_blocks=num_blocks,
        offload_evicted=offload_evicted,
        workload=workload,
        report=report,
        server=server,
    )


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


#: Fields that default to None but take a number: (check, what it accepts).
_OPTIONAL_NUMBERS = {
    "max_requests": (_positive_int, "a positive integer"),
    "ttft_slo_s": (_positive_number, "a positive number of seconds"),
}


def _typed(t: _Table | None, cls: type) -> Any:
    """Fill a core settings class from a table, checking each value against
    the type of the field's default."""
    if t is None:
        return cls()
    values = {}
    for field in attrs.fields(cls):
        default = field.default
        if default is None or isinstance(default, str):
            ok, accepted = _OPTIONAL_NUMBERS.get(field.name, ((lambda v: isinstance(v, str)), "a string"))
        elif isinstance(default, bool):
            ok, accepted = (lambda v: isinstance(v, bool)), "true or false"
        elif isinstance(default, int):
            ok, accepted = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0), "a non-negative integer"
        else:
            ok, accepted = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0), "a non-negative number"
        if field.name in t.data:
            values[field.name] = t.take(field.name, default, ok, accepted)
    t.no_leftovers()
    return cls(**values)


def with_workload(settings: Settings, **changes: Any) -> Settings:
    return attrs.evolve(settings, workload=attrs.evolve(settings.workload, **changes))
