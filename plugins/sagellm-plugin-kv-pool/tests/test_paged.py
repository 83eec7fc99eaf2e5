import hypothesis.strategies as st
import pytest
from hypothesis import given
from sagellm_plugin_kv_pool.paged import PagedPool

from sagellm_core import PluginContext


def pool(n=8):
    return PagedPool(None, PluginContext("paged", block_size=16, num_blocks=n))


def test_allocate_is_all_or_nothing():
    p = pool(4)
    assert p.sagellm_allocate_blocks(num_blocks=3, request=None).block_ids == (0, 1, 2)
    assert p.sagellm_allocate_blocks(num_blocks=2, request=None).block_ids == ()
    assert p.sagellm_pool_usage().num_free_blocks == 1


def test_freed_blocks_are_reused_last():
    p = pool(4)
    p.sagellm_allocate_blocks(num_blocks=2, request=None)
    p.sagellm_free_blocks(block_ids=(1, 0))
    assert p.sagellm_allocate_blocks(num_blocks=4, request=None).block_ids == (2, 3, 1, 0)


def test_double_free_and_out_of_range_are_refused_without_change():
    p = pool(4)
    p.sagellm_allocate_blocks(num_blocks=2, request=None)
    p.sagellm_free_blocks(block_ids=(0,))
    with pytest.raises(ValueError, match="block 0 is freed twice"):
        p.sagellm_free_blocks(block_ids=(1, 0))
    with pytest.raises(ValueError, match="block 9 is out of range"):
        p.sagellm_free_blocks(block_ids=(9,))
    with pytest.raises(ValueError, match="duplicates"):
        p.sagellm_free_blocks(block_ids=(1, 1))
    assert p.sagellm_pool_usage().num_free_blocks == 3  # block 1 was not freed by the refused calls


def brute_runs(p):
    runs, prev = 0, False
    for flag in p._is_free:
        runs += bool(flag) and not prev
        prev = bool(flag)
    return runs


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5), st.randoms()), max_size=40))
def test_free_runs_and_counts_stay_exact(ops):
    p = pool(32)
    held: list[int] = []
    for allocate, n, rnd in ops:
        if allocate:
            held += p.sagellm_allocate_blocks(num_blocks=n, request=None).block_ids
        elif held:
            rnd.shuffle(held)
            freed, held = held[:n], held[n:]
            p.sagellm_free_blocks(block_ids=tuple(freed))
        usage = p.sagellm_pool_usage()
        assert usage.num_free_blocks + len(held) == 32
        assert len(set(held)) == len(held)
        assert usage.num_free_runs == brute_runs(p)
        assert 0.0 <= usage.external_fragmentation <= 1.0
