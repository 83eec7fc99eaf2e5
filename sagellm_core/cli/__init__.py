"""The ``sagellm`` command."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

import attrs
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sagellm_core import __version__, hookspecs, registry, types
from sagellm_core.config import Selection, Settings
from sagellm_core.drivers.engines import build_engine
from sagellm_core.drivers.router import Router
from sagellm_core.errors import ConfigError, SagellmError
from sagellm_core.replay import report, session


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
    except RecursionError:
        raise ConfigError(f"{where}: values nested too deeply") from None
    except tomllib.TOMLDecodeError:
        try:  # bare words: plugin names
            parsed = [v.strip() for v in values.split(",")]
            tomllib.loads("v = [" + ", ".join(f'"{v}"' for v in parsed) + "]")
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{where}: values must be TOML literals or bare words: {exc}") from None
    if not parsed:
        raise ConfigError(f"{where}: no value")
    return keys, parsed


def _write_outputs(args, results) -> None:
    try:
        _write(args, results)
    except OSError as exc:  # checked before the run; the file system may still refuse
        where = exc.filename or ", ".join(p for p in (args.json, args.markdown, args.plot) if p)
        raise SagellmError(f"{where}: cannot write the report: {exc.strerror}") from None


def _write(args, results) -> None:
    reports = [r.report for r in results]
    if args.json:
        report.write_json(reports, args.json)
    if args.markdown:
        Path(args.markdown).write_text(report.markdown(reports))
    if args.plot:
        report.plot(reports, [r.recorder.timeline for r in results], args.plot)


def add_set_option(parser: argparse.ArgumentParser) -> None:
    """``--set SECTION.KEY=VALUE``, repeatable: on every command that reads a config."""
    parser.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override a config key (TOML value, or a bare word); repeatable",
    )


def add_workers_option(parser: argparse.ArgumentParser) -> None:
    """``--workers N`` and ``--executor NAME``: on every command that replays several configs."""
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="replay N runs at once (default 1: one after another here, with progress bars)",
    )
    parser.add_argument(
        "--executor",
        default="local",
        metavar="NAME",
        help="where the runs replay: local (processes on this machine, the default) or an executor plugin's,"
        " e.g. ray (Ray tasks on the cluster RAY_ADDRESS names, else a Ray started here; sagellm-plugin-ray)",
    )


def single_overrides(args: argparse.Namespace) -> dict[tuple[str, ...], Any]:
    """The ``--set`` overrides of a command that runs one value per key."""
    overrides = {}
    for text in args.set or ():
        keys, values = parse_override(text)
        if len(values) != 1:
            raise SagellmError(f"--set {text}: one value here; `sagellm sweep` takes several")
        overrides[keys] = values[0]
    return overrides


def _settings(args, path, overrides):
    settings = session.load_settings(path, args.trace, overrides)
    if args.max_requests is not None:
        if args.max_requests < 1:
            raise SagellmError(f"--max-requests {args.max_requests}: at least 1")
        settings = session.config_mod.with_workload(settings, max_requests=args.max_requests)
    return settings


def cmd_replay(args) -> int:
    settings = _settings(args, args.config, single_overrides(args))
    result = session.run(settings, progress=not args.quiet)
    if not args.quiet:
        report.print_reports([result.report])
    _write_outputs(args, [result])
    return 0


def cmd_compare(args) -> int:
    overrides = single_overrides(args)
    all_settings = [_settings(args, path, overrides) for path in args.config]
    session.check_same_workload(all_settings)
    jobs = [(settings, Path(settings.path).stem) for settings in all_settings]
    results = session.run_many(jobs, workers=args.workers, executor=args.executor, progress=not args.quiet)
    if not args.quiet:
        report.print_reports([r.report for r in results])
    _write_outputs(args, results)
    return 0


def cmd_sweep(args) -> int:
    axes = [parse_override(text) for text in args.set]
    swept = [(keys, values) for keys, values in axes if len(values) > 1]
    if len(swept) != 1:
        raise SagellmError("sweep: give exactly one --set KEY=V1,V2,... with several values (the axis)")
    (axis, values), fixed = swept[0], {keys: values[0] for keys, values in axes if len(values) == 1}
    name = ".".join(axis)
    plan = [(path, value, _settings(args, path, {**fixed, axis: value})) for path in args.config for value in values]
    for value in values:  # configs side by side replay one workload (the axis may be a workload key)
        session.check_same_workload([settings for _, v, settings in plan if v == value])
    jobs = [(settings, f"{Path(path).stem} {name}={value}") for path, value, settings in plan]
    results = session.run_many(jobs, workers=args.workers, executor=args.executor, progress=not args.quiet)
    runs = [(Path(path).stem, value, result) for (path, value, _), result in zip(plan, results)]
    reports = [r.report for _, _, r in runs]
    for (_, value, _), rep in zip(runs, reports):
        rep["sweep"] = {"key": name, "value": value}
    figures = args.figure or ["block_hit_rate"]
    if not args.quiet:
        for figure in figures:
            Console().print(report.sweep_table(runs, name, values, figure))
    try:
        if args.json:
            report.write_json(reports, args.json)
        if args.markdown:
            Path(args.markdown).write_text("\n".join(report.sweep_markdown(runs, name, values, f) for f in figures))
        if args.plot:
            report.plot_sweep(runs, name, values, figures[0], args.plot)
    except OSError as exc:
        raise SagellmError(f"{exc.filename or 'an output'}: cannot write the report: {exc.strerror}") from None
    return 0


@attrs.frozen
class InstalledPlugin:
    """One entry point of a ``sagellm.*`` group, as ``sagellm plugins`` and
    the README's plugin table show it."""

    group: str
    name: str
    value: str
    distribution: str
    version: str
    #: The distribution's one-line summary (its pyproject ``description``).
    summary: str
    #: The hooks its class implements (decision groups only).
    hooks: tuple[str, ...]
    #: Why it cannot be used here (blocked, fails to load), or None.
    problem: str | None


