"""A sagellm plugin, to copy: seeded random eviction.

The shape every plugin has:

* a ``Settings`` attrs class: the config section's parameters, validated
  here (unknown keys are errors before your class is built);
* ``__init__(settings, context)``: ``context`` says the block size, pool
  size and seed;
* methods decorated with ``@hookimpl``, named after the hookspecs in
  ``sagellm_core/hookspecs.py`` (``sagellm hooks`` prints them). Take only the
  arguments you need. Return ``None`` from a decision to pass it on.

An eviction policy is simplest on
:class:`~sagellm_core.kit.eviction.PriorityEviction`: it states a block's
priority when the block becomes evictable, and the base keeps the evictable
blocks from the observation hooks and names the lowest-priority ones among
the candidates the caller offers (an engine may hold some back: LMDeploy
leaves pinned blocks out). Other decisions implement their ``@hookimpl``
methods directly and keep their own state from the observations.
"""

import random

from attrs import field, frozen, validators

from sagellm_core import PluginContext
from sagellm_core.kit.eviction import PriorityEviction


@frozen
class RandomSettings:
    #: ``None`` takes the run's seed (``[workload] seed``).
    seed: int | None = field(default=None, validator=validators.optional(validators.instance_of(int)))


class RandomEviction(PriorityEviction):
    """``[eviction] plugin = "random"``"""

    Settings = RandomSettings

    def __init__(self, settings: RandomSettings, context: PluginContext):
        super().__init__(settings, context)
        self.rng = random.Random(context.seed if settings.seed is None else settings.seed)

    def priority(self, block, now_s):
        # A random rank, drawn when the block becomes evictable and kept
        # until its next hit: the evictable blocks in a random order.
        return self.rng.random()
