"""The file ``sagellm serve --cluster FILE`` reads: the instances of a
cluster, each a torch engine with a sagellm config of its own, and the
router that picks one for each request.

.. code-block:: toml

    # Seconds each instance may take to load its model and answer /health.
    start_timeout_s = 300
    # Prefill and decode instances: how long a prefill instance holds a
    # prompt's blocks for the decode instance to pull, and how long a pull
    # may take before the decode instance computes the prompt itself.
    lease_s = 30
    pull_timeout_s = 10
    # How their KV goes between processes: a sagellm.cluster_transport
    # plugin, "gloo" (the default), "mooncake" or "nixl".
    transport = "gloo"
    # Where the instances run: a sagellm.placements plugin, "local" (the
    # default: processes on this machine) or "ray" (Ray actors on the
    # machines of a Ray cluster; pip install sagellm-plugin-ray).
    placement = "local"
    # Prefill and decode instances only on the front's machine (a placement
    # that places across machines, ray, puts them anywhere otherwise).
    pd_on_front_node = false

    [router]                  # as a sagellm config's [router]: a sagellm.router plugin and its keys
    plugin = "kv-aware"

    [[instance]]
    config = "instance.toml"  # a sagellm config whose [engine] is torch; relative to this file
    role = "colocated"        # colocated (the default), prefill or decode
    count = 2                 # instances started from this config; 1 by default
    num_cpus = 1              # what each reserves where the placement places by resources
    num_gpus = 0              # (ray: the actor's num_cpus and num_gpus); 1 and 0 by default
    host = "10.0.0.5"         # local placement, prefill/decode: the address its transport binds and
                              # advertises (an address of this machine); the one it serves on by default

A prefill or decode instance's transport binds on an address its peers reach
it at, and publishes it on its link: the placement's (the node's address
under ray, loopback under local) unless ``host`` names another.

A colocated instance serves whole requests. A prefill instance computes a
prompt and lends its blocks; a decode instance pulls them over the file's
transport (:mod:`.transports`; one link per prefill-decode pair, its
control messages on the front's store) and generates; give both or neither.

Every instance's config must name the same model and the same
``[prefix_cache]`` (plugin and block size): the router's index matches a
prompt's block keys, computed once, against every instance's cache.
Each error names the file and the key, in one line.
"""

from __future__ import annotations

import socket
import tomllib
from pathlib import Path
from typing import Any

from attrs import frozen

from sagellm_core import config as config_mod
from sagellm_core.config import Settings
from sagellm_core.drivers import placement as placement_mod
from sagellm_core.drivers.router import Router
from sagellm_core.errors import ConfigError, SagellmError

from . import transports

ROLES = ("colocated", "prefill", "decode")
TOP_KEYS = (
    "start_timeout_s",
    "lease_s",
    "pull_timeout_s",
    "transport",
    "placement",
    "pd_on_front_node",
    "router",
    "instance",
)
INSTANCE_KEYS = ("config", "role", "count", "num_cpus", "num_gpus", "host")


@frozen
class InstanceSpec:
    #: ``<config file stem>-<n>``: unique in the cluster.
    instance_id: str
    role: str
    config_path: Path
    settings: Settings
    #: What the instance reserves where its placement places by resources.
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    #: The address its transport binds and advertises (``None``: the one it serves on).
    host: str | None = None


@frozen
class ClusterSpec:
    path: Path
    instances: tuple[InstanceSpec, ...]
    #: The file's ``[router]``, built on the first instance's config (the
    #: core's ``Router`` reads the block size there).
    router: Router
    start_timeout_s: float
    lease_s: float = 30.0
    pull_timeout_s: float = 10.0
    #: A ``sagellm.cluster_transport`` plugin's name, checked to be installed
    #: (its third-party package is imported when the cluster starts).
    transport: str = transports.DEFAULT
    #: A ``sagellm.placements`` plugin's name, checked to be installed.
    placement: str = "local"
    #: Prefill and decode instances placed on the front's machine only.
    pd_on_front_node: bool = False

    def links(self, instance: InstanceSpec) -> tuple[str, ...]:
        """The links of a prefill or decode instance: one per peer of the other role."""
        other = {"prefill": "decode", "decode": "prefill"}.get(instance.role)
        peers = [i.instance_id for i in self.instances if i.role == other]
        if instance.role == "prefill":
            return tuple(link_name(instance.instance_id, d) for d in peers)
        return tuple(link_name(p, instance.instance_id) for p in peers)


def link_name(prefill_id: str, decode_id: str) -> str:
    return f"{prefill_id}>{decode_id}"


def _unknown(where: str, table: dict[str, Any], accepted: tuple[str, ...]) -> None:
    for key in table:
        if key not in accepted:
            raise ConfigError(f"{where}: unknown key {key!r}; accepted: {', '.join(accepted)}")


def _cache_of(settings: Settings) -> tuple[str | None, int]:
    return (settings.prefix_cache.name if settings.prefix_cache else None, settings.block_size)


