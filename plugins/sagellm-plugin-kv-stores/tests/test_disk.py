"""The disk store on its own: blocks come back byte for byte with the
checksum written beside them, from this process or a later one (the same
KV layout only); a process killed while writing leaves nothing that is
served; torn, truncated and foreign files are dropped and counted; a full
disk stops the writes with one warning; past capacity the block used
longest ago goes."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from sagellm_plugin_kv_stores.disk import DiskSettings, DiskStore
from sagellm_plugin_kv_stores.records import HEADER

from sagellm_core import PluginContext
from sagellm_core.types import CachedBlock, KVCaches, block_checksum

NUM_BLOCKS = 8
ROW = 64


def kv(model: str = "m", row: int = ROW, seed: int = 0) -> KVCaches:
    rows = np.random.default_rng(seed).integers(0, 256, (NUM_BLOCKS, row), dtype=np.uint8)
    return KVCaches(rows, 0, model=model)


def store(folder: Path, device: KVCaches, capacity: int = 64) -> DiskStore:
    disk = DiskStore(DiskSettings(path=str(folder), capacity_blocks=capacity), PluginContext("disk", 16, NUM_BLOCKS))
    disk.sagellm_kv_caches_allocated(kv_caches=device)
    return disk


def blocks(*pairs: tuple[int, int]) -> tuple[CachedBlock, ...]:
    return tuple(CachedBlock(block_id, depth, None, key) for depth, (block_id, key) in enumerate(pairs))


def read_back(disk: DiskStore, keys) -> list[bytes | None]:
    """Each block's bytes, or None where they fail the checksum (as the runtime checks)."""
    stored = disk.get(keys).result()
    return [bytes(v) if block_checksum(v) == c else None for v, c in zip(stored.views, stored.checksums)]


def test_blocks_come_back_byte_for_byte_in_this_process_and_the_next(tmp_path):
    device = kv()
    disk = store(tmp_path, device)
    assert disk.put(blocks((5, 50), (2, 20))).result() == 2
    assert disk.contains([50, 20, 99]) == 2
    assert read_back(disk, [50, 20]) == [device.tensor[5].tobytes(), device.tensor[2].tobytes()]
    again = store(tmp_path, kv())  # a new process: the same layout, the same folder
    assert again.stats()["recovered"] == 2 and again.contains([50, 20]) == 2
    assert read_back(again, [20]) == [device.tensor[2].tobytes()]


def test_another_model_or_layout_finds_nothing(tmp_path):
    store(tmp_path, kv()).put(blocks((1, 10))).result()
    assert store(tmp_path, kv(model="another")).contains([10]) == 0
    assert store(tmp_path, kv(row=2 * ROW)).contains([10]) == 0
    assert store(tmp_path, kv()).contains([10]) == 1


def test_a_flipped_byte_fails_the_check(tmp_path):
    disk = store(tmp_path, kv())
    disk.put(blocks((1, 10), (2, 11))).result()
    path = next(tmp_path.rglob(f"{11:016x}.kv"))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))
    first, second = read_back(disk, [10, 11])
    assert first is not None and second is None


def test_torn_truncated_and_foreign_files_are_dropped_and_counted(tmp_path):
    disk = store(tmp_path, kv())
    disk.put(blocks((1, 10), (2, 11), (3, 12), (4, 13))).result()
    folder = next(tmp_path.rglob(f"{10:016x}.kv")).parent
    (folder / f"{11:016x}.kv").write_bytes((folder / f"{11:016x}.kv").read_bytes()[:-1])  # short
    (folder / f"{12:016x}.kv").write_bytes(b"not a block")
    (folder / f"{14:016x}.abc.tmp").write_bytes(b"half")  # a write cut short
    os.replace(folder / f"{13:016x}.kv", folder / f"{99:016x}.kv")  # a block under another key's name
    again = store(tmp_path, kv())
    assert again.contains([10]) == 1 and again.contains([11]) == again.contains([12]) == again.contains([99]) == 0
    stats = again.stats()
    assert (stats["recovered"], stats["dropped_torn"], stats["dropped_partial"]) == (1, 3, 1)
    assert sorted(p.name for p in folder.iterdir()) == [f"{10:016x}.kv"]


def test_past_capacity_the_block_used_longest_ago_goes(tmp_path):
    disk = store(tmp_path, kv(), capacity=2)
    disk.put(blocks((1, 10), (2, 11))).result()
    disk.get([10])  # 10 used: 11 is now the oldest
    disk.put(blocks((3, 12))).result()
    assert disk.contains([10]) == 1 and disk.contains([11]) == 0 and disk.contains([12]) == 1
    assert disk.stats()["evicted"] == 1 and len(list(tmp_path.rglob("*.kv"))) == 2