def installed_plugins() -> list[InstalledPlugin]:
    """Every installed plugin of every ``sagellm.*`` group, by group then name."""
    blocked = registry.blocked_names()
    decisions = {group for group, _ in registry.GROUPS.values()}
    found = []
    for group in registry.BLOCKABLE:
        for ep in sorted(metadata.entry_points(group=group), key=lambda e: e.name):
            info, hooks, problem = registry.describe(ep), (), None
            if registry.is_blocked(group, ep.name, blocked):
                problem = f"blocked by {registry.BLOCK_ENV}"
            elif group in decisions:
                try:
                    cls = registry.load_class(_section(group), ep.name, group)[0]
                    hooks = tuple(n.removeprefix("sagellm_") for n in dir(cls) if n.startswith("sagellm_"))
                except SagellmError as exc:
                    problem = str(exc)
            summary = ep.dist.metadata["Summary"] if ep.dist else None
            found.append(
                InstalledPlugin(
                    group,
                    ep.name,
                    ep.value,
                    info.distribution or "?",
                    info.version or "?",
                    summary or "",
                    hooks,
                    problem,
                )
            )
    return found


#: The line above README.md's plugin table, which is ``sagellm plugins --markdown``.
README_TABLE_MARK = "<!-- the table below is `sagellm plugins --markdown`; a test keeps them equal -->"


def plugin_table(plugins: list[InstalledPlugin]) -> str:
    """The README's plugin table (Markdown): a row per distribution, the
    core's first, with its entry points and its summary."""
    by_dist: dict[str, list[InstalledPlugin]] = {}
    for plugin in plugins:
        by_dist.setdefault(plugin.distribution, []).append(plugin)
    rows = ["| distribution | entry points (`group`: names) | what it is |", "|---|---|---|"]
    for dist in sorted(by_dist, key=lambda d: (d != "sagellm-core", d)):
        groups: dict[str, list[str]] = {}
        for plugin in by_dist[dist]:
            groups.setdefault(plugin.group, []).append(f"`{plugin.name}`")
        points = "; ".join(f"`{group}`: {', '.join(names)}" for group, names in groups.items())
        rows.append(f"| `{dist}` | {points} | {by_dist[dist][0].summary} |")
    return "\n".join(rows) + "\n"


def cmd_plugins(args) -> int:
    plugins = installed_plugins()
    if args.as_json:
        print(json.dumps([attrs.asdict(p) for p in plugins], indent=2))
        return 0
    if args.as_markdown:
        print(plugin_table(plugins), end="")
        return 0
    columns = ("group", "name", "distribution", "version", "hooks")
    rows = [(p.group, p.name, p.distribution, p.version, p.problem or ", ".join(p.hooks) or "-") for p in plugins]
    console = Console()
    if not console.is_terminal:  # piped: one tab-separated line a plugin, nothing cut
        print("\t".join(columns))
        for row in rows:
            print("\t".join(row))
        return 0
    table = Table(title="installed sagellm plugins")
    for column in columns:
        # A narrow terminal folds a long name onto the next line, never cuts it.
        table.add_column(column, overflow="fold")
    for plugin, row in zip(plugins, rows):
        style = "yellow" if plugin.problem and plugin.problem.startswith("blocked") else "red" if plugin.problem else ""
        table.add_row(*row[:4], f"[{style}]{escape(row[4])}" if style else escape(row[4]))
    console.print(table)
    return 0


