"""Adaptive eviction: follow whichever expert policy would be hitting most on
the workload in front of it, judged on shadow caches (in the manner of ACME,
Ari et al., "ACME: Adaptive Caching Using Multiple Experts", 2002, and the
set dueling of CPU caches, Qureshi et al., ISCA'07).

No one policy wins everywhere: the continuation-aware policy leads on
conversation traces and falls below LRU on others, frequency wins where a
corpus recurs and loses where recency rules
(``docs/benchmarks/policy-suite.md``). This policy runs several experts
(``experts``, LRU first) side by side in two ways:

* **On the real cache**, each expert observes every block event, so each
  always holds a valid order of the real evictable blocks; the *leader*'s
  answers the victim choice.
* **On a shadow cache** per expert: a cache of content keys of the real
  cache's size that only that expert runs. Every request's chain (known
  when its blocks are released) is played on each shadow: the leading run
  of cached keys hits, the rest is cached, evicting by that expert's choice.
  A shadow's hits are what the real cache would have hit had it followed
  that expert all along; they are counted with exponential decay (a
  half-life of ``half_life`` cache sizes of blocks requested).

The leader changes only when another expert's decayed hits exceed the
leader's by more than ``margin``: where LRU is the best expert, the real
cache is LRU's, block for block; where another expert is clearly better,
the real cache takes its order within a half-life.

A shadow is simpler than the real cache (a request's blocks are held only
while it is played, so concurrency is not modelled); it ranks experts, it
does not predict figures. Cost: each expert's observations twice (real and
shadow); choosing victims costs what the leader's choice costs.
"""

from __future__ import annotations

import inspect
import re
import tomllib
from collections.abc import Callable, Iterator
from typing import Any

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import CachedBlock, EvictionCandidates, EvictionDecision, Request

from .arc import ARCEviction
from .continuation import ContinuationEviction
from .cost import CostAwareEviction
from .hawkeye import HawkeyeEviction
from .lfu import LFUEviction
from .lru import LRUEviction
from .predictive import PredictiveEviction
from .revisit import RevisitEviction
from .s3fifo import S3FIFOEviction

#: The policies of this distribution that can be experts (online, and
#: observing blocks only).
EXPERTS: dict[str, type] = {
    "lru": LRUEviction,
    "arc": ARCEviction,
    "s3fifo": S3FIFOEviction,
    "lfu": LFUEviction,
    "continuation": ContinuationEviction,
    "predictive": PredictiveEviction,
    "cost": CostAwareEviction,
    "hawkeye": HawkeyeEviction,
    "revisit": RevisitEviction,
}


