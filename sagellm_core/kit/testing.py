"""Helpers for testing plugins, for this project and for plugin authors.

``declare_plugins`` writes a minimal ``*.dist-info`` with entry points into a
folder and puts it on ``sys.path``: ``importlib.metadata`` then finds the
plugins exactly as it finds installed ones, without installing anything.
"""

from __future__ import annotations

import importlib
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

from sagellm_core import config as config_mod
from sagellm_core.config import Settings
from sagellm_core.hookspecs import hookimpl
from sagellm_core.kit.eviction import PriorityEviction
from sagellm_core.types import CachedBlock, EvictionDecision, PreemptionDecision, Request


def declare_plugins(folder: Path, entry_points: dict[str, dict[str, str]], name: str = "sagellm-test-plugins") -> None:
    """Declare ``{group: {plugin name: "module:Class"}}`` as the entry points
    of a distribution ``name`` found in ``folder``."""
    dist = Path(folder) / f"{name.replace('-', '_')}-0.0.1.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n")
    lines = []
    for group, plugins in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{plugin} = {target}" for plugin, target in plugins.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    importlib.invalidate_caches()


def settings_from_toml(text: str, path: str = "<test>") -> Settings:
    """Parse config text as if it were a file at ``path``."""
    return config_mod.parse(tomllib.loads(text), path)


def junit_results(
    report: Path, name=lambda case: f"{case.get('classname', '')}::{case.get('name')}"
) -> tuple[int, dict[str, str]]:
    """From a pytest ``--junitxml`` report: the number of tests run (skips
    aside) and ``{test name: first line of its failure}`` for those that
    failed or errored. For adapters that run an engine's own test suite."""
    failed, total = {}, 0
    for case in ET.parse(report).iter("testcase"):
        if case.find("skipped") is not None:
            continue
        total += 1
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            message = (problem.get("message") or "").strip().splitlines()
            failed[name(case)] = message[0][:160] if message else problem.tag
    return total, failed


class OldestFirstPreemption(PriorityEviction):
    """An eviction plugin that preempts the running request that arrived
    first (vLLM and LMDeploy take the last), and evicts in LRU order (the
    eviction base, every block alike): for checking that an engine adapter
    hands the preemption choice over. Declare it with
    :func:`declare_plugins` as
    ``"sagellm_core.kit.testing:OldestFirstPreemption"``."""

    monotone = True

    def priority(self, block, now_s):
        return 0

    @hookimpl
    def sagellm_select_preemption(self, running, needed_by):
        return PreemptionDecision(min(running, key=lambda s: s.request.arrival_s).request_id)


class StrangerVictims:
    """An eviction plugin that names a block no cache holds (10,000): for
    checking that a runtime or an engine adapter reports the plugin by name
    and loses no block. Declare it with :func:`declare_plugins` as
    ``"sagellm_core.kit.testing:StrangerVictims"``."""

    def __init__(self, settings, context):
        pass

    @hookimpl
    def sagellm_select_victims(self, num_blocks, candidates):
        return EvictionDecision((10_000,))


class BlockIds:
    """Fresh block ids in order, as an empty pool hands them out."""

    def __init__(self, first: int = 0):
        self.next = first

    def take(self, n: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def serve_prompt(cache, request: Request, block_size: int, block_ids: BlockIds) -> tuple[CachedBlock, ...]:
    """Serve ``request`` through a prefix-cache plugin as the runtime does,
    without a pool: acquire its cached prefix, insert its full blocks (the
    uncached ones from ``block_ids``), release it. Returns the released
    blocks (what an eviction policy is told became evictable)."""
    match = cache.sagellm_acquire_prefix(request=request)
    full = request.num_prompt_tokens // block_size
    ids = [*match.block_ids, *block_ids.take(full - match.num_blocks)]
    cache.sagellm_insert_prefix(request=request, token_ids=request.prompt_token_ids, block_ids=ids)
    return cache.sagellm_release_prefix(request=request)
