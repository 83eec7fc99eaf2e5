"""Plugins that the core tests declare through a synthetic distribution
(``sagellm_core.kit.testing.declare_plugins``); the core tests need no plugin
package installed."""

from attrs import field, frozen, validators

from sagellm_core import hookimpl
from sagellm_core.types import BlockAllocation, LifetimePrediction, PoolUsage


class TinyPool:
    """A free list: just enough allocator for the runtime to start."""

    def __init__(self, settings, context):
        self.free = list(range(context.num_blocks))
        self.num_blocks = context.num_blocks

    @hookimpl
    def sagellm_allocate_blocks(self, num_blocks):
        if num_blocks > len(self.free):
            return BlockAllocation(())
        taken, self.free = self.free[:num_blocks], self.free[num_blocks:]
        return BlockAllocation(tuple(taken))

    @hookimpl
    def sagellm_free_blocks(self, block_ids):
        self.free.extend(block_ids)
        return True

    @hookimpl
    def sagellm_pool_usage(self):
        return PoolUsage(self.num_blocks, len(self.free))


@frozen
class FixedSettings:
    tokens: int = field(default=100, validator=[validators.instance_of(int), validators.gt(0)])


class FixedLifetime:
    Settings = FixedSettings

    def __init__(self, settings, context):
        self.tokens = settings.tokens
        self.context = context

    @hookimpl
    def sagellm_predict_lifetime(self, request):
        return LifetimePrediction(self.tokens, self.tokens, self.tokens, 1.0, "fixed")


class Silent:
    """Implements no hook of its section."""

    def __init__(self, settings, context):
        pass


class Misspelt:
    def __init__(self, settings, context):
        pass

    @hookimpl
    def sagellm_predict_lifetme(self, request):
        return None


@frozen
class GreetingSettings:
    """A config section, ``[greeting]``, that a distribution declares."""

    repeat: int = 1
    text: str = "hello"

    def __attrs_post_init__(self) -> None:
        if self.repeat < 1:
            raise ValueError(f"repeat = {self.repeat!r}: a positive integer")
