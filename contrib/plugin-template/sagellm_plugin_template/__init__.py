"""A sagellm plugin, to copy: seeded random eviction.

The shape every plugin has:

* a ``Settings`` attrs class: the config section's parameters, validated
  here (unknown keys are errors before your class is built);
* ``__init__(settings, context)``: ``context`` says the block size, pool
  size and seed;
* methods decorated with ``@hookimpl``, named after the hookspecs in
  ``sagellm_core/hookspecs.py`` (``sagellm hooks`` prints them). Take only the
  arguments you need. Return ``None`` from a decision to pass it on.

Keep your own state from the observation hooks and answer decisions from it:
here, the set of evictable blocks, kept in a list with O(1) removal.
"""

import random

from attrs import field, frozen, validators

from sagellm_core import PluginContext, hookimpl
from sagellm_core.types import EvictionDecision


@frozen
class RandomSettings:
    #: ``None`` takes the run's seed (``[workload] seed``).
    seed: int | None = field(default=None, validator=validators.optional(validators.instance_of(int)))


class RandomEviction:
    """``[eviction] plugin = "random"``"""

    Settings = RandomSettings

    def __init__(self, settings: RandomSettings, context: PluginContext):
        self.rng = random.Random(context.seed if settings.seed is None else settings.seed)
        self._blocks: list[int] = []
        self._index: dict[int, int] = {}

    def _add(self, block_id: int) -> None:
        if block_id not in self._index:
            self._index[block_id] = len(self._blocks)
            self._blocks.append(block_id)

    def _remove(self, block_id: int) -> None:
        i = self._index.pop(block_id, None)
        if i is not None:
            last = self._blocks.pop()
            if last != block_id:
                self._blocks[i] = last
                self._index[last] = i

    @hookimpl
    def sagellm_blocks_released(self, blocks):
        for block in blocks:
            self._add(block.block_id)

    @hookimpl
    def sagellm_blocks_touched(self, blocks):
        for block in blocks:
            self._remove(block.block_id)

    @hookimpl
    def sagellm_blocks_evicted(self, blocks):
        for block in blocks:
            self._remove(block.block_id)

    @hookimpl
    def sagellm_select_victims(self, num_blocks, candidates):
        # Name only blocks the caller offers: an engine may hold some back
        # that you were told are evictable (LMDeploy leaves pinned blocks
        # out). The scan is O(n), fine for a template; a real policy keeps an
        # order it can walk from the best victim and stops after k.
        offered = [b for b in self._blocks if b in candidates]
        k = min(num_blocks, len(offered))
        return EvictionDecision(tuple(self.rng.sample(offered, k)))