def test_a_pinned_block_outlives_capacity_until_unpinned(tmp_path):
    disk = store(tmp_path, kv(), capacity=1)
    disk.put(blocks((1, 10))).result()
    disk.pin([10])
    disk.put(blocks((2, 11))).result()
    assert disk.contains([10]) == 1
    disk.unpin([10])
    disk.put(blocks((3, 12))).result()
    assert disk.contains([10]) == 0 and disk.contains([12]) == 1


def test_a_full_disk_stops_the_writes_with_one_warning(tmp_path, monkeypatch):
    disk = store(tmp_path, kv())
    disk.put(blocks((1, 10))).result()
    real_replace = os.replace

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.warns(RuntimeWarning, match=r"sagellm KV store 'disk': .* is full \(No space left on device\)"):
        assert disk.put(blocks((2, 11), (3, 12))).result() == 0
    monkeypatch.setattr(os, "replace", real_replace)
    assert disk.put(blocks((4, 13))).result() == 0  # no further writes, no further warning
    assert disk.contains([10]) == 1 and read_back(disk, [10])[0] is not None  # still serves what it has
    assert disk.stats()["disk_full"] == 1 and not list(tmp_path.rglob("*.tmp"))


#: Blocks of 1 MiB: most of the writer's time is inside a file write.
BIG_ROW = 1 << 20
WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from sagellm_core import PluginContext
    from sagellm_core.types import CachedBlock, KVCaches
    from sagellm_plugin_kv_stores.disk import DiskSettings, DiskStore

    rows = np.random.default_rng(1).integers(0, 256, (16, BIG_ROW), dtype=np.uint8)
    disk = DiskStore(DiskSettings(path=sys.argv[1], capacity_blocks=1 << 20), PluginContext("disk", 16, 16))
    disk.sagellm_kv_caches_allocated(kv_caches=KVCaches(rows, 0, model="m"))
    key = 0
    while True:
        disk.put([CachedBlock(i, i, None, key + i) for i in range(16)]).result()
        key += 16
        print(key, flush=True)
    """
).replace("BIG_ROW", str(BIG_ROW))


def killed_while_writing(folder: Path, delay_s: float) -> tuple[int, int]:
    """A writer killed (SIGKILL) ``delay_s`` after its first batch was on
    disk: the temporary and the ``.kv`` files it left."""
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(folder)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline()  # a first batch is on disk: the next ones are being written
    time.sleep(delay_s)
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stdout.close()
    files = list(folder.rglob("*"))
    return sum(1 for p in files if p.suffix == ".tmp"), sum(1 for p in files if p.suffix == ".kv")


def test_a_process_killed_while_writing_leaves_nothing_that_is_served(tmp_path):
    cut_short = 0
    for run, delay_s in enumerate((0.2, 0.4, 0.6, 0.8, 1.0, 1.2)):
        folder = tmp_path / str(run)
        partial, whole = killed_while_writing(folder, delay_s)
        device = KVCaches(np.zeros((NUM_BLOCKS, BIG_ROW), np.uint8), 0, model="m")
        disk = store(folder, device, capacity=1 << 20)
        stats = disk.stats()
        assert stats["dropped_partial"] == partial and stats["recovered"] + stats["dropped_torn"] == whole
        held = [int(p.stem, 16) for p in folder.rglob("*.kv")]
        assert len(held) == stats["recovered"] >= 16 and disk.contains(held[:1]) == 1
        for start in range(0, len(held), 16):
            assert all(b is not None for b in read_back(disk, held[start : start + 16])), "a corrupt block was served"
        assert not list(folder.rglob("*.tmp"))
        cut_short += partial
    assert cut_short  # some kill landed inside a write (each does about four times in five)


def test_the_header_is_what_the_format_says(tmp_path):
    device = kv()
    store(tmp_path, device).put(blocks((3, 0xABC))).result()
    data = next(tmp_path.rglob("*.kv")).read_bytes()
    magic, key, fingerprint, checksum, payload, layout = HEADER.unpack_from(data)
    assert (magic, key, fingerprint.decode(), payload) == (b"SGLMKV01", 0xABC, device.fingerprint, ROW)
    assert data[HEADER.size : HEADER.size + layout] == b"uint8|[64]"
    assert data[HEADER.size + layout :] == device.tensor[3].tobytes() and checksum == block_checksum(device.tensor[3])
