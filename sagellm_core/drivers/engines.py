"""What every engine adapter needs from the core: a check of the engine's
installed version against the range the adapter was tested with, and the
runtime a live engine runs (the config a user names, sized to the engine's
own pool)."""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from importlib import metadata

import attrs

from sagellm_core import config as config_mod
from sagellm_core.config import Settings
from sagellm_core.errors import ConfigError
from sagellm_core.runtime import Runtime

#: The environment variable naming the sagellm config of a live engine.
CONFIG_ENV = "SAGELLM_CONFIG"

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
