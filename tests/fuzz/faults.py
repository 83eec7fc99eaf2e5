"""Fault-injection plugins: the first-party plugins of each section, made to
misbehave in one hook, one way, from their ``after``-th call of it on.

``[SECTION] plugin = "faulty-..."`` with ``hook = "sagellm_..."`` (or,
for a KV store, ``[kv_stores.faulty-host] hook = "put"``, a method) and
``fault`` one of:

* ``raise``: a RuntimeError whose message spans lines;
* ``exit``: ``sys.exit(0)``, which must not end the run with status 0;
* ``hang``: sleeps an hour (run with ``[limits] hook_time_limit_s``);
* ``type``: an answer of the wrong type (``42``);
* ``contents``: an answer of the right type with bad contents (``None``
  inside, a generator, a string budget, negative counts, a store's read
  of fewer blocks than asked);
* ``mutate``: edits what it was given (the states a pass reads, the running
  list a preemption choice reads), then answers as the plugin would.

Declared as a distribution by ``conftest.py`` (``sagellm.kit.testing``'s
``declare_plugins``), so the CLI finds them as it finds any installed plugin.
"""

from __future__ import annotations

import functools
import math
import sys
import time

from attrs import field, frozen, validators
from sagellm_plugin_admission.quota import QuotaAdmission, QuotaSettings
from sagellm_plugin_eviction.lru import LRUEviction
from sagellm_plugin_kv_pool.paged import PagedPool
from sagellm_plugin_kv_pool.runs import RunsPool, RunsSettings
from sagellm_plugin_kv_stores.host import HostSettings, HostStore
from sagellm_plugin_lifetime.stat import StatLifetime, StatSettings
from sagellm_plugin_prefix_cache.radix import RadixPrefixCache, RadixSettings
from sagellm_plugin_scheduler_ir.passes import FCFSPass

from sagellm_core import hookimpl
from sagellm_core.types import (
    AdmissionDecision,
    BlockAllocation,
    EvictionDecision,
    LifetimePrediction,
    PoolUsage,
    PreemptionDecision,
    PrefixInsert,
    PrefixMatch,
    StoredBlocks,
    completed,
)

FAULTS = ("raise", "exit", "hang", "type", "contents", "mutate")


def _fault_fields(cls):
    """``cls`` (a plugin's attrs Settings) with ``hook``, ``fault`` and ``after``."""

    @frozen
    class FaultSettings(cls):
        hook: str = field(default="", kw_only=True)
        fault: str = field(default="raise", kw_only=True, validator=validators.in_(FAULTS))
        after: int = field(default=0, kw_only=True)

    return FaultSettings


def _bad_contents(hook: str, kwargs: dict, answer):
    """An answer of the right type with bad contents, per hook."""
    if hook in ("sagellm_lookup_prefix", "sagellm_acquire_prefix"):
        return PrefixMatch((None,))
    if hook == "sagellm_insert_prefix":
        return PrefixInsert(adopted=[None])
    if hook in ("sagellm_release_prefix", "sagellm_remove_blocks"):
        return (None,)
    if hook in ("sagellm_evictable_blocks", "sagellm_pinned_blocks"):
        return (b for b in ())  # a generator: no len, no membership
    if hook == "sagellm_block_keys":
        return ([1, 2],)  # unhashable keys
    if hook == "sagellm_allocate_blocks":
        return BlockAllocation(iter(range(kwargs["num_blocks"])))
    if hook == "sagellm_pool_usage":
        return PoolUsage("many", "few")
    if hook == "sagellm_select_victims":
        return EvictionDecision((None,) * max(1, min(kwargs["num_blocks"], 2)))
    if hook == "sagellm_select_preemption":
        return PreemptionDecision(None)
    if hook == "sagellm_predict_lifetime":
        return LifetimePrediction(math.nan, 1.0, 2.0, 0.5)
    if hook == "sagellm_schedule_pass":
        kwargs["ir"].token_budget = "8192"
        return None
    if hook in ("contains", "put", "prefetch"):  # a KV store's
        return -1 if hook == "contains" else completed(-1)
    if hook == "get":
        stored = answer.result()
        return completed(StoredBlocks(stored.source, stored.row_ids[:-1], stored.views, stored.checksums))
    if hook == "sagellm_admit_request":
        return AdmissionDecision("admit", None)
    if hook == "sagellm_plan_compaction":
        return ((kwargs_first(kwargs["movable"]), -1),)  # onto a block that does not exist
    if hook == "sagellm_move_blocks":
        return (None,)
    if hook == "sagellm_report_figures":
        return {1: "not by name"}
    return answer  # observations: no answer to spoil


def kwargs_first(movable) -> int:
    return next(iter(movable), 0)


def _mutate(hook: str, kwargs: dict) -> None:
    if hook == "sagellm_schedule_pass":
        for state in [*kwargs["ir"].waiting, *kwargs["ir"].running]:
            state.block_ids.clear()
            state.private_block_ids.clear()
    elif hook == "sagellm_select_preemption":
        running = kwargs["running"]
        if isinstance(running, list):
            running.clear()


