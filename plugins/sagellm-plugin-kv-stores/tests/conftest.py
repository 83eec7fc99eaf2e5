import pytest
from sagellm_plugin_kv_stores.testing import redis_server


@pytest.fixture(scope="session")
def redis_url():
    """A redis-server of its own on a free port (Debian's redis-server
    package; CI installs it), no persistence; skipped where it is absent."""
    pytest.importorskip("redis", reason="the redis client is not installed (sagellm-plugin-kv-stores[redis])")
    with redis_server() as url:
        if url is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server): the Redis store is not tested")
        yield url
