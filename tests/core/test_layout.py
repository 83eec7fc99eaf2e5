"""The kernel by concept (docs/decisions.md, "What the kernel is"): every
top-level module of sagellm_core is one named concept in one of four
layers, a layer imports only from itself and the layers below it, each
layer keeps to its line budget, and the kernel imports nothing from the
packages built on it (replay, cli, drivers, kit)."""

import ast
from pathlib import Path

# The source tree's, not an installed copy's (a tox env installs a wheel).
CORE = Path(__file__).resolve().parents[2] / "sagellm_core"
KERNEL = sorted(CORE.glob("*.py"))
BUILT_ON_IT = ("sagellm_core.replay", "sagellm_core.cli", "sagellm_core.drivers", "sagellm_core.kit")

#: Layer -> {module: the concept it is}, lowest layer first.
LAYERS: dict[str, dict[str, str]] = {
    "contract": {
        "errors": "the one-line errors",
        "lengths": "a lifetime prediction's length distribution",
        "types": "the value types plugins exchange, the KV store protocol",
        "hookspecs": "the hooks: every decision and observation",
    },
    "settings": {"registry": "plugins found by entry point", "config": "the config file, typed and checked"},
    "plugin host": {
        "timing": "the hook timer",
        "watchdog": "the per-call time limit",
        "dispatch": "hook calls from cached plans",
        "checks": "what is wrong with a plugin's answer",
        "counters": "what the runtime counts",
        "ledger": "the ground truth of blocks",
        "plugin_host": "the plugins behind checked calls",
    },
    "lifecycle": {
        "stores": "the KV stores below the device pool, as the runtime uses them (write rules, verified loads, prefetch)",
        "compaction": "a compacting pool's moves, checked and carried out",
        "runtime": "the request lifecycle: the drivers' API",
    },
}
#: Lines per layer, docstrings included: a layer that outgrows its budget
#: is doing a second thing, which belongs in a module of its own concept
#: (or outside the kernel), not squeezed in.
BUDGET = {"contract": 1070, "settings": 750, "plugin host": 1300, "lifecycle": 1035}
LAYER_OF = {module: layer for layer, modules in LAYERS.items() for module in modules}


def imported_modules(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def kernel_imports(source: str) -> set[str]:
    """The kernel modules ``source`` imports (``sagellm_core.X`` or ``from sagellm_core import X``)."""
    found = set()
    for name in imported_modules(source):
        parts = name.split(".")
        if parts[0] == "sagellm_core" and len(parts) > 1 and parts[1] in LAYER_OF:
            found.add(parts[1])
    return found


def test_every_kernel_module_is_a_concept_of_a_layer():
    modules = {path.stem for path in KERNEL} - {"__init__"}
    assert modules == set(LAYER_OF), (
        f"unplaced: {sorted(modules - set(LAYER_OF))}, gone: {sorted(set(LAYER_OF) - modules)}"
    )


def test_a_layer_imports_only_from_itself_and_the_layers_below():
    order = list(LAYERS)
    found = []
    for path in KERNEL:
        if path.stem == "__init__":
            continue
        rank = order.index(LAYER_OF[path.stem])
        for imported in kernel_imports(path.read_text()):
            if order.index(LAYER_OF[imported]) > rank:
                found.append(f"{path.stem} ({LAYER_OF[path.stem]}) imports {imported} ({LAYER_OF[imported]})")
    assert not found, found


def test_each_layer_keeps_to_its_budget():
    lines = {path.stem: len(path.read_text().splitlines()) for path in KERNEL}
    for layer, modules in LAYERS.items():
        total = sum(lines[m] for m in modules)
        assert total <= BUDGET[layer], (
            f"{layer}: {total} lines, budget {BUDGET[layer]}: { {m: lines[m] for m in modules} }"
        )


def test_the_kernel_imports_nothing_built_on_it():
    for path in KERNEL:
        found = [m for m in imported_modules(path.read_text()) if m.startswith(BUILT_ON_IT)]
        assert not found, f"{path.name} imports {found}"


def test_the_import_scans_see_planted_imports():
    planted = "from sagellm_core.replay import workloads\nimport sagellm_core.cli\nfrom sagellm_core import runtime\n"
    assert {"sagellm_core.replay", "sagellm_core.cli"} <= imported_modules(planted)
    assert kernel_imports(planted) == {"runtime"}
