"""Victim-selection plugins for the adapter's tests (declared as entry
points by the tests, never installed)."""

from sagellm_core import hookimpl
from sagellm_core.types import EvictionDecision, PreemptionDecision


class OldestFirstPreemption:
    """Preempts the running request that arrived first (vLLM would take the
    last); evicts nothing it is asked for beyond what LRU order gives."""

    def __init__(self, settings, context):
        self.order = {}

    @hookimpl
    def sagellm_blocks_released(self, blocks):
        for block in reversed(blocks):
            self.order[block.block_id] = None

    @hookimpl
    def sagellm_blocks_touched(self, blocks):
        for block in blocks:
            self.order.pop(block.block_id, None)

    @hookimpl
    def sagellm_blocks_evicted(self, blocks):
        for block in blocks:
            self.order.pop(block.block_id, None)

    @hookimpl
    def sagellm_select_victims(self, num_blocks, candidates):
        return EvictionDecision(tuple(self.order)[:num_blocks])

    @hookimpl
    def sagellm_select_preemption(self, running, needed_by):
        return PreemptionDecision(min(running, key=lambda s: s.request.arrival_s).request_id)
