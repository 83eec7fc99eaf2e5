"""What the engine plugins share: the contract of an ``[engine]`` plugin
(:class:`EnginePlugin`, and :class:`LiveEngine` for one that serves live
requests), building the one a config picks (:func:`build_engine`), the
check of an adapted engine's installed version, and the runtime a live
engine adapter runs (the config a user names, sized to the engine's own
pool)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Iterator
from importlib import metadata
from typing import Any, Protocol, runtime_checkable

import attrs

from sagellm_core import config as config_mod
from sagellm_core.config import Settings
from sagellm_core.drivers.recorder import Recorder
from sagellm_core.drivers.step_engine import Engine
from sagellm_core.errors import ConfigError, SagellmError
from sagellm_core.registry import PluginContext, build_settings, load_class
from sagellm_core.runtime import Runtime
from sagellm_core.types import Request

#: The environment variable naming the sagellm config of a live engine.
CONFIG_ENV = "SAGELLM_CONFIG"


@runtime_checkable
class EnginePlugin(Protocol):
    """What the class of a ``sagellm.engines`` entry point builds, from its
    ``Settings`` and a :class:`~sagellm_core.registry.PluginContext`."""

    #: The config sections the engine serves with its own machinery (vLLM's
    #: prefix cache and block pool): the runtime loads no plugin for them.
    owns: Collection[str]
    #: The sections it serves itself only where the config names no plugin
    #: (LMDeploy's trie and allocator).
    owns_unless_configured: Collection[str]

    def run(self, rt: Runtime, requests: Iterator[Request], on_request: Callable[[], None]) -> Recorder:
        """Replay ``requests`` (in arrival order) on ``rt``; call
        ``on_request`` as each one ends, finished or rejected."""
        ...


def sized_pool(settings: Settings, engine: Any) -> Settings:
    """``settings`` with ``[kv_pool] num_blocks = "auto"`` replaced by the
    pool the engine sized from its device's memory when it was built (its
    ``pool_blocks``); a one-line ConfigError for an engine that sizes none."""
    if settings.num_blocks != "auto":
        return settings
    blocks = getattr(engine, "pool_blocks", None)
    if not isinstance(blocks, int):
        raise ConfigError(
            f'{settings.path}: [kv_pool] num_blocks = "auto": engine {settings.engine.name!r} does not size the pool'
            " itself; give a number of blocks"
        )
    return attrs.evolve(settings, num_blocks=blocks)


@runtime_checkable
class LiveEngine(Protocol):
    """An engine plugin that also serves live requests (``sagellm serve``,
    ``sagellm generate``): the torch engine."""

    def start(self, rt: Runtime) -> Engine:
        """An :class:`~sagellm_core.drivers.step_engine.Engine` on ``rt``,
        on the wall clock, ready for requests."""
        ...


def build_engine(settings: Settings) -> tuple[EnginePlugin, Any]:
    """The engine plugin ``settings`` picks, built, and its settings; a
    one-line ConfigError if it cannot start or is not an engine plugin."""
    sel = settings.engine
    cls, _ = load_class("engine", sel.name, sel.where)
    engine_settings = build_settings(cls, sel.params, f"{sel.where} engine {sel.name!r}")
    try:
        instance = settings.instance
        context = PluginContext(
            sel.name, settings.block_size, settings.num_blocks, instance_id=instance.id, role=instance.role
        )
        engine = cls(engine_settings, context)
    except SagellmError:
        raise
    except (Exception, SystemExit) as exc:
        raise ConfigError(f"{sel.where}: engine {sel.name!r} failed to start: {type(exc).__name__}: {exc}") from exc
    if not isinstance(engine, EnginePlugin):
        missing = [name for name in ("run", "owns", "owns_unless_configured") if not hasattr(engine, name)]
        raise ConfigError(
            f"{sel.where}: engine {sel.name!r} is not an engine plugin (it lacks {', '.join(missing)};"
            " sagellm_core.drivers.engines.EnginePlugin)"
        )
    return engine, engine_settings


Version = tuple[int, ...]


def version_tuple(text: str) -> Version:
    """``"0.33.0+cpu"`` -> ``(0, 33, 0)``; a pre-release counts as its
    release (``"0.18.0rc1"`` -> ``(0, 18, 0)``)."""
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        leading = re.match(r"\d*", piece).group()
        parts.append(int(leading or 0))
    return tuple(parts)


def check_engine_version(engine: str, distribution: str, supported: tuple[Version, Version], hint: str) -> str:
    """The installed version of ``distribution``; a one-line ConfigError if
    it is missing or outside ``supported`` ([low, high))."""
    try:
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        raise ConfigError(f"engine {engine!r}: {distribution} is not installed ({hint})") from None
    low, high = supported
    if not low <= version_tuple(version) < high:
        fmt = ".".join
        raise ConfigError(
            f"engine {engine!r}: {distribution} {version} is outside the tested range"
            f" >={fmt(map(str, low))},<{fmt(map(str, high))} ({hint})"
        )
    return version


def load_engine_runtime(
    num_blocks: int,
    block_size: int,
    *,
    engine_owns: Collection[str],
    path: str | None = None,
    where: str,
    how: str = f"set {CONFIG_ENV}",
    unless_configured: Collection[str] = (),
) -> Runtime:
    """The runtime for the config at ``path`` (else ``$SAGELLM_CONFIG``).
    The engine's pool size and block size replace the config's: inside an
    engine they are the engine's to decide. The engine serves the sections
    ``engine_owns`` itself, and those of ``unless_configured`` the config
    names no plugin for. ``how`` tells a user how to name a config when
    there is none."""
    path = path or os.environ.get(CONFIG_ENV)
    if not path:
        raise ConfigError(f"{where}: no sagellm config; {how}")
    settings = attrs.evolve(config_mod.load(path), num_blocks=num_blocks, block_size=block_size)
    return Runtime(settings, engine_owns=engine_sections(settings, engine_owns, unless_configured))


def engine_sections(
    settings: Settings, engine_owns: Collection[str], unless_configured: Collection[str] = ()
) -> set[str]:
    """The sections an engine serves itself under ``settings``: ``engine_owns``,
    and those of ``unless_configured`` that name no plugin."""
    return {*engine_owns, *(s for s in unless_configured if getattr(settings, s) is None)}
