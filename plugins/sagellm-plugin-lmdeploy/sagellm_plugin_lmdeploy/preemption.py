"""The running sequence LMDeploy preempts when another cannot grow, chosen
by sagellm's ``sagellm_select_preemption`` (``[eviction]``).

LMDeploy's ``Scheduler.schedule_running`` walks the decode batch from its
end; for each sequence that needs a block it asks the eviction helper for
room (``try_make_capacity_for``: free blocks, then the blocks of waiting
sequences, then cached trie blocks), and preempts that sequence itself when
there is none. So LMDeploy's victim is always the sequence that asked, and
the batch's later sequences go first.

``SagellmEvictionHelper`` keeps all of that and adds the choice: when
LMDeploy's helper finds no room, the policy chooses among the sequence that
asked and the running sequences the walk has not reached yet (those before
it in the batch; the ones after it already hold this step's blocks and may
not lose them). A victim other than the asker is preempted with LMDeploy's
own ``preempt_seqs`` and its blocks reclaimed by LMDeploy's helper; the walk
then finds it no longer running and leaves it out of the step. Choosing the
asker keeps LMDeploy's behaviour, which is what the LRU plugin's FCFS rule
(the last of the candidates) does.

The helper learns the batch from ``schedule_running``, which
:func:`sagellm_plugin_lmdeploy.install.install` wraps to hand it over.
"""

from __future__ import annotations

from sagellm_core.types import RequestStatus
from sagellm_plugin_lmdeploy import compat
from sagellm_plugin_lmdeploy.reorder import sequence_state


class SagellmEvictionHelper(compat.RecomputeEvictionHelper):
    #: ``(scheduler, decode batch)`` while ``Scheduler.schedule_running`` runs.
    batch: tuple | None = None

    def try_make_capacity_for(self, seq, evictable_seqs, prealloc_size: int) -> bool:
        if super().try_make_capacity_for(seq, evictable_seqs, prealloc_size):
            return True
        observer = getattr(self.block_trie, "sagellm", None)
        if self.batch is None or observer is None:
            return False
        scheduler, running = self.batch
        position = next((i for i, other in enumerate(running) if other is seq), None)
        if position is None:
            return False
        runtime = observer.runtime
        while True:
            candidates = [s for s in running[:position] if s.status == compat.MessageStatus.RUNNING] + [seq]
            if len(candidates) == 1:
                return False
            states = [sequence_state(s, runtime, self.block_trie) for s in candidates]
            for state, s in zip(states, candidates):
                state.status = RequestStatus.RUNNING
                state.num_computed_tokens = s.num_history_ids
            chosen = runtime.select_preemption(states, states[-1])
            victim = next(s for s, state in zip(candidates, states) if state is chosen)
            if victim is seq:
                return False
            scheduler.preempt_seqs((victim,))
            if super().try_make_capacity_for(seq, (victim,), prealloc_size):
                return True


def build_eviction_helper(eviction_type, **kwargs):
    """LMDeploy's builder (its checks and warnings), with sagellm's helper
    in place of its recompute helper."""
    helper = compat.build_eviction_helper(eviction_type, **kwargs)
    if type(helper) is compat.RecomputeEvictionHelper:
        return SagellmEvictionHelper(**kwargs)
    return helper


def schedule_running(scheduler, running, num_required_tokens: int = 1, prealloc_size: int = 1):
    """``Scheduler.schedule_running``, telling sagellm's helper the batch."""
    helper = scheduler.eviction_helper
    if not isinstance(helper, SagellmEvictionHelper):
        return compat.stock_schedule_running(scheduler, running, num_required_tokens, prealloc_size)
    helper.batch = (scheduler, running)
    try:
        return compat.stock_schedule_running(scheduler, running, num_required_tokens, prealloc_size)
    finally:
        helper.batch = None
