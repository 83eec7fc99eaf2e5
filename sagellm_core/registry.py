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
separated ``name`` or ``group:name``) blocks plugins even when selected.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from typing import Any

import attrs

from sagellm_core.errors import ConfigError
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
    "transport": ("sagellm.transport", "sagellm-plugin-kv-transport"),
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


def blocked_names() -> set[str]:
    raw = os.environ.get(BLOCK_ENV, "")
    return {item.strip() for item in raw.split(",") if item.strip()}


def is_blocked(group: str, name: str) -> bool:
    blocked = blocked_names()
    return name in blocked or f"{group}:{name}" in blocked


def installed(group: str) -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=group)}


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
    available = installed(group)
    if is_blocked(group, name):
        raise ConfigError(f"{where}: plugin {name!r} ({group}) is blocked by {BLOCK_ENV}")
    if name not in available:
        names = ", ".join(sorted(available)) or "none"
        raise ConfigError(
            f"{where}: unknown {section} plugin {name!r}; installed: {names}"
            f" (first-party {section} plugins: pip install {dist.format(name=name)})"
        )
    ep = available[name]
    try:
        cls = ep.load()
    except Exception as exc:  # an import error inside a third-party plugin
        raise ConfigError(
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
