"""The kernel stays one sitting's read: the top-level modules of
sagellm_core, under 2,250 lines with docstrings, importing nothing from the
packages built on it (replay, cli, drivers, kit)."""

import ast
from pathlib import Path

# The source tree's, not an installed copy's (a tox env installs a wheel).
CORE = Path(__file__).resolve().parents[2] / "sagellm_core"
KERNEL = sorted(CORE.glob("*.py"))
BUILT_ON_IT = ("sagellm_core.replay", "sagellm_core.cli", "sagellm_core.drivers", "sagellm_core.kit")


def imported_modules(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_kernel_is_under_2250_lines():
    lines = {path.name: len(path.read_text().splitlines()) for path in KERNEL}
    assert {"hookspecs.py", "types.py", "registry.py", "config.py", "plugin_host.py", "runtime.py"} <= set(lines)
    assert sum(lines.values()) < 2250, lines


def test_the_kernel_imports_nothing_built_on_it():
    for path in KERNEL:
        found = [m for m in imported_modules(path.read_text()) if m.startswith(BUILT_ON_IT)]
        assert not found, f"{path.name} imports {found}"


def test_the_import_scan_sees_a_planted_import():
    planted = "from sagellm_core.replay import workloads\nimport sagellm_core.cli\n"
    assert {"sagellm_core.replay", "sagellm_core.cli"} <= imported_modules(planted)
