"""A per-call time limit on hooks (``[limits] hook_time_limit_s``), and the
guard that keeps a failing lifetime predictor's observations from stopping
a run that has a fallback.

The watchdog is a pluggy wrapper plugin, like the hook timer: registered
only when a limit is set, so it costs nothing otherwise. Around every hook
call it arms a ``SIGALRM`` timer (``signal.setitimer``); when the call runs
past the limit, :class:`HookTimeout` is raised inside it, and the checked
call names the plugin that was running. Signals reach only the main
thread: the runtime refuses a limit elsewhere. A plugin blocked inside C
code that does not return to the interpreter is not interrupted.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Generator, Iterator
from typing import Any

from sagellm_core.hookspecs import PROJECT, hookimpl
from sagellm_core.timing import HOOK_NAMES


class HookTimeout(BaseException):
    """A hook call ran past the time limit. A BaseException, so that a
    plugin's ``except Exception`` does not swallow it."""


def _make_wrapper(name: str) -> Callable[..., Any]:
    def wrapper(self: Any) -> Generator[None, Any, Any]:
        with self.armed():
            return (yield)

    wrapper.__name__ = name
    return hookimpl(wrapper=True, tryfirst=True)(wrapper)


class Watchdog:
    """A pluggy wrapper plugin arming a timer around every hook call."""

    def __init__(self, limit_s: float):
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("a hook time limit needs the runtime on the main thread (signals reach only it)")
        self.limit_s = limit_s

        def expired(signum: int, frame: Any) -> None:
            raise HookTimeout(f"ran past the {limit_s:g} s limit on one hook call ([limits] hook_time_limit_s)")

        signal.signal(signal.SIGALRM, expired)

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """The limit on one call: a hook's (as a wrapper), or a KV store's method's."""
        previous = signal.setitimer(signal.ITIMER_REAL, self.limit_s)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, *previous)


for _name in HOOK_NAMES:
    if _name != "sagellm_register_commands":
        setattr(Watchdog, _name, _make_wrapper(_name))


def guard_observations(instance: Any, on_failure: Callable[[BaseException, str], None]) -> None:
    """Make ``instance``'s observation hooks (all but the prediction) report
    a failure to ``on_failure(exc, hook name)`` instead of raising: a
    lifetime predictor with a fallback must not stop the run from an
    observation either. Done on the instance, before it is registered."""
    marker = f"{PROJECT}_impl"
    for name in HOOK_NAMES:
        method = getattr(instance, name, None)
        if method is None or name == "sagellm_predict_lifetime" or getattr(method, marker, None) is None:
            continue

        def guarded(*args: Any, __method: Any = method, __name: str = name, **kwargs: Any) -> Any:
            try:
                return __method(*args, **kwargs)
            except (Exception, SystemExit, HookTimeout) as exc:
                on_failure(exc, __name)
                return None

        setattr(instance, name, functools.wraps(method)(guarded))