def expert_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME`` or ``NAME:KEY=VALUE,...``: an expert and its settings (each
    value TOML or a bare word), as ``--policy`` takes them; ``;`` separates
    them too (inside a ``--policy`` of ``adaptive``, a comma would end the
    expert's list item)."""
    name, _, params = spec.partition(":")
    settings: dict[str, Any] = {}
    for item in filter(None, re.split(r"[,;](?=\s*\w+=)", params)):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"expert {spec!r}: settings are KEY=VALUE, separated by commas")
        try:
            settings[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            settings[key.strip()] = value
    return name, settings


OBSERVATIONS = ("sagellm_blocks_cached", "sagellm_blocks_touched", "sagellm_blocks_released", "sagellm_blocks_evicted")


def _expert_names(instance: Any, attribute: Any, value: tuple[str, ...]) -> None:
    unknown = [name for name in value if expert_spec(name)[0] not in EXPERTS]
    if unknown or len(set(value)) != len(value) or len(value) < 2:
        raise ValueError(
            f"experts = {list(value)!r}: two or more distinct names among {', '.join(EXPERTS)}"
            + (f" ({', '.join(unknown)} unknown)" if unknown else "")
        )


@frozen
class AdaptiveSettings:
    #: The experts, the first the leader until another earns it.
    experts: tuple[str, ...] = field(
        default=("lru", "continuation", "s3fifo", "lfu"),
        converter=lambda names: (names,) if isinstance(names, str) else tuple(names),
        validator=_expert_names,
    )
    #: Half-life of the hit counts, in cache sizes of blocks requested.
    half_life: float = field(default=2.0, converter=float, validator=validators.gt(0))
    #: Another expert leads when its decayed hits exceed the leader's by more
    #: than this share.
    margin: float = field(default=0.01, converter=float, validator=validators.ge(0))


def _told(method: Callable[..., None]) -> Callable[[tuple[CachedBlock, ...], float, Request | None], None]:
    """``method`` called as ``(blocks, now_s, request)``, given those of the
    two it takes (as pluggy passes a hook implementation its arguments)."""
    parameters = inspect.signature(method).parameters
    if "now_s" in parameters and "request" in parameters:
        return lambda blocks, now_s, request: method(blocks, now_s=now_s, request=request)
    if "now_s" in parameters:
        return lambda blocks, now_s, request: method(blocks, now_s=now_s)
    if "request" in parameters:
        return lambda blocks, now_s, request: method(blocks, request=request)
    return lambda blocks, now_s, request: method(blocks)


class _Expert:
    """A policy instance and its observation methods, each told the blocks,
    the time and the releasing request, whichever of those it takes."""

    def __init__(self, name: str, policy: Any):
        self.name = name
        self.policy = policy
        self.observe = {hook: _told(getattr(policy, hook)) for hook in OBSERVATIONS if hasattr(policy, hook)}
        self.select = policy.sagellm_select_victims

    @classmethod
    def named(cls, name: str, context: PluginContext, choices: dict[str, type] = EXPERTS) -> _Expert:
        """The expert ``NAME`` or ``NAME:KEY=VALUE,...`` of ``choices``, built with its settings."""
        base, params = expert_spec(name)
        policy_cls = choices[base]
        settings_cls = getattr(policy_cls, "Settings", None)
        return cls(name, policy_cls(settings_cls(**params) if settings_cls is not None else None, context))

    def tell(self, hook: str, blocks: tuple[CachedBlock, ...], now_s: float, request: Request | None = None) -> None:
        call = self.observe.get(hook)
        if call is not None and blocks:
            call(blocks, now_s, request)


class _Node:
    __slots__ = ("block", "children")

    def __init__(self, block: CachedBlock):
        self.block = block
        self.children: set[int] = set()


class _Evictable:
    """A shadow's evictable blocks (all but the request being played)."""

    def __init__(self, shadow: ShadowCache):
        self.shadow = shadow

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.shadow.nodes and block_id not in self.shadow.held

    def __len__(self) -> int:
        return len(self.shadow.nodes) - len(self.shadow.held)

    def __iter__(self) -> Iterator[int]:
        return (b for b in self.shadow.nodes if b not in self.shadow.held)


class ShadowCache:
    """A prefix cache of content keys run by one expert alone."""

    def __init__(self, expert: _Expert, capacity: int):
        self.expert = expert
        self.capacity = capacity
        self.nodes: dict[int, _Node] = {}
        self.by_key: dict[int, int] = {}
        self.held: set[int] = set()
        self.next_id = 0
        self.evictable = _Evictable(self)

    def play(self, keys: list[int], now_s: float, request: Request | None = None) -> int:
        """One request's chain of content keys: returns the blocks hit."""
        ids = []
        for key in keys:
            block_id = self.by_key.get(key)
            if block_id is None:
                break
            ids.append(block_id)
        hits = len(ids)
        self.held = set(ids)
        self.expert.tell("sagellm_blocks_touched", tuple(self.nodes[b].block for b in ids), now_s)
        need = len(keys) - hits
        for _ in range(4):  # a policy may answer fewer than asked: ask again
            short = need - (self.capacity - len(self.nodes))
            if short <= 0 or not len(self.evictable):
                break
            self._evict(short, now_s)
        parent = ids[-1] if ids else None
        new = []
        for depth in range(hits, hits + min(need, self.capacity - len(self.nodes))):
            block = CachedBlock(block_id=self.next_id, depth=depth, parent_id=parent, key=keys[depth])
            self.next_id += 1
            self.nodes[block.block_id] = _Node(block)
            self.by_key[block.key] = block.block_id
            if parent is not None:
                self.nodes[parent].children.add(block.block_id)
            new.append(block)
            parent = block.block_id
        self.expert.tell("sagellm_blocks_cached", tuple(new), now_s)
        self.held = set()
        chain = tuple(self.nodes[b].block for b in ids) + tuple(new)
        self.expert.tell("sagellm_blocks_released", chain, now_s, request)
        return hits

    def _evict(self, count: int, now_s: float) -> None:
        victims = self.expert.select(count, self.evictable).victim_ids
        gone: list[CachedBlock] = []
        for victim in victims:
            if victim not in self.evictable:
                continue
            stack, subtree = [victim], []
            while stack:  # the victim and its descendants, dropped with it
                block_id = stack.pop()
                subtree.append(block_id)
                stack.extend(self.nodes[block_id].children)
            for block_id in reversed(subtree):  # deepest first
                node = self.nodes.pop(block_id)
                del self.by_key[node.block.key]
                parent = node.block.parent_id
                if parent is not None and parent in self.nodes:
                    self.nodes[parent].children.discard(block_id)
                gone.append(node.block)
        self.expert.tell("sagellm_blocks_evicted", tuple(gone), now_s)


class AdaptiveEviction:
    """``[eviction] plugin = "adaptive"``"""

    Settings = AdaptiveSettings

    def __init__(self, settings: AdaptiveSettings, context: PluginContext):
        self.settings = settings
        self.experts = [_Expert.named(name, context) for name in settings.experts]
        self.shadows = [ShadowCache(_Expert.named(name, context), context.num_blocks) for name in settings.experts]
        self.scores = [0.0] * len(self.experts)
        self.leader = 0
        #: Leader changes, as (blocks requested so far, expert name).
        self.switches: list[tuple[int, str]] = []
        self.requested = 0
        self._decay_per_block = 0.5 ** (1.0 / (settings.half_life * context.num_blocks))
        self._chain: dict[int, tuple[int, int | None]] = {}  # real block -> (content key, parent)

    @property
    def leader_name(self) -> str:
        return self.experts[self.leader].name

    def _tell(self, hook: str, blocks: tuple[CachedBlock, ...], now_s: float, request: Request | None = None) -> None:
        for expert in self.experts:
            expert.tell(hook, blocks, now_s, request)

    @hookimpl
    def sagellm_blocks_cached(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        for block in blocks:
            self._chain[block.block_id] = (block.key, block.parent_id)
        self._tell("sagellm_blocks_cached", blocks, now_s)

    @hookimpl
    def sagellm_blocks_touched(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        self._tell("sagellm_blocks_touched", blocks, now_s)

    @hookimpl
    def sagellm_blocks_released(self, blocks: tuple[CachedBlock, ...], now_s: float, request: Request | None) -> None:
        self._tell("sagellm_blocks_released", blocks, now_s, request)
        if blocks:
            self._play(blocks[-1].block_id, now_s, request)

    @hookimpl
    def sagellm_blocks_evicted(self, blocks: tuple[CachedBlock, ...], now_s: float) -> None:
        self._tell("sagellm_blocks_evicted", blocks, now_s)
        for block in blocks:
            self._chain.pop(block.block_id, None)

    @hookimpl
    def sagellm_select_victims(self, num_blocks: int, candidates: EvictionCandidates) -> EvictionDecision:
        return self.experts[self.leader].select(num_blocks, candidates)

    def _play(self, end: int, now_s: float, request: Request | None = None) -> None:
        """Play the chain ending at real block ``end`` on every shadow and
        move the lead if another expert has earned it."""
        keys: list[int] = []
        block: int | None = end
        while block is not None and block in self._chain:
            key, block = self._chain[block]
            keys.append(key)
        keys.reverse()
        self.requested += len(keys)
        decay = self._decay_per_block ** len(keys)
        scores = self.scores
        for i, shadow in enumerate(self.shadows):
            scores[i] = scores[i] * decay + shadow.play(keys, now_s, request)
        best = max(range(len(scores)), key=scores.__getitem__)
        if best != self.leader and scores[best] > scores[self.leader] * (1.0 + self.settings.margin):
            self.leader = best
            self.switches.append((self.requested, self.experts[best].name))
