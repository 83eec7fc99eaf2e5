"""Requests arriving at and leaving a live LMDeploy engine, told to sagellm.

LMDeploy registers every new sequence through
``SequenceLifecycle.add_sequence``, moves it between states through
``SequenceLifecycle.transition``, and lets it go through
``SequenceLifecycle.remove_sequence``. The adapter wraps the three:

* a request arrives when a sequence is added, or when a stopped one is
  woken with a session's next turn (STOPPED to WAITING: LMDeploy's
  interactive mode gives it new input tokens first). It gets its
  :class:`SequenceState` (a lifetime prediction, the cached prefix it would
  hit) and ``sagellm_request_arrived`` is observed;
* it finishes when its sequence stops (generation done, or the session
  stopped) or is removed before that: the runtime concludes it and
  ``sagellm_request_finished`` is observed with the tokens it generated.

So online lifetime predictors learn from LMDeploy's finished requests, and
policies that hold state per request (``slo``) let go of it.

Times are LMDeploy's own clock (``time.perf_counter``, as its
``arrive_time``); the first token's time is not known here, so an outcome's
TTFT is its whole duration. The replay driver counts its requests itself and
turns this off (``installed(runtime, observe_requests=False)``).
"""

from __future__ import annotations

import time

from sagellm_plugin_lmdeploy import compat
from sagellm_plugin_lmdeploy.reorder import forget_state, sequence_state


def _sagellm_trie(lifecycle):
    trie = getattr(lifecycle._block_manager.allocator, "sagellm_trie", None)
    return trie if trie is not None and trie.observe_requests else None


def _arrive(trie, seq) -> None:
    runtime = trie.sagellm.runtime
    runtime.set_time(time.perf_counter())
    sequence_state(seq, runtime, trie)


def _finish(trie, seq) -> None:
    state = forget_state(seq)
    if state is None:
        return
    runtime = trie.sagellm.runtime
    state.finish_s = time.perf_counter()
    runtime.set_time(state.finish_s)
    state.num_output_tokens = seq.num_new_tokens
    runtime.conclude(state)


def add_sequence(lifecycle, seq, status) -> None:
    compat.stock_add_sequence(lifecycle, seq, status)
    trie = _sagellm_trie(lifecycle)
    if trie is not None:
        _arrive(trie, seq)


def transition(lifecycle, seq, new_state) -> None:
    before = seq.status
    compat.stock_transition(lifecycle, seq, new_state)
    trie = _sagellm_trie(lifecycle)
    if trie is None or before == new_state.status:
        return
    if new_state.status == compat.MessageStatus.STOPPED:
        _finish(trie, seq)
    elif before == compat.MessageStatus.STOPPED and new_state.status == compat.MessageStatus.WAITING:
        _arrive(trie, seq)


def remove_sequence(lifecycle, seq) -> None:
    compat.stock_remove_sequence(lifecycle, seq)
    trie = _sagellm_trie(lifecycle)
    if trie is not None:
        _finish(trie, seq)  # removed before it stopped
    else:
        forget_state(seq)
