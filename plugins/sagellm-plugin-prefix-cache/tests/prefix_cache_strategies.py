"""What the prefix-cache state machines serve: prompts over three shared
bases with short tails, two tenants, with and without a cache salt."""

import hypothesis.strategies as st

from sagellm_core.types import Request

SERVE = dict(
    shared=st.integers(0, 24),
    tail=st.lists(st.integers(0, 3), max_size=10),
    base=st.integers(0, 2),
    tenant=st.sampled_from(["a", "b"]),
    salt=st.sampled_from([None, "x"]),
)


def req(rid, tokens, tenant="default", salt=None):
    return Request(request_id=rid, prompt_token_ids=tokens, output_tokens=1, tenant=tenant, cache_salt=salt)


def prompt(shared, tail, base):
    return [base * 100 + i for i in range(shared)] + tail


def drawn_request(serial, shared, tail, base, tenant, salt):
    """The request a ``SERVE`` draw makes, or ``None`` when its prompt is empty."""
    tokens = prompt(shared, tail, base)
    return req(f"r{serial}", tokens, tenant, salt) if tokens else None
