"""The Redis store against a real redis-server: blocks come back byte for
byte, another instance of the same model and layout finds them and another
model does not, a value altered in Redis fails the check, and a server
that cannot be reached stops the store with one warning."""

from __future__ import annotations

import numpy as np
import pytest
from sagellm_plugin_kv_stores.redis_store import RedisSettings, RedisStore

from sagellm_core import PluginContext
from sagellm_core.types import CachedBlock, KVCaches, block_checksum

NUM_BLOCKS = 8


def kv(model: str = "m") -> KVCaches:
    rows = np.random.default_rng(0).integers(0, 256, (NUM_BLOCKS, 64), dtype=np.uint8)
    return KVCaches(rows, 0, model=model)


def store(url: str, device: KVCaches) -> RedisStore:
    redis = RedisStore(RedisSettings(url=url, absent_ttl_s=0.0), PluginContext("redis", 16, NUM_BLOCKS))
    redis.sagellm_kv_caches_allocated(kv_caches=device)
    return redis


def blocks(*pairs):
    return tuple(CachedBlock(block_id, depth, None, key) for depth, (block_id, key) in enumerate(pairs))


def read_back(redis: RedisStore, keys) -> list[bytes | None]:
    stored = redis.get(keys).result()
    return [bytes(v) if block_checksum(v) == c else None for v, c in zip(stored.views, stored.checksums)]


def test_blocks_come_back_and_another_instance_finds_them(redis_url):
    device = kv()
    first = store(redis_url, device)
    assert first.put(blocks((5, 1050), (2, 1020))).result() == 2
    other = store(redis_url, kv())  # another instance of the same model: a cold cache, the same server
    assert other.contains([1050, 1020, 1099]) == 2 and other.stats()["asked"] == 3
    assert read_back(other, [1050, 1020]) == [device.tensor[5].tobytes(), device.tensor[2].tobytes()]
    assert store(redis_url, kv(model="another")).contains([1050]) == 0


def test_a_value_altered_in_redis_fails_the_check_and_removed_is_gone(redis_url):
    redis = store(redis_url, kv())
    redis.put(blocks((1, 2010), (2, 2011))).result()
    name = redis._name(2011)
    value = bytearray(redis.client.get(name))
    value[-1] ^= 0x01
    redis.client.set(name, bytes(value))
    first, second = read_back(redis, [2010, 2011])
    assert first is not None and second is None
    redis.remove([2011])
    assert redis.client.exists(name) == 0 and store(redis_url, kv()).contains([2011]) == 0


def test_a_server_that_cannot_be_reached_stops_the_store_with_one_warning():
    redis = store("redis://127.0.0.1:1/0", kv())  # nothing listens on port 1
    with pytest.warns(RuntimeWarning, match=r"sagellm KV store 'redis': redis://127.0.0.1:1/0 cannot be reached"):
        assert redis.contains([1]) == 0
    assert redis.put(blocks((1, 1))).result() == 0 and redis.contains([1]) == 0
    assert redis.stats()["unreachable"] == 1
