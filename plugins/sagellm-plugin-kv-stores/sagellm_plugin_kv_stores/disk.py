"""``[kv_stores] tiers = [..., "disk"]``: KV blocks in files on a local disk,
found again by another process or after a restart.

One file per block, ``PATH/FINGERPRINT/KEY.kv`` (the KV layout's
fingerprint, ``KVCaches.fingerprint``, and the block's content key, in
hex), one record each (:mod:`.records`: a header with key, fingerprint,
checksum, length, dtype and per-block shape, then the block's bytes). A file is
written whole to a temporary name beside it and renamed over its name
(atomic on POSIX), on a writer thread, so ``put`` returns once the blocks
are in host memory and the copy to disk overlaps compute. A process killed
mid-write leaves at most a temporary file, never a short ``.kv``.

When the device KV is announced the store scans its folder: temporary
files and files whose header does not describe a whole block of this
layout (torn, foreign, truncated) are deleted and counted
(``dropped_partial``, ``dropped_torn``); the rest are the store's content,
oldest first. A block whose bytes were altered on disk is caught by the
runtime's checksum check when it is read back, and removed. A full disk
(``ENOSPC``, ``EDQUOT``) stops the writes with one warning: the store keeps
serving what it has and offloads nothing more. Past ``capacity_blocks`` the
block used longest ago is deleted, or the one a ``sagellm.eviction`` policy
picks (``eviction``: :class:`~sagellm_core.kit.store_eviction.StoreEviction`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import warnings
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import takewhile
from pathlib import Path
from typing import Any

import numpy as np
from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.kit.store_eviction import StoreEviction
from sagellm_core.types import CachedBlock, KVCaches, StoredBlocks, completed
from sagellm_plugin_kv_stores import records
from sagellm_plugin_kv_stores.host import NOTHING
from sagellm_plugin_kv_stores.records import UNREADABLE
from sagellm_plugin_kv_stores.rows import HostRows, stage_new

FULL = (errno.ENOSPC, errno.EDQUOT)
#: What the store counts of itself (``stats``): blocks found at start, files
#: dropped then (a write cut short, a file not a whole block of this
#: layout), blocks deleted past capacity or removed after a failed check,
#: and whether the disk filled.
COUNTS = ("recovered", "dropped_partial", "dropped_torn", "evicted", "removed", "disk_full")


@frozen
class DiskSettings:
    #: The store's folder (relative to the config file's); one subfolder per KV layout.
    path: str = field(default="sagellm-kv", validator=validators.min_len(1))
    capacity_blocks: int = field(default=65536, validator=[validators.instance_of(int), validators.ge(0)])
    #: fsync each file and its folder before it counts as written (survives
    #: power loss, not only a killed process; much slower).
    fsync: bool = False
    #: The ``sagellm.eviction`` policy that picks what goes past capacity;
    #: empty: the block used (read or written) longest ago.
    eviction: str = field(default="", validator=validators.instance_of(str))


class DiskStore:
    """A local disk as a KV store (:class:`sagellm_core.types.KVStore`)."""

    Settings = DiskSettings

    def __init__(self, settings: DiskSettings, context: PluginContext):
        self.settings = settings
        self.root = Path(context.config_dir or ".") / settings.path
        self.capacity = settings.capacity_blocks
        self.folder: Path | None = None
        self.kv: KVCaches | None = None
        #: Content key -> file, the block used longest ago first.
        self._held: OrderedDict[int, Path] = OrderedDict()
        self._pins: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="sagellm-disk-store")
        self._full = False
        self.counts: Counter[str] = Counter()
        where = f"[kv_stores.{context.name}] eviction"
        self.policy = StoreEviction(settings.eviction, self.capacity, where) if settings.eviction else None

    @hookimpl
    def sagellm_kv_caches_allocated(self, kv_caches: KVCaches) -> None:
        self.kv = kv_caches
        self.folder = self.root / kv_caches.fingerprint
        self.folder.mkdir(parents=True, exist_ok=True)
        self._recover()

    def _recover(self) -> None:
        """The blocks a previous process left, oldest first; what is not a
        whole block of this layout is deleted and counted."""
        assert self.folder is not None
        found = []
        for path in self.folder.iterdir():
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)
                self.counts["dropped_partial"] += 1
            elif path.suffix == ".kv":
                key = self._whole_block(path)
                if key is None:
                    path.unlink(missing_ok=True)
                    self.counts["dropped_torn"] += 1
                else:
                    found.append((path.stat().st_mtime_ns, key, path))
        for _, key, path in sorted(found):
            self._held[key] = path
        if self.policy is not None:
            self.policy.written(list(self._held))
        self.counts["recovered"] += len(found)
        self._evict_over_capacity()

    def _whole_block(self, path: Path) -> int | None:
        """The key of the block ``path`` holds if it is a whole record of
        this layout under its own name; else ``None``."""
        assert self.kv is not None
        try:
            key = int(path.stem, 16)
            with open(path, "rb") as f:
                head = f.read(records.size(self.kv))
            whole = records.checksum_of(head, key, self.kv, path.stat().st_size) != UNREADABLE
        except (OSError, ValueError):
            return None
        return key if whole and path.name == f"{key:016x}.kv" else None

    def _path(self, key: int) -> Path:
        assert self.folder is not None
        return self.folder / f"{key:016x}.kv"

    # ------------------------------------------------------------ the store --

    def contains(self, keys: Sequence[int]) -> int:
        with self._lock:
            held = self._held.__contains__
            if all(map(held, keys)):  # (the common answer, at C speed)
                return len(keys)
            return sum(1 for _ in takewhile(held, keys))

    def put(self, blocks: Sequence[CachedBlock]) -> Future[int]:
        if self._full or not self.capacity:
            return NOTHING
        with self._lock:
            new = [b for b in blocks if b.key not in self._held]
        staged = stage_new(self.kv, new)
        return NOTHING if staged is None else self._writer.submit(self._write, *staged)

    def _write(self, keys: list[int], staged: HostRows) -> int:
        """On the writer thread: each block to a temporary file, renamed over
        its name once whole."""
        written = 0
        for i, key in enumerate(keys):
            if self._full:
                break
            payload = staged.view(i)
            path = self._path(key)
            temporary = path.with_name(f"{path.stem}.{threading.get_ident():x}.tmp")
            try:
                with open(temporary, "wb") as f:
                    f.seek(records.size(staged.kv))
                    f.write(payload)
                    f.seek(0)  # the header last: its checksum is computed while the file is open
                    f.write(records.header(key, staged.kv, payload))
                    if self.settings.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(temporary, path)
                if self.settings.fsync:
                    _fsync_folder(path.parent)
            except OSError as exc:
                temporary.unlink(missing_ok=True)
                if exc.errno not in FULL:
                    raise
                self._full = True
                self.counts["disk_full"] += 1
                warnings.warn(
                    f"sagellm KV store 'disk': {path.parent} is full ({exc.strerror}); it offloads nothing more",
                    RuntimeWarning,
                    stacklevel=1,
                )
                break
            with self._lock:
                self._held[key] = path
                self._held.move_to_end(key)
                if self.policy is not None:
                    self.policy.written([key])
                self._evict_over_capacity()
            written += 1
        return written

    def _evict_over_capacity(self) -> None:
        """Delete the blocks used longest ago (or the policy's victims) past
        capacity, but pinned ones (under the lock, or at start)."""
        excess = len(self._held) - self.capacity
        if self.policy is not None and excess > 0:
            for key in self.policy.make_room(excess, self._pins):
                self._held.pop(key).unlink(missing_ok=True)
                self.counts["evicted"] += 1
            return
        for key in list(self._held):
            if excess <= 0:
                break
            if self._pins[key]:
                continue
            self._held.pop(key).unlink(missing_ok=True)
            self.counts["evicted"] += 1
            excess -= 1

    def get(self, keys: Sequence[int]) -> Future[StoredBlocks]:
        assert self.kv is not None
        staged = HostRows(self.kv, len(keys))
        checksums = []
        for i, key in enumerate(keys):
            checksums.append(self._read(key, staged.view(i)))
            with self._lock:
                if key in self._held:
                    self._held.move_to_end(key)
                    if self.policy is not None:
                        self.policy.read([key])
        views = tuple(staged.view(i) for i in range(len(keys)))
        return completed(StoredBlocks(staged.source, tuple(range(len(keys))), views, tuple(checksums)))

    def _read(self, key: int, into: np.ndarray[Any, Any]) -> int:
        """Read block ``key`` into ``into``; its recorded checksum, or
        :data:`UNREADABLE` if the file is gone or not a whole block of it."""
        assert self.kv is not None
        try:
            with open(self._path(key), "rb") as f:
                checksum = records.checksum_of(f.read(records.size(self.kv)), key, self.kv)
                if checksum == UNREADABLE or f.readinto(memoryview(into)) != into.nbytes:
                    return UNREADABLE
                return checksum
        except OSError:
            return UNREADABLE

    def prefetch(self, keys: Sequence[int]) -> Future[int]:
        """Ask the kernel to read the held ``keys``' files ahead (the page
        cache is this store's memory): the reads run while the request waits."""
        held = self.contains(keys)
        for key in keys[:held]:
            with contextlib.suppress(OSError):
                fd = os.open(self._path(key), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
        return completed(held)

    def pin(self, keys: Sequence[int]) -> None:
        with self._lock:
            self._pins.update(keys)

    def unpin(self, keys: Sequence[int]) -> None:
        with self._lock:
            self._pins.subtract(keys)
            self._pins = +self._pins

    def remove(self, keys: Sequence[int]) -> None:
        with self._lock:
            for key in keys:
                path = self._held.pop(key, None)
                if path is not None:
                    path.unlink(missing_ok=True)
                    self.counts["removed"] += 1
            if self.policy is not None:
                self.policy.dropped(keys)

    def stats(self) -> Mapping[str, int]:
        self._writer.submit(lambda: None).result()  # the writes queued so far are done
        with self._lock:
            return {"held": len(self._held), **{name: self.counts[name] for name in COUNTS}}


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
