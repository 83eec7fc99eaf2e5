"""Requests arriving at and leaving a live LMDeploy engine, told to sagellm.

LMDeploy registers every new sequence through
``SequenceLifecycle.add_sequence`` and lets it go through
``SequenceLifecycle.remove_sequence`` (after it ended, or when its session
is dropped). The adapter wraps both: at arrival the sequence gets its
:class:`SequenceState` (a lifetime prediction, the cached prefix it would
hit) and ``sagellm_request_arrived`` is observed; at removal, once LMDeploy
has freed its blocks, the runtime concludes it and
``sagellm_request_finished`` is observed with the tokens it generated. So
online lifetime predictors learn from LMDeploy's finished requests, and
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


def add_sequence(lifecycle, seq, status) -> None:
    compat.stock_add_sequence(lifecycle, seq, status)
    trie = _sagellm_trie(lifecycle)
    if trie is not None:
        runtime = trie.sagellm.runtime
        runtime.now_s = time.perf_counter()
        sequence_state(seq, runtime, trie)


def remove_sequence(lifecycle, seq) -> None:
    compat.stock_remove_sequence(lifecycle, seq)
    state = forget_state(seq)
    trie = _sagellm_trie(lifecycle)
    if trie is None or state is None:
        return
    runtime = trie.sagellm.runtime
    runtime.now_s = state.finish_s = time.perf_counter()
    state.num_output_tokens = seq.num_new_tokens
    runtime.conclude(state)
