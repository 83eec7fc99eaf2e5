"""The reproducible held-out split: whole conversations (sessions) are held
out by the core's stable per-session draw, so no turn of a test conversation
is trained on. A replay of just the held-out conversations:
``[workload] session_to = 0.1``."""

from __future__ import annotations

from sagellm_core.replay.workloads import session_draw
from sagellm_core.types import Request

TEST_FRACTION = 0.1


def held_out(request: Request, fraction: float = TEST_FRACTION) -> bool:
    return session_draw(request) < fraction