def _section(group: str) -> str:
    return next(section for section, (g, _) in registry.GROUPS.items() if g == group)


def check_config(settings: Settings) -> list[str]:
    """What ``sagellm config check`` prints for a config: the plugins it
    picks and who provides them, then every setting as resolved (the
    engine's with its defaults), so two configs that mean the same print the
    same. Builds the engine and the runtime, as a run would, to check them."""
    engine, engine_settings = build_engine(settings)
    rt = session.build_runtime(settings, engine, hook_timing=False)
    picked = ", ".join(f"{s}={p.selection.name}" for s, ps in rt.host.plugins.items() for p in ps)
    lines = [f"{settings.path}: ok (engine {settings.engine.name}; {picked})"]
    for section, loaded in rt.host.plugins.items():  # which distribution provides each (provenance)
        for p in loaded:
            params = f" {p.selection.params}" if p.selection.params else ""
            lines.append(
                f"  {section} {p.selection.name!r}: {p.info.distribution} {p.info.version} ({p.info.value}){params}"
            )
    if settings.router is not None:  # asked by an engine that runs several instances, not by the runtime
        info, params = Router(settings).info, settings.router.params
        lines.append(
            f"  router {settings.router.name!r}: {info.distribution} {info.version} ({info.value})"
            + (f" {params}" if params else "")
        )
    resolved = attrs.asdict(engine_settings) if attrs.has(type(engine_settings)) else engine_settings
    lines.append(f"  engine {settings.engine.name!r}: {resolved}")
    for field in attrs.fields(type(settings)):
        value = getattr(settings, field.name)
        if field.name in ("path", "passes", "sections") or isinstance(value, Selection):
            continue
        lines.append(f"  {field.name}: {attrs.asdict(value) if attrs.has(type(value)) else repr(value)}")
    for name, value in sorted(settings.sections.items()):  # the plugins' own sections ([server] ...)
        lines.append(f"  {name}: {attrs.asdict(value) if attrs.has(type(value)) else repr(value)}")
    return lines


def cmd_config_check(args) -> int:
    print("\n".join(check_config(session.load_settings(args.file, overrides=single_overrides(args)))))
    return 0


def cmd_hooks(args) -> int:
    """Print the hook reference (Markdown), generated from the hookspecs."""
    out = ["# Hook reference", "", "Generated by `sagellm hooks` from `sagellm_core/hookspecs.py`.", ""]
    out.append(inspect.getdoc(hookspecs) or "")
    for name in sorted(n for n in dir(hookspecs) if n.startswith("sagellm_")):
        fn = getattr(hookspecs, name)
        opts = getattr(fn, hookspecs.PROJECT + "_spec", {})
        kind = "decision (firstresult)" if opts.get("firstresult") else "observation / pipeline (all plugins)"
        out += ["", f"## `{name}{inspect.signature(fn)}`", "", f"*{kind}*", "", inspect.getdoc(fn) or ""]
    store = types.KVStore
    out += ["", "## KV stores: `sagellm_core.types.KVStore`", "", inspect.getdoc(store) or ""]
    for name in ("contains", "put", "get", "prefetch", "pin", "unpin", "remove", "stats"):
        fn = getattr(store, name)
        out += ["", f"### `{name}{inspect.signature(fn)}`", "", inspect.getdoc(fn) or ""]
    print("\n".join(out))
    return 0


COMMANDS_GROUP = "sagellm.commands"


def _plugin_commands(sub: argparse._SubParsersAction) -> None:
    """Let installed packages add subcommands. A blocked one is not even
    imported; one that fails to import or to register, or whose name two
    distributions register, is named on stderr and the other commands still
    work."""
    blocked = registry.blocked_names()
    seen: dict[str, list[str]] = {}
    eps = [
        ep for ep in metadata.entry_points(group=COMMANDS_GROUP) if not registry.is_blocked(ep.group, ep.name, blocked)
    ]
    for ep in eps:
        seen.setdefault(ep.name, []).append(f"{registry.describe(ep).distribution}")
    for ep in eps:
        where = f"{COMMANDS_GROUP} plugin {ep.name!r} ({ep.value})"
        if len(set(seen[ep.name])) > 1:
            _warn(f"{where} is registered by {', '.join(sorted(set(seen[ep.name])))}; none is loaded")
            continue
        try:
            module = ep.load()
            register = module.sagellm_register_commands
            register(subparsers=sub)
        except (Exception, SystemExit) as exc:
            _warn(f"{where} failed to load: {type(exc).__name__}: {exc}")


