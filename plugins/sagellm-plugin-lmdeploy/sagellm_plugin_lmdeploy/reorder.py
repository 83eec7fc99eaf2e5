"""The waiting-prefill order from sagellm's scheduling passes.

LMDeploy builds a ``_PrefillReorderer`` every prefill turn and asks it for
the order in which to try the waiting sequences. ``SagellmPrefillReorderer``
keeps LMDeploy's one rule that protects resources (sequences whose remote KV
has already been loaded go first: they hold blocks) and hands the rest, in
arrival order, to the pass pipeline. Each sequence gets a
:class:`SequenceState` the first time it waits (with a lifetime prediction
and the trie's cached-token count as the hint), kept while it lives.
"""

from __future__ import annotations

import weakref

from sagellm_core.errors import PluginError
from sagellm_core.types import Request, RequestStatus, ScheduleIR, SequenceState
from sagellm_plugin_lmdeploy.compat import _PrefillReorderer

#: id(sequence) -> its state, dropped when LMDeploy drops the sequence
#: (sequences are unhashable dataclasses: no WeakKeyDictionary).
_states: dict[int, SequenceState] = {}


def sequence_state(seq, runtime, trie) -> SequenceState:
    """sagellm's state of an LMDeploy sequence, made (with a lifetime
    prediction, the cached prefix as the hint, and the arrival observed)
    the first time sagellm sees it, kept while it lives. A session's next
    turn (LMDeploy's interactive mode gives the sequence new input tokens
    and a new ``arrive_time``) is a new request."""
    state = _states.get(id(seq))
    if state is None or state.request.arrival_s != seq.arrive_time:
        request = Request(
            request_id=f"{seq.session_id}/{seq.seq_id}",
            prompt_token_ids=seq.all_ids,
            output_tokens=seq.sampling_param.max_new_tokens,
            arrival_s=seq.arrive_time,
        )
        if state is None:
            weakref.finalize(seq, _states.pop, id(seq), None)
        # The trie's match (or the prefix-cache plugin's, through it).
        state = _states[id(seq)] = runtime.arrive(request, match=trie.arrival_match(seq))
    return state


def forget_state(seq) -> SequenceState | None:
    """Drop (and return) the state of a sequence LMDeploy lets go of."""
    return _states.pop(id(seq), None)


class SagellmPrefillReorderer(_PrefillReorderer):
    def reorder(self, waiting, turn_policy):
        trie = self.prefill_scheduler.block_trie
        observer = getattr(trie, "sagellm", None)
        if observer is None:  # a stock trie: LMDeploy's own order
            return super().reorder(waiting, turn_policy)
        runtime = observer.runtime
        load = self.prefill_scheduler.load_coordinator
        ready = [seq for seq in waiting if load.is_remote_ready(seq)]
        rest = sorted((seq for seq in waiting if not load.is_remote_ready(seq)), key=lambda seq: seq.arrive_time)
        if len(rest) < 2:
            return ready + rest
        states = [sequence_state(seq, runtime, trie) for seq in rest]
        for state, seq in zip(states, rest):
            state.num_computed_tokens = seq.num_history_ids
            state.status = RequestStatus.WAITING
        by_state = {id(state): seq for state, seq in zip(states, rest)}
        ir = ScheduleIR(
            now_s=runtime.now_s,
            waiting=list(states),
            running=[],
            token_budget=self.prefill_scheduler.cache_config.max_prefill_token_num,
            max_num_seqs=self.prefill_scheduler.scheduler_config.max_batches,
        )
        runtime.schedule(ir)
        if ir.chunk_limits:
            # LMDeploy sizes each prefill itself: the caps would be dropped unsaid.
            raise PluginError(
                f"{runtime.host.who('scheduler')} set chunk_limits (per-request chunk caps), which the lmdeploy"
                " engine does not honour: LMDeploy sizes each prefill itself; run chunk-capping passes"
                " (tenant-shares) on the replay or torch engine"
            )
        return ready + [by_state[id(state)] for state in ir.waiting]
