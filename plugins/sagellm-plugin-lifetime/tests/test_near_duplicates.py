import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from sagellm_plugin_lifetime.near_duplicates import NearDuplicates
from sagellm_plugin_lifetime.online import OnlineLifetime, OnlineSettings

from sagellm_core import PluginContext
from sagellm_core.types import Request, RequestOutcome


def prompt(seed, n=300):
    rng = random.Random(seed)
    return [rng.randrange(150_000) for _ in range(n)]


def test_an_edited_prompt_finds_the_original_and_an_unrelated_one_nothing():
    memory = NearDuplicates()
    memory.add(memory.signature(prompt(0)), 5.0)
    memory.add(memory.signature(prompt(1)), 6.0)
    edited = prompt(0)
    edited[150] += 1  # one token changed: 6 of about 295 6-grams differ
    similarity, value = memory.nearest(memory.signature(edited))
    assert value == 5.0 and similarity > 0.9
    assert memory.nearest(memory.signature(prompt(2))) is None


def test_only_the_window_at_the_end_counts():
    memory = NearDuplicates(window=100)
    memory.add(memory.signature(prompt(0, 200) + prompt(1, 100)), 5.0)
    similarity, _ = memory.nearest(memory.signature(prompt(9, 200) + prompt(1, 100)))
    assert similarity == 1.0  # another beginning, the same last 100 tokens


def test_the_newest_of_equal_prompts_answers_and_short_prompts_work():
    memory = NearDuplicates()
    for value in (1.0, 2.0, 3.0):
        memory.add(memory.signature([7, 8]), value)
    assert memory.nearest(memory.signature([7, 8])) == (1.0, 3.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 8))
def test_memory_is_bounded_and_its_buckets_name_live_prompts_only(prompts, capacity):
    """Prompts drawn from six, so buckets are shared, grow past their cap
    and lose slots that the ring overwrites."""
    memory = NearDuplicates(capacity=capacity, perms=8, bands=4)
    for i, p in enumerate(prompts):
        memory.add(memory.signature(prompt(p, 20)), float(i))
    assert len(memory) == min(len(prompts), capacity)
    live = {i % capacity for i in range(max(0, len(prompts) - capacity), len(prompts))}
    for band, bucket in enumerate(memory._buckets):
        for key, slots in bucket.items():
            assert slots and len(slots) <= 16
            for slot in slots:
                assert slot in live
                assert memory._signatures[slot][band * 2 : (band + 1) * 2].tobytes() == key
    # The newest copy of the last prompt answers for it.
    assert memory.nearest(memory.signature(prompt(prompts[-1], 20))) == (1.0, float(len(prompts) - 1))


def test_bands_must_split_the_permutations():
    with pytest.raises(ValueError, match="do not split"):
        NearDuplicates(perms=10, bands=4)


@pytest.mark.parametrize("similarity, expected", [(0.95, 700), (2.0, None)])
def test_online_predicts_a_near_duplicate_its_reply_length(similarity, expected):
    ctx = PluginContext("online", block_size=4, num_blocks=1)
    p = OnlineLifetime(OnlineSettings(duplicate_similarity=similarity), ctx)
    first = Request("a", prompt(0), 700, session_id="a")
    p.sagellm_predict_lifetime(request=first)
    p.sagellm_request_finished(outcome=RequestOutcome(first, 700, 0, 0.0, 0.0, 1.0, 0, None))
    again = p.sagellm_predict_lifetime(request=Request("b", prompt(0), 1, session_id="b"))
    assert again.problem() is None
    if expected is None:
        assert abs(again.output_tokens - 700) > 100  # one update moves a linear model only so far
    else:
        assert again.output_tokens == pytest.approx(expected)
        assert again.low_tokens < again.output_tokens < again.high_tokens  # the interval moves with it
