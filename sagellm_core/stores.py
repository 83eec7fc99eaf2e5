"""The KV stores below the device pool, as the runtime uses them
(``[kv_stores] tiers``, fastest first): each store is offered blocks by its
rule (``[kv_stores.NAME] write``, ``write_on``: every block or only those
the device has hit, as the device evicts them or as soon as they qualify),
admission asks which of a prompt's next blocks they can provide (the first
store holding a block serves it), and what they give back enters the
device pool only after its checksum is checked.

A store is untrusted like any plugin: a store that raises or answers
nonsense is a one-line :class:`PluginError` naming it; a block whose bytes
fail their checksum is never copied in, but counted, removed from its store
and recomputed. A store's writes may finish later (on its own thread):
their counts are taken as they complete.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future
from time import perf_counter
from typing import Any

import numpy as np
from attrs import frozen

from sagellm_core.config import TierRule
from sagellm_core.counters import TierCounters
from sagellm_core.errors import PluginError, SagellmError
from sagellm_core.plugin_host import PLUGIN_FAULTS, LoadedPlugin, PluginHost
from sagellm_core.types import CachedBlock, KVCaches, LoadCosts, Request, StoredBlocks, block_checksum


@frozen
class ExternalRun:
    """Consecutive blocks of a prompt that one store (by its place in
    ``[kv_stores] tiers``) can provide."""

    tier: int
    keys: tuple[int, ...]


@frozen
class Prefetch:
    """A waiting request's blocks set moving when it arrived: per run, the
    store's future and when the engine's costs say the copy is done."""

    started_s: float
    runs: tuple[ExternalRun, ...]
    futures: tuple[Future[int], ...]
    ready_s: tuple[float, ...]


_UNLIMITED = contextlib.nullcontext()


class StoreTiers:
    """The configured stores of a :class:`PluginHost`, with their counters."""

    def __init__(self, host: PluginHost):
        self.host = host
        self.stores: list[LoadedPlugin] = host.plugins.get("kv_stores", [])
        self.counters = [host.counters.tiers.setdefault(s.selection.name, TierCounters()) for s in self.stores]
        #: The device's KV, announced by the engine (or the stand-in).
        self.kv: KVCaches | None = None
        #: Puts not counted yet: (tier, blocks offered, its future).
        self._puts: deque[tuple[int, int, Future[int]]] = deque()
        settings = host.settings.kv_stores
        rules = list(enumerate(settings.rules or [TierRule()] * len(self.stores)))
        #: The stores offered blocks as the device evicts them (whether only
        #: those hit), as they are cached, and as they are hit first.
        self._at_eviction = [(t, r.write == "reused") for t, r in rules if r.write_on == "eviction"]
        self._at_caching = [t for t, r in rules if (r.write, r.write_on) == ("all", "through")]
        self._at_first_hit = [t for t, r in rules if (r.write, r.write_on) == ("reused", "through")]
        self.writes_through, self.tracks_hits = bool(self._at_caching), any(r.write == "reused" for _, r in rules)
        #: Content keys of device blocks a prefix match hit, dropped as they are evicted.
        self._hit_keys: set[int] = set()
        self.load_or_recompute, self.prefetching = settings.load_or_recompute, settings.prefetch
        self.prefetch_timeout_s = settings.prefetch_timeout_s
        #: The engine's costs of loads against recompute, where it knows them.
        self.costs: LoadCosts | None = None
        #: Wait for each put (replay: else a store's writes race the simulated clock).
        self.settle_puts = False
        self._prefetches: dict[str, Prefetch] = {}
        #: A waiting request's block keys (from its first block asked, those keys).
        self._known_keys: dict[str, tuple[int, tuple[int, ...]]] = {}

    def __bool__(self) -> bool:
        return bool(self.stores)

    def _guarded(self, tier: int, method: str, call: Callable[[], Any]) -> Any:
        """``call()``, a store's work, named if it raises (under the time limit, if set)."""
        watchdog = self.host.watchdog
        try:
            with watchdog.armed() if watchdog is not None else _UNLIMITED:
                return call()
        except SagellmError:
            raise
        except PLUGIN_FAULTS as exc:
            message = " ".join(str(exc).split())
            raise PluginError(f"{self.stores[tier]} raised in {method}: {type(exc).__name__}: {message}") from exc

    def _call(self, tier: int, method: str, *args: Any) -> Any:
        return self._guarded(tier, method, lambda: getattr(self.stores[tier].instance, method)(*args))

    def _future(self, tier: int, method: str, *args: Any) -> Future[Any]:
        future = self._call(tier, method, *args)
        if not isinstance(future, Future):
            raise self._bad(tier, method, f"returned {future!r}, not a Future")
        return future

    def _bad(self, tier: int, method: str, what: str) -> PluginError:
        return PluginError(f"{self.stores[tier]} {method} {what}")

    def device_kv(self) -> KVCaches:
        """The KV the stores copy from and into: the engine's, or a stand-in
        pool of byte rows where no engine has KV tensors (replay)."""
        if self.kv is None:
            rows = np.zeros((self.host.num_blocks, self.host.settings.kv_stores.bytes_per_block), dtype=np.uint8)
            self.kv = KVCaches(rows, 0, model="stand-in rows")
            self.host.observe("sagellm_kv_caches_allocated", kv_caches=self.kv)
        return self.kv

    def contains(self, tier: int, keys: Sequence[int]) -> int:
        held = self._call(tier, "contains", keys)
        if type(held) is not int or not 0 <= held <= len(keys):
            raise self._bad(tier, "contains", f"returned {held!r}, not a count from 0 to {len(keys)}")
        return held

    def offload(self, removed: tuple[CachedBlock, ...]) -> None:
        """Offer blocks leaving the device cache to the stores that write on
        eviction (a ``reused`` one: those of them the device has hit)."""
        hits = self._hit_keys
        for tier, reused_only in self._at_eviction:
            self._put(tier, [b for b in removed if b.key in hits] if reused_only else removed)
        if hits:
            hits.difference_update(b.key for b in removed)
        self._count_puts(wait=self.settle_puts)

    def cached(self, blocks: tuple[CachedBlock, ...]) -> None:
        """Offer blocks just cached to the stores that write every block through."""
        for tier in self._at_caching:
            self._put(tier, blocks)
        self._count_puts(wait=self.settle_puts)

    def hit(self, blocks: tuple[CachedBlock, ...]) -> None:
        """``blocks`` were matched at an admission: reused. Those hit for the
        first time are offered to the stores that write reused blocks through."""
        hits = self._hit_keys
        first = [b for b in blocks if b.key not in hits]
        hits.update(b.key for b in first)
        for tier in self._at_first_hit:
            self._put(tier, first)
        self._count_puts(wait=self.settle_puts)

    def _put(self, tier: int, blocks: Sequence[CachedBlock]) -> None:
        if not blocks:
            return
        self.device_kv()
        counters = self.counters[tier]
        start = perf_counter()
        future = self._future(tier, "put", blocks)
        counters.seconds += perf_counter() - start
        counters.put_rounds += 1
        self._puts.append((tier, len(blocks), future))

    def _count_puts(self, wait: bool = False) -> None:
        """Count the puts that are done (``wait``: all of them), in order."""
        bytes_per_block = self.device_kv().bytes_per_block
        while self._puts and (wait or self._puts[0][2].done()):
            tier, offered, future = self._puts.popleft()
            written = self._guarded(tier, "put", future.result)
            if type(written) is not int or not 0 <= written <= offered:
                raise self._bad(tier, "put", f"resolved to {written!r}, not a count from 0 to {offered}")
            counters = self.counters[tier]
            counters.written_blocks += written
            counters.declined_blocks += offered - written
            counters.bytes_written += written * bytes_per_block

    def match(self, request: Request, start: int) -> tuple[ExternalRun, ...]:
        """The stores' runs of ``request``'s prompt blocks from block ``start``
        (the end of the device match), leaving one token to compute. Keys
        come from the prefix cache (``sagellm_block_keys``), the first one
        alone first: most admissions stop there."""
        limit = (request.num_prompt_tokens - 1) // self.host.block_size
        if limit <= start:
            return ()
        first = self._keys(request, start, start + 1)
        holder = next((t for t in range(len(self.stores)) if first and self.contains(t, first)), None)
        if holder is None:
            return ()
        return self.runs(self._keys(request, start, limit), holder)

    def _keys(self, request: Request, start: int, end: int) -> tuple[int, ...]:
        """``request``'s block keys from ``start`` to ``end``, hashed once
        for a waiting request (asked at its arrival's prefetch and at each
        admission it waits for), kept until it is admitted or ends."""
        known = self._known_keys.get(request.request_id)
        if known is not None and known[0] == start and len(known[1]) >= end - start:
            return known[1][: end - start]
        keys = self.host.block_keys(request, start, end)[: end - start]
        self._known_keys[request.request_id] = (start, keys)
        return keys

    def admitted(self, request_id: str) -> None:
        """``request_id`` is admitted: its keys are not asked again."""
        self._known_keys.pop(request_id, None)

    def runs(self, keys: tuple[int, ...], first_holder: int = 0) -> tuple[ExternalRun, ...]:
        """``keys``' leading blocks as runs, each block from the first store
        holding it (``first_holder``: the first store that holds the first
        key, where it is known: those before it are not asked again)."""
        runs, pos = [], 0
        while pos < len(keys):
            for tier in range(first_holder if pos == 0 else 0, len(self.stores)):
                held = self.contains(tier, keys[pos:])
                if held:
                    runs.append(ExternalRun(tier, keys[pos : pos + held]))
                    pos += held
                    break
            else:
                break
        return tuple(runs)

    # ------------------------------------------- load or recompute, prefetch --

    def _name(self, tier: int) -> str:
        return self.stores[tier].selection.name

    def _load_s(self, run: ExternalRun, now_s: float, prefetch: Prefetch | None) -> float:
        """The costs' seconds to load ``run`` at ``now_s``: what is left of its
        prefetch if one was started (and not given up), else the whole load."""
        assert self.costs is not None
        if prefetch is not None and run in prefetch.runs:
            ready = prefetch.ready_s[prefetch.runs.index(run)]
            if ready <= prefetch.started_s + self.prefetch_timeout_s:
                return max(0.0, ready - now_s)
        return self.costs.load_s(self._name(run.tier), len(run.keys))

    def worth_loading(
        self, request_id: str, runs: tuple[ExternalRun, ...], num_cached_blocks: int, now_s: float
    ) -> tuple[tuple[ExternalRun, ...], tuple[ExternalRun, ...]]:
        """``runs`` split into those to load and those to compute: each run,
        in order, is loaded while the engine's costs say its load is faster
        than computing its tokens (every run, where there are no costs)."""
        if self.costs is None or not self.load_or_recompute:
            return runs, ()
        prefetch, cached = self._prefetches.get(request_id), num_cached_blocks * self.host.block_size
        for i, run in enumerate(runs):
            tokens = len(run.keys) * self.host.block_size
            if self._load_s(run, now_s, prefetch) >= self.costs.recompute_s(tokens, cached):
                return runs[:i], runs[i:]
            cached += tokens
        return runs, ()

    def prefetch_started(self, request_id: str) -> bool:
        """Whether ``request_id``'s prefetch is moving (not yet loaded or given up)."""
        return request_id in self._prefetches

    def start_prefetch(self, request_id: str, runs: tuple[ExternalRun, ...], now_s: float) -> None:
        """Set ``runs`` moving for the waiting request ``request_id``
        (``Runtime.prefetch``)."""
        if not runs or request_id in self._prefetches:
            return
        moving = tuple(self._future(run.tier, "prefetch", run.keys) for run in runs)
        costs = self.costs
        ready = tuple(now_s + (costs.load_s(self._name(r.tier), len(r.keys)) if costs else 0.0) for r in runs)
        self._prefetches[request_id] = Prefetch(now_s, runs, moving, ready)
        for run in runs:
            self.counters[run.tier].prefetch_rounds += 1
            self.counters[run.tier].prefetched_blocks += len(run.keys)

    def _await_prefetch(self, prefetch: Prefetch, now_s: float) -> list[bool]:
        """Which of ``prefetch``'s runs were late at ``now_s`` (not ready:
        by simulated costs' clock, or their futures not done); real copies
        still running are waited for, up to the time limit after the arrival."""
        if self.costs is not None and self.costs.simulated:
            return [ready > now_s for ready in prefetch.ready_s]
        late = [not future.done() for future in prefetch.futures]
        if any(late):
            left = prefetch.started_s + self.prefetch_timeout_s - now_s
            futures.wait([f for f in prefetch.futures if not f.done()], timeout=max(0.0, left))
        return late

    def _settle_prefetch(self, prefetch: Prefetch, late: list[bool], loaded: dict[tuple[int, int], int]) -> None:
        """Count ``prefetch``'s late runs, and as wasted its blocks not
        loaded (``loaded``: blocks loaded, by (tier, first key) of a run)."""
        for run, was_late, future in zip(prefetch.runs, late, prefetch.futures):
            if future.done():  # (one still running is not waited for: its answer is not needed)
                ready = self._guarded(run.tier, "prefetch", future.result)
                n = len(run.keys)
                if type(ready) is not int or not 0 <= ready <= n:
                    raise self._bad(run.tier, "prefetch", f"resolved to {ready!r}, not a count from 0 to {n}")
            counters = self.counters[run.tier]
            counters.late_prefetches += was_late
            counters.wasted_prefetched_blocks += len(run.keys) - loaded.get((run.tier, run.keys[0]), 0)

    def ended(self, request_id: str) -> None:
        """``request_id`` ended (finished, aborted or rejected): its keys are
        dropped, and a prefetch it never loaded was wasted."""
        self._known_keys.pop(request_id, None)
        prefetch = self._prefetches.pop(request_id, None)
        if prefetch is not None:
            self._settle_prefetch(prefetch, [False] * len(prefetch.runs), {})

    # ----------------------------------------------------------------- load --

    def load(
        self, request_id: str, runs: tuple[ExternalRun, ...], block_ids: Sequence[int], now_s: float
    ) -> tuple[int, int]:
        """Read ``runs`` back into ``block_ids`` (one per key, in order):
        first the leading part the stores still hold (making room on the
        device may have pushed blocks off a full store), pinned while it is
        read; each block checked against its checksum before it is copied
        in. Returns (blocks still held, blocks loaded): a block that fails
        is removed from its store, and it and those after it are left to
        compute."""
        prefetch = self._prefetches.pop(request_id, None)
        late = self._await_prefetch(prefetch, now_s) if prefetch is not None else []
        for run in runs:
            self._call(run.tier, "pin", run.keys)
        try:
            held = []
            for run in runs:
                n = self.contains(run.tier, run.keys)
                if n:
                    held.append(ExternalRun(run.tier, run.keys[:n]))
                if n < len(run.keys):
                    break
            loaded, by_run = self._read(held, block_ids, prefetch, now_s)
            if prefetch is not None:
                self._settle_prefetch(prefetch, late, by_run)
            return sum(len(run.keys) for run in held), loaded
        finally:
            for run in runs:
                self._call(run.tier, "unpin", run.keys)

    def _read(
        self, runs: list[ExternalRun], block_ids: Sequence[int], prefetch: Prefetch | None, now_s: float
    ) -> tuple[int, dict[tuple[int, int], int]]:
        kv = self.device_kv()
        loaded, by_run = 0, {}
        for run in runs:
            counters = self.counters[run.tier]
            start = perf_counter()
            stored = self._guarded(run.tier, "get", self._future(run.tier, "get", run.keys).result)
            self._check_stored(run, stored)
            good = 0
            for view, checksum in zip(stored.views, stored.checksums):
                if block_checksum(view) != checksum:
                    break
                good += 1
            if good:
                kv.copy(stored.source, stored.row_ids[:good], kv.tensor, block_ids[loaded : loaded + good])
            seconds = perf_counter() - start
            counters.seconds += seconds
            counters.get_rounds += 1
            counters.loaded_blocks += good
            counters.bytes_read += good * kv.bytes_per_block
            if self.costs is not None and good:
                counters.load_s += self._load_s(run, now_s, prefetch) * good / len(run.keys)
                self.costs.loaded(self._name(run.tier), good, seconds)
            by_run[run.tier, run.keys[0]] = good
            loaded += good
            if good < len(run.keys):
                counters.corrupt_blocks += 1
                self._call(run.tier, "remove", run.keys[good : good + 1])
                break
        return loaded, by_run

    def _check_stored(self, run: ExternalRun, stored: Any) -> None:
        n = len(run.keys)
        if not isinstance(stored, StoredBlocks):
            raise self._bad(run.tier, "get", f"resolved to {type(stored).__name__}, not StoredBlocks")
        counts = (len(stored.row_ids), len(stored.views), len(stored.checksums))
        if counts != (n, n, n):
            raise self._bad(run.tier, "get", f"gave {counts} rows, views and checksums for the {n} blocks asked")

    def report(self) -> dict[str, dict[str, Any]]:
        """Per store, what the runtime counted of it (every write counted,
        waiting for those still running) and the store's own counts."""
        self._count_puts(wait=True)
        out = {}
        for tier, (store, counters) in enumerate(zip(self.stores, self.counters)):
            own = self._call(tier, "stats")
            if not isinstance(own, Mapping) or not all(type(v) is int for v in own.values()):
                raise self._bad(tier, "stats", f"returned {own!r}, not a mapping of counts")
            out[store.selection.name] = {**counters.summary(), "store": dict(own)}
        return out
