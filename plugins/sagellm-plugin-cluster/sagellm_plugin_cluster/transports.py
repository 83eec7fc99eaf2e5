"""The byte movers of KV transfers between processes, each a plugin of the
``sagellm.cluster_transport`` entry point group, picked per cluster file
(``transport = "gloo" | "mooncake" | "nixl"``).

A transport keeps the contract of :mod:`.transfer` (the decode side pulls,
the prefill side holds the blocks under a lease, every transfer ends done,
failed or expired within its deadline) with control messages on the front's
``TCPStore``; what differs is how the bytes go. An entry point names a
:class:`Transport`: the third-party module it needs, the ``pip install`` that
provides it, and the module that implements it, which holds two classes:

* ``PrefillServer(rt, kv, store, link, *, lease_s, send_timeout_s, faults, host)``
  (:class:`PrefillSide`): leases and offers a prompt's blocks, serves
  pulls, ends every lease;
* ``DecodePuller(rt, kv, store, link, *, faults, clock, host)``
  (:class:`DecodeSide`): pulls a prompt's blocks into a landing.

``host`` is the address of this machine the side's library binds (loopback
by default; the node's address across machines); each side publishes it
through what its peer already reads (gloo's rendezvous keys on the store,
the in-place transports' ``peer`` description).

A descriptor imports nothing heavy, so that a cluster file is checked
(:func:`find`) without the transport's package, and a missing package is
one line naming its ``pip install`` (:meth:`Transport.check`)."""

from __future__ import annotations

import datetime
import importlib
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any, Protocol

import attrs

from sagellm_core import registry
from sagellm_core.errors import ConfigError
from sagellm_core.types import Request

from .transfer import Leases, TransferCounts, TransferStatus

GROUP = "sagellm.cluster_transport"
DEFAULT = "gloo"


class PrefillSide(Protocol):
    leases: Leases

    def offer(self, request: Request, now_s: float) -> int:
        """Lease ``request``'s cached prompt blocks and offer them; the
        blocks offered (0: none, the decode side computes)."""
        ...

    def poll(self, now_s: float) -> None:
        """Serve claimed leases; end those past their deadline."""
        ...

    @property
    def busy(self) -> bool:
        """A lease is still open."""
        ...

    def figures(self) -> dict[str, int]:
        """The transport's own counts (sends, failed sends ...), JSON values."""
        ...


class DecodeSide(Protocol):
    counts: TransferCounts

    def num_blocks_available(self, request: Request) -> int: ...

    def wait_for_offer(self, request: Request, timeout_s: float) -> bool: ...

    def pull(self, request: Request, timeout_s: float) -> TransferStatus:
        """Pull ``request``'s prompt blocks into this instance's prefix
        cache, ending in a terminal state within ``timeout_s``; counted."""
        ...


@attrs.frozen
class Transport:
    name: str
    #: The module that implements it (``PrefillServer``, ``DecodePuller``).
    implementation: str
    #: The third-party module it needs, imported by :meth:`check`.
    requires: str
    #: What provides it, said when it is missing.
    install: str

    def check(self, where: str) -> None:
        """Import the third-party module; a :class:`ConfigError` naming the
        ``pip install`` that provides it if that fails."""
        try:
            importlib.import_module(self.requires)
        except ImportError as exc:
            raise ConfigError(
                f"{where}: transport {self.name!r} needs {self.requires} ({exc}); {self.install}"
            ) from None

    def sides(self) -> tuple[Callable[..., PrefillSide], Callable[..., DecodeSide]]:
        """The prefill and decode sides' classes (after :meth:`check`)."""
        module = importlib.import_module(self.implementation)
        return module.PrefillServer, module.DecodePuller


