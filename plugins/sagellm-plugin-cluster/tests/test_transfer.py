"""The transfer contract on replay runtimes (no model, no transport):
a lease holds a prefilled prompt's blocks until it ends, a landing makes
room for a pull and either caches the blocks or frees them, and whatever
the order of outcomes no block is held afterwards."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from sagellm_plugin_cluster.transfer import Landing, Leases, TransferCounts, TransferStatus, full_blocks

from sagellm_core.types import Request

from .conftest import compute, prompt, runtime


def test_a_lease_holds_the_prompt_blocks_until_it_ends():
    rt = runtime()
    request = prompt(0)
    compute(rt, request)
    leases = Leases(rt, lease_s=1.0)
    lease = leases.grant(request, now_s=5.0)
    assert lease is not None and lease.deadline_s == 6.0
    assert len(lease.block_ids) == full_blocks(request, 4) == 4
    assert leases.num_blocks_available(request) == 4
    rt.reset_prefix_cache()  # evicts every evictable block: not the leased ones
    assert set(lease.block_ids) <= set(rt.host.lookup(request).block_ids)
    rt.check_invariants()
    leases.end("r0", TransferStatus.EXPIRED)
    assert leases.num_blocks_available(request) == 0 and leases.ended[TransferStatus.EXPIRED] == 1
    rt.reset_prefix_cache()
    assert rt.host.lookup(request).num_blocks == 0
    assert rt.pool_usage().num_free_blocks == rt.num_blocks
    rt.check_invariants()


def test_nothing_cached_is_no_lease_and_a_lease_cannot_end_twice():
    rt = runtime()
    leases = Leases(rt, lease_s=1.0)
    assert leases.grant(prompt(0), 0.0) is None
    assert leases.grant(Request("short", [1, 2, 3], 1), 0.0) is None  # no full block before the last token
    compute(rt, prompt(1))
    leases.grant(prompt(1), 0.0)
    with pytest.raises(ValueError, match="already leased"):
        leases.grant(prompt(1), 0.0)
    with pytest.raises(ValueError, match="not terminal"):
        leases.end("r1", TransferStatus.PENDING)
    leases.end("r1", TransferStatus.DONE)
    with pytest.raises(KeyError):
        leases.end("r1", TransferStatus.DONE)
    with pytest.raises(ValueError, match="must be positive"):
        Leases(rt, 0.0)
    rt.check_invariants()


def test_a_landing_takes_its_own_prefix_and_pulls_the_rest():
    decode = runtime()
    compute(decode, Request("other", [1] * 8 + [7] * 5, 2))  # the shared 8 tokens: two blocks
    request = prompt(0)
    landing = Landing.open(decode, request, 4)
    assert landing is not None and landing.start == 2 and len(landing.block_ids) == 2
    decode.check_invariants()
    landing.land()
    assert decode.host.lookup(request).num_blocks == 4  # the request that follows finds all four
    decode.check_invariants()
    with pytest.raises(ValueError, match="already ended"):
        landing.abandon()


def test_an_abandoned_landing_frees_its_blocks_unwritten():
    decode = runtime()
    landing = Landing.open(decode, prompt(0), 4)
    assert landing is not None and landing.start == 0
    assert decode.pool_usage().num_free_blocks < decode.num_blocks
    landing.abandon()
    assert decode.pool_usage().num_free_blocks == decode.num_blocks
    assert decode.host.lookup(prompt(0)).num_blocks == 0
    decode.check_invariants()


def test_a_landing_without_room_is_none_and_holds_nothing():
    decode = runtime(blocks=3)
    assert Landing.open(decode, prompt(0), 4) is None  # four blocks and one token need five
    assert decode.pool_usage().num_free_blocks == 3
    decode.check_invariants()


def test_counts_by_outcome():
    counts = TransferCounts()
    counts.count(TransferStatus.DONE, 3, 0)
    counts.count(TransferStatus.FAILED, 0, 17)
    counts.count(TransferStatus.EXPIRED, 0, 9)
    assert (counts.done, counts.failed, counts.expired, counts.blocks, counts.recomputed_tokens) == (1, 1, 1, 3, 26)
    with pytest.raises(ValueError, match="not terminal"):
        counts.count(TransferStatus.PENDING, 0, 0)


OUTCOMES = st.sampled_from([TransferStatus.DONE, TransferStatus.FAILED, TransferStatus.EXPIRED])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 20), OUTCOMES, st.booleans()), min_size=1, max_size=12),
    st.integers(8, 40),
)
# The decode side still holds a longer run of the prefix (an earlier landing)
# than the prefill side could lease: the landing is found, and more with it.
@example(
    [(4, 1, TransferStatus.DONE, False), (0, 16, TransferStatus.DONE, False), (4, 1, TransferStatus.DONE, False)], 8
)
def test_any_order_of_outcomes_leaves_no_block_held(transfers, blocks):
    """Prompts of shared prefixes prefilled, leased and pulled (or not) in
    any order, with memory pressure and cache resets between: the accounting
    is whole after every step, and once every lease and landing has ended
    nothing is held on either side; a landed prompt is found in the decode
    cache, in full (with whatever of its prefix the decode side held
    already), until something evicts it."""
    prefill, decode = runtime(blocks), runtime(blocks)
    leases = Leases(prefill, lease_s=1.0)
    for i, (prefix, own, outcome, reset) in enumerate(transfers):
        request = Request(f"r{i}", [1] * (4 * prefix) + [100 + i] * own, 2)
        if full_blocks(request, 4) + 1 > blocks:
            continue
        compute(prefill, request)
        lease = leases.grant(request, float(i))
        landing = Landing.open(decode, request, len(lease.block_ids)) if lease is not None else None
        prefill.check_invariants()
        decode.check_invariants()
        if landing is not None:
            if outcome is TransferStatus.DONE:
                landing.land()
                assert decode.host.lookup(request).num_blocks >= len(lease.block_ids)
            else:
                landing.abandon()
        if lease is not None:
            leases.end(request.request_id, outcome)
        if reset:
            prefill.reset_prefix_cache()
            decode.reset_prefix_cache()
        prefill.check_invariants()
        decode.check_invariants()
    assert not leases.open
    for rt in (prefill, decode):
        assert rt.in_flight == 0
        rt.reset_prefix_cache()
        assert rt.pool_usage().num_free_blocks == rt.num_blocks