def _warn(message: str) -> None:
    print(f"sagellm: warning: {' '.join(message.split())}", file=sys.stderr)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line, as every sagellm error is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


#: ``--plot`` formats matplotlib writes.
PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")


def _check_outputs(args: argparse.Namespace) -> None:
    """Output paths are checked before a run, not after it (its results
    would be lost): their folder must exist, a plot's format be known."""
    given = [(flag, getattr(args, flag, None)) for flag in ("json", "markdown", "plot")]
    paths = [os.path.realpath(path) for _, path in given if path is not None]
    if len(set(paths)) != len(paths):
        raise SagellmError(f"{', '.join(f'--{f} {p}' for f, p in given if p is not None)}: one file each")
    for flag, path in given:
        if path is None:
            continue
        folder = Path(path).parent
        if not folder.is_dir() or Path(path).is_dir():
            raise SagellmError(f"--{flag} {path}: {'is a folder' if Path(path).is_dir() else f'no folder {folder}'}")
        if not os.access(path if Path(path).exists() else folder, os.W_OK):
            raise SagellmError(f"--{flag} {path}: not writable")
        suffix = Path(path).suffix.lower().lstrip(".")
        if flag == "plot" and suffix not in PLOT_FORMATS:
            raise SagellmError(f"--plot {path}: a file ending in {', '.join('.' + f for f in PLOT_FORMATS)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:  # before any plugin is imported
        print(f"sagellm {__version__}")
        return 0
    try:
        return _main(argv)
    except SagellmError as exc:
        print(f"sagellm: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    parser = _Parser(prog="sagellm", description="Pluggable KV-cache management for LLM serving.")
    parser.add_argument("--version", action="version", version=f"sagellm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def outputs(p):
        add_set_option(p)
        p.add_argument(
            "--trace", help="replay this trace (.jsonl Mooncake, .csv Azure) instead of the config's workload"
        )
        p.add_argument("--max-requests", type=int, help="replay only the first N requests")
        p.add_argument("--json", help="write the report as JSON here")
        p.add_argument("--markdown", help="write the report as a Markdown table here")
        p.add_argument("--plot", help="write hit rate and memory use over time here (PNG)")
        p.add_argument("--quiet", action="store_true", help="no progress bar or table")

    p = sub.add_parser("replay", help="replay a workload through the configured plugins")
    p.add_argument("--config", help="config file (default: the embedded default workload and plugins)")
    outputs(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("compare", help="replay the same workload under several configs, side by side")
    p.add_argument("--config", action="append", required=True, help="a config file (repeat)")
    add_workers_option(p)
    outputs(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("sweep", help="replay configs across the values of one config key, e.g. the pool size")
    p.add_argument("--config", action="append", required=True, help="a config file (repeat)")
    p.add_argument(
        "--figure",
        action="append",
        help="a report field to tabulate (repeat; dotted for nested, e.g. ttft_s.p99); the first is plotted."
        " Default: block_hit_rate",
    )
    add_workers_option(p)
    outputs(p)
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("plugins", help="list installed plugins and the hooks they implement")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", dest="as_json", help="print them as JSON, one object a plugin")
    form.add_argument(
        "--markdown",
        action="store_true",
        dest="as_markdown",
        help="print the README's plugin table: a row per distribution",
    )
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("hooks", help="print the hook reference (Markdown)")
    p.set_defaults(func=cmd_hooks)

    p = sub.add_parser("config", help="config file tools")
    csub = p.add_subparsers(dest="config_command", required=True)
    c = csub.add_parser("check", help="validate a config file and the plugins it picks")
    c.add_argument("file")
    add_set_option(c)
    c.set_defaults(func=cmd_config_check)

    _plugin_commands(sub)
    args = parser.parse_args(argv)
    if args.func.__module__ != __name__:
        return args.func(args)  # a plugin's command: its exits are its own
    _check_outputs(args)
    try:
        return args.func(args)
    except SystemExit as exc:  # sys.exit() inside a plugin that no checked call wrapped
        raise SagellmError(f"{_frame_outside_core(exc)} called sys.exit({exc.code!r}) during the run") from exc


def _frame_outside_core(exc: BaseException) -> str:
    """Where ``exc`` was raised: the innermost frame outside sagellm_core."""
    tb, where = exc.__traceback__, "a plugin"
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if not module.startswith("sagellm_core"):
            where = f"{module} (line {tb.tb_lineno})"
        tb = tb.tb_next
    return where
