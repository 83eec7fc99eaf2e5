"""Hook calls at the cost of a function call, with pluggy's semantics.

pluggy's ``HookCaller.__call__`` copies the implementation list, builds the
arguments and runs its general call loop (wrappers, teardowns, result
lists) on every call: about 3 µs a call here, which a timed replay pays
about 150 times a request and vLLM's block pool on every eviction. The
implementations change only when a plugin is registered or unregistered, so
:class:`Dispatch` plans each hook once (the functions in pluggy's order and
their argument names), drops the plans on a registration (a plugin
registered later is seen at the next call), and calls the plan. A hook
with a wrapper (the hook time limit's watchdog, or a plugin's own) goes
through pluggy, which runs wrappers; so does an implementation with
defaulted keyword parameters. The answers are pluggy's: the first
non-``None`` one for a ``firstresult`` hook, else the list of
non-``None`` ones, and an implementation's exception propagates as raised.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Any

import pluggy

from sagellm_core.timing import HookTimer

#: One implementation: its function and the hook arguments it takes, in order.
Impl = tuple[Callable[..., Any], tuple[str, ...]]
#: A hook's plan: ``firstresult``, and its implementations in call order; or
#: ``None`` where pluggy must run the call (wrappers, keyword defaults).
Plan = tuple[bool, tuple[Impl, ...]] | None


class PluginManager(pluggy.PluginManager):
    """pluggy's manager, counting the changes to its implementations (a
    :class:`Dispatch` drops its plans when the count moves)."""

    generation = 0

    def register(self, plugin: object, name: str | None = None) -> str | None:
        self.generation += 1
        return super().register(plugin, name)

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any | None:
        self.generation += 1
        return super().unregister(plugin, name)


class Dispatch:
    """Calls ``pm``'s hooks from cached plans, each call timed by ``timer``
    (when there is one)."""

    def __init__(self, pm: PluginManager, timer: HookTimer | None = None):
        self.pm = pm
        self.timer = timer
        self.plans: dict[str, Plan] = {}
        self._generation = pm.generation
        if timer is None:
            self.call = self._run  # type: ignore[method-assign]

    def plan(self, hook_name: str) -> Plan:
        caller = getattr(self.pm.hook, hook_name)
        impls = caller.get_hookimpls()
        if any(i.wrapper or i.hookwrapper or i.kwargnames for i in impls):
            plan: Plan = None
        else:
            firstresult = bool(caller.spec.opts.get("firstresult", False)) if caller.spec else False
            plan = (firstresult, tuple((i.function, tuple(i.argnames)) for i in reversed(impls)))
        self.plans[hook_name] = plan
        return plan

    def implemented(self, hook_name: str) -> bool:
        """Whether any plugin implements ``hook_name`` (an observation no
        plugin takes is not called, nor timed)."""
        if self._generation != self.pm.generation:
            self.plans.clear()
            self._generation = self.pm.generation
        plan = self.plans[hook_name] if hook_name in self.plans else self.plan(hook_name)
        return plan is None or bool(plan[1])

    def call(self, hook_name: str, kwargs: dict[str, Any], caller: Any = None) -> Any:
        """Call ``hook_name`` with ``kwargs``, or the hook caller ``caller``
        (a subset of the implementations) in its place, timed. (Untimed,
        :meth:`_run` stands in for it: one Python frame less per call.)"""
        stats = self.timer.stats[hook_name]  # type: ignore[union-attr]
        start = perf_counter()
        try:
            answer = self._run(hook_name, kwargs, caller)
        except BaseException:
            stats.errors += 1
            stats.record(perf_counter() - start, None)
            raise
        stats.record(perf_counter() - start, answer)
        return answer

    def _run(self, hook_name: str, kwargs: dict[str, Any], caller: Any = None) -> Any:
        if caller is not None:
            return caller(**kwargs)
        if self._generation != self.pm.generation:
            self.plans.clear()
            self._generation = self.pm.generation
        plan = self.plans[hook_name] if hook_name in self.plans else self.plan(hook_name)
        if plan is None:
            return getattr(self.pm.hook, hook_name)(**kwargs)
        firstresult, impls = plan
        if firstresult:
            for function, argnames in impls:
                answer = function(*[kwargs[a] for a in argnames])
                if answer is not None:
                    return answer
            return None
        answers = []
        for function, argnames in impls:
            answer = function(*[kwargs[a] for a in argnames])
            if answer is not None:
                answers.append(answer)
        return answers
