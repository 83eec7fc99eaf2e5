"""Core helpers for engine adapters."""

from sagellm_core.drivers.engines import version_tuple


def test_version_tuple_drops_local_labels():
    assert version_tuple("0.33.0+cpu") == (0, 33, 0)
    assert version_tuple("0.18.0rc1") == (0, 18, 0)
