"""A replay runs the garbage collector less often, and leaves it as it was."""

import gc

import pytest

from sagellm_core.replay.engine import _fewer_collections


def test_the_collector_is_restored_after_a_run_even_one_that_raised():
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    with _fewer_collections():
        assert gc.get_threshold() == (10_000, *threshold[1:])
        assert gc.get_freeze_count() >= frozen
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == frozen
    with pytest.raises(RuntimeError), _fewer_collections():
        raise RuntimeError("a plugin failed")
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == frozen


def test_a_process_that_froze_objects_itself_keeps_them_frozen():
    gc.freeze()  # (the process's objects: the modules, the test's)
    try:
        frozen = gc.get_freeze_count()
        with _fewer_collections():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
