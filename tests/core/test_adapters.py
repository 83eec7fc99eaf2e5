"""Core helpers for engine adapters."""

import pytest

from sagellm_core.drivers.engines import version_tuple
from sagellm_core.parts.tiers import HostTierIndex


def test_version_tuple_drops_local_labels():
    assert version_tuple("0.33.0+cpu") == (0, 33, 0)
    assert version_tuple("0.18.0rc1") == (0, 18, 0)


def test_a_reused_host_slot_forgets_its_old_block():
    index = HostTierIndex(capacity=2)
    index.record(["a", "b"], [0, 1])
    assert "a" in index and index.slots(["b", "a"]) == [1, 0]
    index.record(["c"], [0])  # the transport reused a's slot
    assert "a" not in index and index.slots(["c"]) == [0] and len(index) == 2


def test_content_saved_again_moves_to_its_new_slot():
    index = HostTierIndex(capacity=3)
    index.record(["a"], [0])
    index.record(["a"], [1])  # evicted again after a reload: a new copy
    assert index.slots(["a"]) == [1] and len(index) == 1
    index.record(["b"], [1])  # the new copy's slot reused
    index.record(["c"], [0])  # and the old one's
    assert "a" not in index and index.slots(["b", "c"]) == [1, 0] and len(index) == 2


def test_a_slot_beyond_the_host_tier_is_refused_whole():
    index = HostTierIndex(capacity=2)
    with pytest.raises(RuntimeError, match=r"host slots \[2\], beyond the connector's host tier of 2 blocks"):
        index.record(["a", "b"], [1, 2])
    assert len(index) == 0  # nothing recorded
