"""Value types: how token ids are stored."""

from array import array

import hypothesis
from hypothesis import strategies as st

from sagellm_core.types import Request, as_token_array


def test_token_ids_become_one_int64_array_whatever_they_came_as():
    ids = list(range(-3, 40))
    expected = array("q", ids)
    as_long = array("l", ids)  # 64-bit on this platform: taken as a buffer, in one copy
    strided = memoryview(array("q", range(100)))[::2]  # not contiguous
    int32 = array("i", ids)  # another width: element by element
    for given, want in (
        (ids, expected),
        (tuple(ids), expected),
        (as_long, expected),
        (int32, expected),
        (strided, array("q", range(0, 100, 2))),
    ):
        got = as_token_array(given)
        assert got.typecode == "q" and got == want
    same = array("q", ids)
    assert as_token_array(same) is same
    assert Request("r", as_long, 1).prompt_token_ids == expected


@hypothesis.given(
    st.lists(
        st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(2**63, 2**70), st.floats(), st.text()), max_size=300
    )
)
def test_a_long_list_packs_as_array_would_take_it(values):
    """An engine's prompt (a list of more than 64 ids) is packed in one C
    call: the same array, and for a bad id the same error, as ``array()``."""
    try:
        want: object = array("q", values)
    except (TypeError, OverflowError) as exc:
        want = type(exc)
    try:
        got: object = as_token_array(values)
    except (TypeError, OverflowError) as exc:
        got = type(exc)
    assert got == want
