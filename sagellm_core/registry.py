"""Plugin discovery through ``importlib.metadata`` entry points.

One entry point group per decision. An entry point's name is the plugin name a
config file uses; its object is a plugin *class*:

.. code-block:: python

    @attrs.frozen
    class Settings:          # optional; validates the plugin's parameters
        capacity: int = 100

    class MyPolicy:
        Settings = Settings
        def __init__(self, settings: Settings, context: PluginContext): ...

        @hookimpl
        def sagellm_select_victims(self, num_blocks, candidates): ...

Only plugins the config selects are imported. ``SAGELLM_BLOCK_PLUGINS`` (comma
separated ``name`` or ``group:name``) blocks plugins of every ``sagellm.*``
group (commands and workloads too) even when selected; an item that matches
no installed plugin is an error, not ignored. Provenance: a name that two
distributions register in one group is refused when it is used, naming both
(docs/threat-model.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from typing import Any

import attrs

from sagellm_core.errors import ConfigError, PluginStartError
from sagellm_core.types import Request

BLOCK_ENV = "SAGELLM_BLOCK_PLUGINS"

#: config section -> (entry point group, the first-party distribution for it;
#: engines other than the embedded replay come with their adapters)
GROUPS: dict[str, tuple[str, str]] = {
    "engine": ("sagellm.engines", "sagellm-plugin-{name}"),
    "prefix_cache": ("sagellm.prefix_cache", "sagellm-plugin-prefix-cache"),
    "kv_pool": ("sagellm.kv_pool", "sagellm-plugin-kv-pool"),
    "eviction": ("sagellm.eviction", "sagellm-plugin-eviction"),
    "lifetime": ("sagellm.lifetime", "sagellm-plugin-lifetime"),
    "scheduler": ("sagellm.scheduler_passes", "sagellm-plugin-scheduler-ir"),
    "admission": ("sagellm.admission", "sagellm-plugin-admission"),
    "transport": ("sagellm.transport", "sagellm-plugin-kv-transport"),
    "router": ("sagellm.router", "sagellm-plugin-cluster"),
    "kv_stores": ("sagellm.kv_stores", "sagellm-plugin-kv-stores"),
}


@attrs.frozen
class PluginContext:
    """What every plugin is told when it is built."""

    name: str
    block_size: int
    num_blocks: int
    seed: int = 0
    #: The requests the run will replay, in arrival order, read anew on each
    #: call: an offline oracle (Belady) reads the future from it. ``None``
    #: where the future is unknown (a live engine, a server).
    future_requests: Callable[[], Iterable[Request]] | None = None
    #: The folder of the config file that picked the plugin (relative paths
    #: among its parameters are resolved from it); ``None`` without a file.
    config_dir: str | None = None
    #: Which runtime of a cluster the plugin serves (``[instance]``): its id,
    #: and its role, one of :data:`ROLES`.
    instance_id: str = "0"
    role: str = "colocated"


#: An instance serves whole requests (``colocated``), or the prefill or the
#: decode half of disaggregated serving.
ROLES = ("colocated", "prefill", "decode")


@attrs.frozen
class NoSettings:
    """Settings of a plugin that takes no parameters."""


@attrs.frozen
class PluginInfo:
    group: str
    name: str
    value: str
    distribution: str | None
    version: str | None


#: The groups a block-list item may name: the decisions', and those that
#: add workloads, commands, the torch engine's devices, replay executors,
#: where a served cluster's instances run and its transports between processes.
BLOCKABLE = (
    *(g for g, _ in GROUPS.values()),
    "sagellm.workloads",
    "sagellm.commands",
    "sagellm.sections",
    "sagellm.torch_devices",
    "sagellm.executors",
    "sagellm.placements",
    "sagellm.cluster_transport",
)


def blocked_names() -> set[str]:
    """The items of ``SAGELLM_BLOCK_PLUGINS``; one that matches no installed
    plugin (``LRU``, ``eviction:lru``) is a ConfigError naming it."""
    raw = os.environ.get(BLOCK_ENV, "")
    items = {item.strip() for item in raw.split(",") if item.strip()}
    if items:
        eps = [ep for group in BLOCKABLE for ep in metadata.entry_points(group=group)]
        known = {n for ep in eps for n in (ep.name, f"{ep.group}:{ep.name}")}
        stray = sorted(items - known)
        if stray:
            raise ConfigError(
                f"{BLOCK_ENV}: {', '.join(map(repr, stray))} match no installed plugin"
                " (spell NAME or GROUP:NAME, e.g. lru or sagellm.eviction:lru; `sagellm plugins` lists them)"
            )
    return items


def is_blocked(group: str, name: str, blocked: set[str] | None = None) -> bool:
    blocked = blocked_names() if blocked is None else blocked
    return name in blocked or f"{group}:{name}" in blocked


def installed(group: str) -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in reversed(metadata.entry_points(group=group))}


def find(group: str, name: str, where: str) -> metadata.EntryPoint | None:
    """The entry point ``name`` of ``group`` (``None`` if none is installed),
    refused if blocked or if two distributions register it."""
    if is_blocked(group, name):
        raise ConfigError(f"{where}: plugin {name!r} ({group}) is blocked by {BLOCK_ENV}")
    eps = [ep for ep in metadata.entry_points(group=group) if ep.name == name]
    dists = sorted({f"{i.distribution} {i.version}" for i in map(describe, eps)})
    if len(dists) > 1:
        raise ConfigError(
            f"{where}: plugin {name!r} ({group}) is registered by {len(dists)} distributions: {', '.join(dists)};"
            " sagellm refuses to choose: uninstall all but one"
        )
    return eps[0] if eps else None


def describe(ep: metadata.EntryPoint) -> PluginInfo:
    dist = ep.dist
    return PluginInfo(
        group=ep.group,
        name=ep.name,
        value=ep.value,
        distribution=dist.metadata["Name"] if dist else None,
        version=dist.version if dist else None,
    )


def load_class(section: str, name: str, where: str) -> tuple[type, PluginInfo]:
    """Import the class of plugin ``name`` selected in ``section``."""
    group, dist = GROUPS[section]
    ep = find(group, name, where)
    if ep is None:
        names = ", ".join(sorted(installed(group))) or "none"
        raise ConfigError(
            f"{where}: unknown {section} plugin {name!r}; installed: {names}"
            f" (first-party {section} plugins: pip install {dist.format(name=name)})"
        )
    try:
        cls = ep.load()
    except (Exception, SystemExit) as exc:  # an import error inside a third-party plugin
        raise PluginStartError(
            f"{where}: plugin {name!r} ({ep.value}) failed to import: {type(exc).__name__}: {exc}"
        ) from exc
    return cls, describe(ep)


def build_settings(cls: type, params: Mapping[str, Any], where: str) -> Any:
    """Validate ``params`` with the plugin's ``Settings`` attrs class."""
    settings_cls = getattr(cls, "Settings", NoSettings)
    accepted = [a.name for a in attrs.fields(settings_cls)]
    for key in params:
        if key not in accepted:
            ok = ", ".join(accepted) or "no parameters"
            raise ConfigError(f"{where}: unknown parameter {key!r}; accepted: {ok}")
    floats = {a.name for a in attrs.fields(settings_cls) if a.type in (float, "float")}
    params = {k: float(v) if k in floats and type(v) is int else v for k, v in params.items()}
    try:
        return settings_cls(**params)
    except (TypeError, ValueError) as exc:
        # Find the parameter at fault: the first that fails on its own.
        for key, value in params.items():
            try:
                settings_cls(**{key: value})
            except (TypeError, ValueError) as alone:
                raise ConfigError(f"{where}: bad value {key} = {value!r}: {alone.args[0]}") from exc
        raise ConfigError(f"{where}: {exc}") from exc
