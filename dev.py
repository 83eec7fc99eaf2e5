#!/usr/bin/env python3
"""Set-up and entry point for a fresh machine with only Python.

    python dev.py replay [ARGS]   # the main job: `sagellm replay` on the embedded default
    python dev.py test [ARGS]     # ruff (format, lint), mypy --strict on the kernel, then pytest
    python dev.py sagellm ARGS    # any sagellm command
    python dev.py tox [ARGS]      # tox (per-plugin environments)

The first call makes `.venv` and installs the core, every plugin under
plugins/ and the contrib packages (editable) with the test tools; later calls reuse it, and reinstall
only when a pyproject.toml changed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
STAMP = VENV / ".sagellm-installed"
TORCH = "2.13.0"


def projects() -> list[Path]:
    """The core, every plugin under plugins/, and the contrib packages."""
    found = [*(ROOT / "plugins").glob("*/pyproject.toml"), *(ROOT / "contrib").glob("*/pyproject.toml")]
    return [ROOT, *sorted(p.parent for p in found)]


def fingerprint() -> str:
    digest = hashlib.sha256()
    for project in projects():
        digest.update((project / "pyproject.toml").read_bytes())
    return digest.hexdigest()


def ensure_env() -> None:
    if STAMP.exists() and STAMP.read_text() == fingerprint():
        return
    if not (BIN / "python").exists():
        print(f"dev.py: creating {VENV}", file=sys.stderr)
        venv.EnvBuilder(with_pip=True).create(VENV)
    pip = [str(BIN / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    editable = []
    for project in projects():
        # With its own test extra where it declares one (the server's tests
        # need the openai client).
        extras = (
            tomllib.loads((project / "pyproject.toml").read_text()).get("project", {}).get("optional-dependencies", {})
        )
        editable += ["-e", str(project) + ("[test]" if "test" in extras else "")]
    print("dev.py: installing sagellm-core and plugins into .venv", file=sys.stderr)
    # The CPU build of torch first, pinned as the tox envs pin it: the torch
    # engine plugin needs torch, and an unpinned install would fetch the
    # newest build with several GB of CUDA libraries.
    subprocess.run([*pip, "tox>=4", f"torch=={TORCH}"], check=True)
    subprocess.run([*pip, *editable], check=True)
    STAMP.write_text(fingerprint())


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
    ensure_env()
    command, rest = argv[0], argv[1:]
    if command == "replay":
        args = [str(BIN / "sagellm"), "replay", *rest]
    elif command == "sagellm":
        args = [str(BIN / "sagellm"), *rest]
    elif command == "test":
        for check in hygiene():
            code = subprocess.run(check, cwd=ROOT).returncode
            if code:
                print(f"dev.py: {Path(check[0]).name} {check[1]} found problems (see above)", file=sys.stderr)
                return code
        args = [str(BIN / "python"), "-m", "pytest", *rest]
    else:
        args = [str(BIN / "tox"), *rest]
    return subprocess.run(args, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
