"""The routing plugins' decisions on hand-made instance loads."""

from __future__ import annotations

import inspect

from hypothesis import given, settings
from hypothesis import strategies as st
from sagellm_plugin_cluster.routers import KVAware, KVAwareSettings, LeastLoaded, LoadSettings, RoundRobin

from sagellm_core import PluginContext
from sagellm_core.drivers.router import check_route
from sagellm_core.types import InstanceLoad, KVHints, Request

CONTEXT = PluginContext("router", 16, 1000)
PROMPT = Request("r", list(range(160)), 8)  # 10 blocks


def load(instance_id, role="colocated", prefill=0, decode=0, cached=0, lower=0):
    return InstanceLoad(instance_id, role, prefill, 0, decode, cached, lower)


def test_round_robin_takes_turns_among_prompt_and_among_decode_instances():
    router = RoundRobin(None, CONTEXT)
    instances = [
        load("p0", "prefill"),
        load("p1", "prefill"),
        load("d0", "decode"),
        load("d1", "decode"),
        load("d2", "decode"),
    ]
    routes = [router.sagellm_route_request(instances) for _ in range(4)]
    assert [(r.instance_id, r.decode_instance_id) for r in routes] == [
        ("p0", "d0"),
        ("p1", "d1"),
        ("p0", "d2"),
        ("p1", "d0"),
    ]


def test_least_loaded_goes_where_least_work_is_queued_and_ties_take_turns():
    router = LeastLoaded(LoadSettings(), CONTEXT)
    busy = [load("a", prefill=500), load("b", prefill=100, decode=300), load("c", prefill=300)]
    assert router.sagellm_route_request(PROMPT, busy).instance_id == "c"
    idle = [load("a"), load("b"), load("c")]
    assert [router.sagellm_route_request(PROMPT, idle).instance_id for _ in range(3)] == ["a", "b", "c"]


def test_least_loaded_sends_kv_to_the_decode_instance_with_the_least_kv():
    router = LeastLoaded(LoadSettings(), CONTEXT)
    instances = [load("p0", "prefill", prefill=10), load("d0", "decode", decode=900), load("d1", "decode", decode=40)]
    route = router.sagellm_route_request(PROMPT, instances)
    assert (route.instance_id, route.decode_instance_id) == ("p0", "d1")


def test_kv_aware_trades_cached_blocks_against_queued_work():
    router = KVAware(KVAwareSettings(), CONTEXT)
    # b holds 8 of the 10 blocks (128 tokens) with 100 tokens more queued: cheaper.
    assert router.sagellm_route_request(PROMPT, [load("a"), load("b", prefill=100, cached=8)]).instance_id == "b"
    # With 200 queued it is not.
    assert router.sagellm_route_request(PROMPT, [load("a"), load("b", prefill=200, cached=8)]).instance_id == "a"
    # Blocks in a lower tier count at their load cost: 8 blocks there save 0.9 of 128 tokens.
    lower = [load("a"), load("b", prefill=100, lower=8)]
    assert router.sagellm_route_request(PROMPT, lower).instance_id == "b"


def test_kv_aware_keeps_a_cache_key_s_requests_together_before_their_blocks_are_published():
    router = KVAware(KVAwareSettings(), CONTEXT)
    idle = [load("a"), load("b"), load("c")]

    def keyed(n, key):
        return Request(f"{key}{n}", list(range(160)), 8, kv_hints=KVHints(cache_key=key) if key else None)

    # No block is published yet: without a key, idle instances take turns.
    assert [router.sagellm_route_request(keyed(n, None), idle).instance_id for n in range(3)] == ["a", "b", "c"]
    # With one, the group's later requests follow its first, and another group goes elsewhere.
    group = [router.sagellm_route_request(keyed(n, "conv-1"), idle).instance_id for n in range(3)]
    other = router.sagellm_route_request(keyed(0, "conv-2"), idle).instance_id
    assert len(set(group)) == 1 and other != group[0]
    # The credit is a share of the prompt, not a pin: a home queued deep enough loses the request.
    busy = [load(i.instance_id, prefill=1000 if i.instance_id == group[0] else 0) for i in idle]
    assert router.sagellm_route_request(keyed(3, "conv-1"), busy).instance_id != group[0]
    # cache_key_share = 0 ignores the keys.
    blind = KVAware(KVAwareSettings(cache_key_share=0.0), CONTEXT)
    assert len({blind.sagellm_route_request(keyed(n, "conv-1"), idle).instance_id for n in range(3)}) == 3


def test_kv_aware_never_counts_the_last_prompt_token_as_cached():
    router = KVAware(KVAwareSettings(), CONTEXT)
    assert router.prompt_cost(PROMPT, load("a", cached=50, lower=50)) == 1


instance_loads = st.lists(
    st.builds(
        load,
        st.uuids().map(str),
        st.sampled_from(["colocated", "prefill", "decode"]),
        st.integers(0, 10_000),
        st.integers(0, 10_000),
        st.integers(0, 20),
        st.integers(0, 20),
    ),
    min_size=1,
    max_size=8,
).filter(
    lambda xs: (
        any(x.role != "decode" for x in xs)
        and (not any(x.role == "prefill" for x in xs) or any(x.role == "decode" for x in xs))
    )
)


@settings(max_examples=150, deadline=None)
@given(instances=instance_loads, prompt=st.integers(1, 400))
def test_every_router_answers_a_decision_the_cluster_can_act_on(instances, prompt):
    request = Request("r", list(range(prompt)), 4)
    for router in (
        RoundRobin(None, CONTEXT),
        LeastLoaded(LoadSettings(), CONTEXT),
        KVAware(KVAwareSettings(), CONTEXT),
    ):
        hook = router.sagellm_route_request
        given_args = {"request": request, "instances": instances, "now_s": 0.0}
        route = hook(**{name: given_args[name] for name in inspect.signature(hook).parameters})
        assert check_route(route, instances) is None


@settings(max_examples=100, deadline=None)
@given(instances=instance_loads, prompt=st.integers(1, 400))
def test_kv_aware_with_no_cached_block_anywhere_routes_as_least_loaded(instances, prompt):
    request = Request("r", list(range(prompt)), 4)
    blind = [load(i.instance_id, i.role, i.prefill_tokens, i.decode_tokens) for i in instances]
    kv, least = KVAware(KVAwareSettings(), CONTEXT), LeastLoaded(LoadSettings(), CONTEXT)
    assert kv.sagellm_route_request(request, blind) == least.sagellm_route_request(request, blind)
