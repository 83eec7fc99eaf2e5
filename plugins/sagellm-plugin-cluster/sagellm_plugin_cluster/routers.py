"""Routing decisions (``[router] plugin = ...``): which instance computes a
request's prompt, and which decode instance its KV goes to.

* ``round-robin``: each in turn, blind to load and cache.
* ``least-loaded``: the instance with the least work queued, in tokens:
  its queued prefill tokens (those still to compute: a served cluster's
  front counts a request's prompt tokens not cached there) plus this
  prompt's, plus ``decode_weight`` times the tokens in KV of the requests
  decoding there.
* ``kv-aware``: least-loaded's cost with this prompt's cached blocks taken
  off (Dynamo's KV router and llm-d's scorer weigh the same two things):
  a block in the instance's device cache costs nothing, one in a lower
  tier (host, disk) ``lower_tier_cost`` of computing it (its load time).
  While the router's index is degraded every instance reports no cached
  block, so it routes by load alone. A request with a client's
  ``kv_hints.cache_key`` (OpenAI's ``prompt_cache_key``) counts
  ``cache_key_share`` of its prompt as cached on the instance that last took
  that key, where the index shows less: requests of one group that arrive
  before the first one's blocks are published (or while the index is
  degraded) still land together.

A decode instance is chosen by least decode load by both load-aware
routers, in turn by ``round-robin``. Ties go to the instance after the
last one chosen, so an idle cluster is filled evenly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import InstanceLoad, Request, RouteDecision

PROMPT_ROLES = ("colocated", "prefill")


class RoundRobin:
    """``[router] plugin = "round-robin"``"""

    def __init__(self, settings: object, context: PluginContext):
        self._turn = {"prompt": 0, "decode": 0}

    def _next(self, kind: str, candidates: Sequence[InstanceLoad]) -> InstanceLoad:
        turn = self._turn[kind]
        self._turn[kind] = turn + 1
        return candidates[turn % len(candidates)]

    @hookimpl
    def sagellm_route_request(self, instances: Sequence[InstanceLoad]) -> RouteDecision:
        chosen = self._next("prompt", [i for i in instances if i.role in PROMPT_ROLES])
        if chosen.role != "prefill":
            return RouteDecision(chosen.instance_id)
        decode = self._next("decode", [i for i in instances if i.role == "decode"])
        return RouteDecision(chosen.instance_id, decode.instance_id)


@frozen
class LoadSettings:
    #: What a token in the KV of a decoding request weighs against a prompt token still to prefill.
    decode_weight: float = field(default=1.0, validator=[validators.instance_of(float), validators.ge(0)])


@frozen
class KVAwareSettings(LoadSettings):
    #: What a block found in a lower tier costs against computing it: its
    #: load time over its prefill time (PCIe Gen5 against an H100's prefill
    #: of Llama-3.1-8B is about 0.1).
    lower_tier_cost: float = field(
        default=0.1, validator=[validators.instance_of(float), validators.ge(0), validators.le(1)]
    )
    #: The share of a prompt counted as cached on the instance that last
    #: took its ``kv_hints.cache_key``; 0 ignores the keys.
    cache_key_share: float = field(
        default=0.5, validator=[validators.instance_of(float), validators.ge(0), validators.le(1)]
    )
    #: The cache keys remembered (the oldest forgotten first).
    cache_keys: int = field(default=100_000, validator=[validators.instance_of(int), validators.ge(1)])


class LeastLoaded:
    """``[router] plugin = "least-loaded"``"""

    Settings = LoadSettings

    def __init__(self, settings: LoadSettings, context: PluginContext):
        self.decode_weight = settings.decode_weight
        self.block_size = context.block_size
        self._last = {"prompt": -1, "decode": -1}

    def prompt_cost(self, request: Request, instance: InstanceLoad) -> float:
        """The work queued on ``instance`` once ``request``'s prompt joins it, in prompt tokens."""
        return instance.prefill_tokens + request.num_prompt_tokens + self.decode_weight * instance.decode_tokens

    def _least(self, kind: str, candidates: Sequence[InstanceLoad], cost) -> InstanceLoad:
        n, last = len(candidates), self._last[kind]
        # From the one after the last chosen: equal costs take turns.
        order = [(last + 1 + k) % n for k in range(n)]
        best = min(order, key=lambda i: cost(candidates[i]))
        self._last[kind] = best
        return candidates[best]

    @hookimpl
    def sagellm_route_request(self, request: Request, instances: Sequence[InstanceLoad]) -> RouteDecision:
        prompt = [i for i in instances if i.role in PROMPT_ROLES]
        chosen = self._least("prompt", prompt, lambda i: self.prompt_cost(request, i))
        if chosen.role != "prefill":
            return RouteDecision(chosen.instance_id)
        decode = self._least("decode", [i for i in instances if i.role == "decode"], lambda i: i.decode_tokens)
        return RouteDecision(chosen.instance_id, decode.instance_id)


class KVAware(LeastLoaded):
    """``[router] plugin = "kv-aware"``"""

    Settings = KVAwareSettings

    def __init__(self, settings: KVAwareSettings, context: PluginContext):
        super().__init__(settings, context)
        self.lower_tier_cost = settings.lower_tier_cost
        self.cache_key_share = settings.cache_key_share
        self.max_keys = settings.cache_keys
        #: cache key -> the instance that last took a request with it.
        self.key_home: OrderedDict[str, str] = OrderedDict()

    def prompt_cost(self, request: Request, instance: InstanceLoad) -> float:
        prompt, size = request.num_prompt_tokens, self.block_size
        # At least one prompt token is computed wherever it goes (the cache leaves one).
        cached = min(instance.cached_blocks * size, prompt - 1)
        key = request.kv_hints.cache_key if request.kv_hints is not None else None
        if key is not None and self.key_home.get(key) == instance.instance_id:
            cached = max(cached, min(int(self.cache_key_share * prompt), prompt - 1))
        lower = min(instance.lower_tier_blocks * size, prompt - 1 - cached)
        queued = instance.prefill_tokens + self.decode_weight * instance.decode_tokens
        return queued + (prompt - cached - lower) + self.lower_tier_cost * lower

    @hookimpl
    def sagellm_route_request(self, request: Request, instances: Sequence[InstanceLoad]) -> RouteDecision:
        decision = super().sagellm_route_request(request, instances)
        key = request.kv_hints.cache_key if request.kv_hints is not None else None
        if key is not None and self.cache_key_share > 0:
            self.key_home[key] = decision.instance_id
            self.key_home.move_to_end(key)
            if len(self.key_home) > self.max_keys:
                self.key_home.popitem(last=False)
        return decision
