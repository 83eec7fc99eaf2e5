"""A victim-selection plugin for the adapter's tests (declared as an entry
point by the tests, never installed)."""

from sagellm_core import hookimpl
from sagellm_core.types import EvictionDecision


class StrangerVictims:
    """Names a block that is not evictable."""

    def __init__(self, settings, context):
        pass

    @hookimpl
    def sagellm_select_victims(self, num_blocks, candidates):
        return EvictionDecision((10**9,))
