"""Config sections the kernel only carries: ``[server]`` (read by
``sagellm serve``) and ``[limits]``. Their values are checked by the type
of each field's default (:func:`sagellm_core.config._typed`)."""

from __future__ import annotations

from attrs import frozen


@frozen
class LimitsSettings:
    #: Seconds one hook call may run before it is stopped and its plugin
    #: named (a SIGALRM watchdog on the main thread); 0: no limit.
    hook_time_limit_s: float = 0.0


@frozen
class ServerSettings:
    """``sagellm serve`` (from ``sagellm-plugin-server``)."""

    #: Requests allowed to wait for admission; one more is answered 429.
    max_waiting: int = 256
    #: The model name clients send; empty: the engine's model setting.
    model_name: str = ""

    def __attrs_post_init__(self) -> None:
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting = {self.max_waiting!r}: a positive integer")
