import pytest

from sagellm_core.replay.report import jain_index


def test_jain_index():
    assert jain_index([0.5, 0.5, 0.5]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([0.2, 0.4]) == pytest.approx(0.36 / (2 * 0.2))
    assert jain_index([]) is None and jain_index([0.0, 0.0]) is None
