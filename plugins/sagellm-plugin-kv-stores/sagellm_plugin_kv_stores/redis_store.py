"""``[kv_stores] tiers = [..., "redis"]``: KV blocks in a Redis server that
several instances share (``pip install sagellm-plugin-kv-stores[redis]``).

A block is one value, ``sagellm:FINGERPRINT:KEY`` (the KV layout's
fingerprint and the content key, in hex), holding one record
(:mod:`.records`: a header with key, fingerprint, checksum and layout,
then the block's bytes): another instance, or a restarted one, of the same
model and layout finds it, and nothing else does. Writes go out on a
thread (one pipeline a round), so ``put`` returns once the blocks are in
host memory. Redis evicts by its own policy (``maxmemory`` with
``allkeys-lru``), so ``pin`` cannot hold a block: a block gone by the time
it is read fails the runtime's check and is recomputed.

What this instance wrote or saw is remembered, and a key Redis did not
have is not asked again for ``absent_ttl_s``, so most lookups cost no
round trip. A server that cannot be reached stops the store with one
warning: it answers that it holds nothing and writes nothing.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import takewhile
from typing import Any

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.errors import ConfigError
from sagellm_core.types import CachedBlock, KVCaches, StoredBlocks, completed
from sagellm_plugin_kv_stores import records
from sagellm_plugin_kv_stores.host import NOTHING
from sagellm_plugin_kv_stores.records import UNREADABLE
from sagellm_plugin_kv_stores.rows import HostRows, stage_new

#: What the store counts of itself (``stats``).
COUNTS = ("asked", "remembered", "absent", "removed", "unreachable")


@frozen
class RedisSettings:
    url: str = field(default="redis://127.0.0.1:6379/0", validator=validators.min_len(1))
    #: Seconds a key Redis did not have is taken as absent without asking again.
    absent_ttl_s: float = field(default=1.0, validator=validators.ge(0))
    #: Seconds a call to the server may take (connect, read, write).
    timeout_s: float = field(default=2.0, validator=validators.gt(0))


class RedisStore:
    """A Redis server as a KV store (:class:`sagellm_core.types.KVStore`)."""

    Settings = RedisSettings

    def __init__(self, settings: RedisSettings, context: PluginContext):
        try:
            import redis
        except ImportError:
            raise ConfigError(
                "kv_stores plugin 'redis' needs the redis client: pip install sagellm-plugin-kv-stores[redis]"
            ) from None
        self.settings = settings
        self.client = redis.Redis.from_url(
            settings.url, socket_timeout=settings.timeout_s, socket_connect_timeout=settings.timeout_s
        )
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.kv: KVCaches | None = None
        self._prefix = b""
        self._known: set[int] = set()
        self._absent: dict[int, float] = {}
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="sagellm-redis-store")
        self._down = False
        self.counts: Counter[str] = Counter()

    @hookimpl
    def sagellm_kv_caches_allocated(self, kv_caches: KVCaches) -> None:
        self.kv = kv_caches
        self._prefix = f"sagellm:{kv_caches.fingerprint}:".encode()

    def _name(self, key: int) -> bytes:
        return self._prefix + f"{key:016x}".encode()

    def _unreachable(self, exc: BaseException) -> None:
        if not self._down:
            self._down = True
            self.counts["unreachable"] += 1
            warnings.warn(
                f"sagellm KV store 'redis': {self.settings.url} cannot be reached ({exc});"
                " it serves and stores nothing",
                RuntimeWarning,
                stacklevel=1,
            )

    def contains(self, keys: Sequence[int]) -> int:
        if self._down:
            return 0
        now = time.monotonic()
        with self._lock:
            held = 0
            for key in keys:
                if key not in self._known:
                    break
                held += 1
            ask = list(takewhile(lambda k: self._absent.get(k, 0.0) <= now, keys[held:]))
        if not ask:  # all remembered, or the next one known absent
            return held
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in ask:
                pipe.exists(self._name(key))
            found = pipe.execute()
        except self._errors as exc:
            self._unreachable(exc)
            return 0
        self.counts["asked"] += len(ask)
        with self._lock:
            for key, there in zip(ask, found):
                if there:
                    self._known.add(key)
                    self._absent.pop(key, None)
                else:
                    self._absent[key] = now + self.settings.absent_ttl_s
                    self.counts["absent"] += 1
        for there in found:
            if not there:
                break
            held += 1
        return held

    def put(self, blocks: Sequence[CachedBlock]) -> Future[int]:
        if self._down:
            return NOTHING
        with self._lock:
            new = [b for b in blocks if b.key not in self._known]
        staged = stage_new(self.kv, new)
        return NOTHING if staged is None else self._writer.submit(self._write, *staged)

    def _write(self, keys: list[int], staged: HostRows) -> int:
        try:
            pipe = self.client.pipeline(transaction=False)
            for i, key in enumerate(keys):
                payload = staged.view(i)
                pipe.set(self._name(key), records.header(key, staged.kv, payload) + payload.tobytes())
            pipe.execute()
        except self._errors as exc:
            self._unreachable(exc)
            return 0
        with self._lock:
            self._known.update(keys)
            for key in keys:
                self._absent.pop(key, None)
            self.counts["remembered"] += len(keys)
        return len(keys)

    def get(self, keys: Sequence[int]) -> Future[StoredBlocks]:
        assert self.kv is not None
        staged = HostRows(self.kv, len(keys))
        try:
            values: list[Any] = self.client.mget([self._name(k) for k in keys])
        except self._errors as exc:
            self._unreachable(exc)
            values = [None] * len(keys)
        head = records.size(self.kv)
        checksums = []
        for i, (key, value) in enumerate(zip(keys, values)):
            checksum = UNREADABLE if value is None else records.checksum_of(value[:head], key, self.kv, len(value))
            if checksum != UNREADABLE:
                staged.view(i)[:] = memoryview(value)[head:]
            checksums.append(checksum)
        views = tuple(staged.view(i) for i in range(len(keys)))
        return completed(StoredBlocks(staged.source, tuple(range(len(keys))), views, tuple(checksums)))

    def prefetch(self, keys: Sequence[int]) -> Future[int]:
        # The server's memory is where get reads from; a read is one round trip.
        return completed(self.contains(keys))

    def pin(self, keys: Sequence[int]) -> None:
        """Redis evicts by its own policy: nothing can be held."""

    def unpin(self, keys: Sequence[int]) -> None:
        """Redis evicts by its own policy: nothing is held."""

    def remove(self, keys: Sequence[int]) -> None:
        with self._lock:
            self._known.difference_update(keys)
        try:
            self.counts["removed"] += self.client.delete(*[self._name(k) for k in keys]) if keys else 0
        except self._errors as exc:
            self._unreachable(exc)

    def stats(self) -> Mapping[str, int]:
        self._writer.submit(lambda: None).result()  # the writes queued so far are done
        with self._lock:
            return {"known": len(self._known), **{name: self.counts[name] for name in COUNTS}}