def load(path: str | Path) -> ClusterSpec:
    """The cluster file at ``path``, checked; a :class:`ConfigError` naming
    the file and the key otherwise."""
    path = Path(path)
    try:
        table = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--cluster {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not TOML: {exc}") from None
    _unknown(str(path), table, TOP_KEYS)
    seconds = {key: _seconds(path, table, key, default) for key, default in _SECONDS.items()}
    transport = table.get("transport", transports.DEFAULT)
    transports.find(transport, f"{path}: transport")
    placement = table.get("placement", "local")
    placement_mod.find(placement, f"{path}: placement")
    pd_on_front_node = table.get("pd_on_front_node", False)
    if not isinstance(pd_on_front_node, bool):
        raise ConfigError(f"{path}: pd_on_front_node = {pd_on_front_node!r}: true or false")
    router = table.get("router")
    if not isinstance(router, dict) or not isinstance(router.get("plugin"), str):
        raise ConfigError(f'{path}: [router] plugin: missing; name a sagellm.router plugin (e.g. "kv-aware")')
    tables = table.get("instance")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{path}: [[instance]]: missing; give one table per instance config")
    instances: list[InstanceSpec] = []
    for n, spec in enumerate(tables):
        where = f"{path}: instance[{n}]"
        _unknown(where, spec, INSTANCE_KEYS)
        role = spec.get("role", "colocated")
        if role not in ROLES:
            raise ConfigError(f"{where}.role = {role!r}: accepted: {', '.join(ROLES)}")
        count = spec.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 64:
            raise ConfigError(f"{where}.count = {count!r}: a whole number in [1, 64]")
        resources = {
            key: _resource(where, spec, key, default) for key, default in (("num_cpus", 1.0), ("num_gpus", 0.0))
        }
        host = _host(where, spec, role, placement)
        given = spec.get("config")
        if not isinstance(given, str):
            raise ConfigError(f"{where}.config: missing; name a sagellm config whose [engine] is torch")
        config_path = (path.parent / given).resolve()
        if not config_path.is_file():
            raise ConfigError(f"{where}.config = {given!r}: no file {config_path}")
        try:
            settings = config_mod.load(config_path)
        except SagellmError as exc:
            raise ConfigError(f"{where}.config = {given!r}: {exc}") from None
        if settings.engine.name != "torch":
            raise ConfigError(f"{where}.config = {given!r}: [engine] name = {settings.engine.name!r}; give torch")
        if instances:
            first = instances[0]
            for what, mine, theirs in (
                ("[engine] model", settings.engine.params.get("model"), first.settings.engine.params.get("model")),
                ("[prefix_cache] (plugin, block size)", _cache_of(settings), _cache_of(first.settings)),
            ):
                if mine != theirs:
                    raise ConfigError(
                        f"{where}.config = {given!r}: {what} {mine!r} differs from {first.config_path.name}'s"
                        f" {theirs!r}; the router matches one prompt's block keys on every instance"
                    )
        stem = config_path.stem
        taken = sum(1 for i in instances if i.config_path.stem == stem)
        instances += [
            InstanceSpec(f"{stem}-{taken + k}", role, config_path, settings, **resources, host=host)
            for k in range(count)
        ]
    roles = {i.role for i in instances}
    if ("prefill" in roles) != ("decode" in roles):
        raise ConfigError(
            f"{path}: [[instance]] role: prefill instances hand their KV to decode instances; give both or neither"
        )
    ids = [i.instance_id for i in instances]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{path}: [[instance]]: two configs share a file name ({', '.join(ids)}); rename one")
    try:
        built = Router(config_mod.load(instances[0].config_path, {("router",): router}))
    except SagellmError as exc:
        raise ConfigError(f"{path}: [router]: {exc}") from None
    return ClusterSpec(
        path,
        tuple(instances),
        built,
        transport=transport,
        placement=placement,
        pd_on_front_node=pd_on_front_node,
        **seconds,
    )


#: The file's durations and their defaults, in seconds.
_SECONDS = {"start_timeout_s": 300.0, "lease_s": 30.0, "pull_timeout_s": 10.0}


def _seconds(path: Path, table: dict[str, Any], key: str, default: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 86_400:
        raise ConfigError(f"{path}: {key} = {value!r}: seconds in (0, 86400)")
    return float(value)


def _resource(where: str, table: dict[str, Any], key: str, default: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1024:
        raise ConfigError(f"{where}.{key} = {value!r}: a number in [0, 1024]")
    return float(value)


def _host(where: str, table: dict[str, Any], role: str, placement: str) -> str | None:
    """An instance's ``host``: an address of this machine that a socket
    binds (the local placement's instances run here); ``None`` if not given."""
    if "host" not in table:
        return None
    host = table["host"]
    if role == "colocated":
        raise ConfigError(f"{where}.host = {host!r}: only a prefill or decode instance's transport binds one")
    if placement != "local":
        raise ConfigError(
            f"{where}.host = {host!r}: placement = {placement!r} serves each instance on its node's address;"
            " host is for the local placement"
        )
    if not isinstance(host, str) or not host or any(c.isspace() for c in host) or len(host) > 255:
        raise ConfigError(f"{where}.host = {host!r}: an address of this machine (IPv4, IPv6 or a host name)")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as probe:
            probe.bind((host, 0))
    except (OSError, UnicodeError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
        raise ConfigError(f"{where}.host = {host!r}: not an address of this machine ({reason})") from None
    return host