def install_fault(plugin, settings) -> None:
    """Replace ``plugin``'s ``settings.hook`` with its faulty version."""
    name, fault, after = settings.hook, settings.fault, settings.after
    if not name:
        return
    method = getattr(plugin, name)
    names = method.__code__.co_varnames[1 : method.__code__.co_argcount]
    calls = [0]

    @functools.wraps(method)
    def faulty(*args, **kwargs):
        self = plugin  # noqa: F841 -- as in a method's frame: the runtime finds the plugin by it
        kwargs.update(zip(names, args))
        calls[0] += 1
        if calls[0] <= after:
            return method(**kwargs)
        if fault == "raise":
            raise RuntimeError(f"injected fault in {name}\nsecond line")
        if fault == "exit":
            sys.exit(0)
        if fault == "hang":
            time.sleep(3600)
        if fault == "type":
            return 42
        if fault == "mutate":
            _mutate(name, kwargs)
            return method(**kwargs)
        return _bad_contents(name, kwargs, method(**kwargs))

    setattr(plugin, name, faulty)


@frozen
class _NoSettings:
    pass


class FaultyRadix(RadixPrefixCache):
    Settings = _fault_fields(RadixSettings)

    def __init__(self, settings, context):
        super().__init__(settings, context)
        install_fault(self, settings)


class FaultyPaged(PagedPool):
    Settings = _fault_fields(_NoSettings)

    def __init__(self, settings, context):
        super().__init__(settings, context)
        install_fault(self, settings)


class FaultyRuns(RunsPool):
    Settings = _fault_fields(RunsSettings)

    def __init__(self, settings, context):
        super().__init__(settings, context)
        install_fault(self, settings)


class FaultyLRU(LRUEviction):
    Settings = _fault_fields(_NoSettings)

    def __init__(self, settings, context):
        super().__init__(settings, context)
        install_fault(self, settings)

    @hookimpl
    def sagellm_select_preemption(self, running, needed_by):
        return None  # the runtime's default choice, unless the fault answers


class FaultyStat(StatLifetime):
    Settings = _fault_fields(StatSettings)

    def __init__(self, settings, context):
        super().__init__(settings, context)
        install_fault(self, settings)

    @hookimpl
    def sagellm_request_arrived(self, request, prediction, match):
        return None  # stat does not observe arrivals; the fault may


class FaultyFCFS(FCFSPass):
    Settings = _fault_fields(_NoSettings)

    def __init__(self, settings, context):
        super().__init__(settings, context)
        install_fault(self, settings)


class FaultyQuota(QuotaAdmission):
    Settings = _fault_fields(QuotaSettings)

    def __init__(self, settings, context):
        super().__init__(settings, context)
        install_fault(self, settings)


class FaultyHost(HostStore):
    Settings = _fault_fields(HostSettings)

    def __init__(self, settings, context):
        super().__init__(settings, context)
        install_fault(self, settings)


class LyingRadix(RadixPrefixCache):
    """Reports a block that a request holds (locked) as removed with the
    victims: the runtime would free it and hand it out again."""

    Settings = RadixSettings

    @hookimpl
    def sagellm_remove_blocks(self, block_ids):
        removed = super().sagellm_remove_blocks(block_ids)
        locked = [b for b in self._info.values() if self.refcount(b.block_id) > 0]
        return removed + tuple(locked[:1])


class ExitAtStart:
    """A plugin whose construction calls ``sys.exit(0)``."""

    def __init__(self, settings, context):
        sys.exit(0)


#: section -> (entry point name, class name, the hooks it may break)
FAULTY = {
    "prefix_cache": (
        "faulty-radix",
        "FaultyRadix",
        (
            "sagellm_lookup_prefix",
            "sagellm_acquire_prefix",
            "sagellm_insert_prefix",
            "sagellm_release_prefix",
            "sagellm_evictable_blocks",
            "sagellm_pinned_blocks",
            "sagellm_block_keys",
            "sagellm_remove_blocks",
            "sagellm_move_blocks",
        ),
    ),
    "kv_pool": (
        "faulty-runs",
        "FaultyRuns",
        (
            "sagellm_allocate_blocks",
            "sagellm_free_blocks",
            "sagellm_pool_usage",
            "sagellm_plan_compaction",
            "sagellm_blocks_moved",
        ),
    ),
    "eviction": (
        "faulty-lru",
        "FaultyLRU",
        (
            "sagellm_select_victims",
            "sagellm_select_preemption",
            "sagellm_blocks_cached",
            "sagellm_blocks_touched",
            "sagellm_blocks_released",
            "sagellm_blocks_evicted",
            "sagellm_blocks_moved",
        ),
    ),
    "lifetime": (
        "faulty-stat",
        "FaultyStat",
        ("sagellm_predict_lifetime", "sagellm_request_arrived", "sagellm_request_finished"),
    ),
    "scheduler": ("faulty-fcfs", "FaultyFCFS", ("sagellm_schedule_pass",)),
    "admission": (
        "faulty-quota",
        "FaultyQuota",
        ("sagellm_admit_request", "sagellm_select_victims", "sagellm_select_preemption", "sagellm_report_figures"),
    ),
    # A KV store's methods (not hooks): faults in them are named the same way.
    "kv_stores": ("faulty-host", "FaultyHost", ("contains", "put", "get", "prefetch")),
}
