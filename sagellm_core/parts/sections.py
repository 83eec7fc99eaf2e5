"""The ``[limits]`` config section. Its values are checked by the type of
each field's default (:func:`sagellm_core.config._typed`)."""

from __future__ import annotations

from attrs import frozen


@frozen
class LimitsSettings:
    #: Seconds one hook call may run before it is stopped and its plugin
    #: named (a SIGALRM watchdog on the main thread); 0: no limit.
    hook_time_limit_s: float = 0.0