GLOO = Transport(
    "gloo", "sagellm_plugin_cluster.gloo", "torch.distributed", "pip install 'sagellm-plugin-cluster[gloo]'"
)
MOONCAKE = Transport(
    "mooncake",
    "sagellm_plugin_cluster.mooncake",
    "mooncake.engine",
    "pip install 'sagellm-plugin-cluster[mooncake]' (and Debian's libibverbs1: apt-get install libibverbs1)",
)
NIXL = Transport("nixl", "sagellm_plugin_cluster.nixl", "nixl_cu12._api", "pip install 'sagellm-plugin-cluster[nixl]'")


def installed() -> list[str]:
    return sorted({ep.name for ep in metadata.entry_points(group=GROUP)})


def find(name: object, where: str) -> Transport:
    """The installed transport ``name``; a :class:`ConfigError` naming the
    installed ones otherwise. Its package is not imported."""
    if not isinstance(name, str):
        raise ConfigError(f"{where} = {name!r}: a transport's name, one of {', '.join(installed())}")
    # as every plugin group: refused when blocked or registered twice (docs/threat-model.md)
    entry = registry.find(GROUP, name, f"{where} = {name!r}")
    if entry is None:
        raise ConfigError(f"{where} = {name!r}: no such transport; installed: {', '.join(installed())}")
    try:
        transport = entry.load()
    except Exception as exc:
        raise ConfigError(f"{where} = {name!r}: {entry.value} failed to import: {type(exc).__name__}: {exc}") from None
    if not isinstance(transport, Transport):
        raise ConfigError(f"{where} = {name!r}: {entry.value} is not a {__name__}.Transport")
    return transport


def load(name: str, where: str = "transport") -> tuple[Callable[..., PrefillSide], Callable[..., DecodeSide]]:
    """The prefill and decode sides of transport ``name``, its package
    imported: each failure is one :class:`ConfigError` line."""
    transport = find(name, where)
    transport.check(f"{where} = {name!r}")
    return transport.sides()


#: Fault injection for tests, per request id: what each transport does with
#: a value is said in its module.
Faults = Mapping[str, str]


# The messages every transport exchanges on the front's store, under
# ``kv/<link>/``: ``lease/<request id>`` is ``none`` or ``offer <blocks>
# <bytes per block>`` from the prefill side, then what the decode side and
# the lease's deadline make of it (each transport's module says).


def store_key(link: str, what: str) -> str:
    return f"kv/{link}/{what}"


def span(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def parse_offer(value: str) -> tuple[int, int] | None:
    """``offer <blocks> <bytes per block>`` as its two numbers; ``None`` for
    anything else (``none``, ``expired``, a claim, garbage)."""
    match value.split():
        case ["offer", blocks, size] if blocks.isdigit() and size.isdigit() and int(blocks) > 0:
            return int(blocks), int(size)
    return None


class OfferReader:
    """What a decode side reads of the prefill side's offers on its link."""

    store: Any
    link: str

    def num_blocks_available(self, request: Request) -> int:
        """The blocks of ``request``'s prompt the prefill side offers now (0:
        no offer, or it is claimed or ended): this side as a ``KVSource``."""
        key = store_key(self.link, f"lease/{request.request_id}")
        offer = parse_offer(self.store.get(key).decode()) if self.store.check([key]) else None
        return offer[0] if offer is not None else 0

    def decline(self, key: str, offered: str) -> bool:
        """Give the lease at ``key`` back untaken (its value ``offered``, as
        this side last read it); False if the lease's deadline ended it
        first (``expired``, then deleted: this side read it last)."""
        value = self.store.compare_set(key, offered, "declined").decode()
        if value == "expired":
            self.store.delete_key(key)
        return bool(value == "declined")

    def wait_for_offer(self, request: Request, timeout_s: float) -> bool:
        """Wait until the prefill side has answered for ``request`` (an offer
        or none): the hand-over a front makes before the decode side's pull
        starts its deadline. False after ``timeout_s``."""
        try:
            self.store.wait([store_key(self.link, f"lease/{request.request_id}")], span(timeout_s))
        except Exception:  # the store's timeout is a DistStoreError
            return False
        return True
