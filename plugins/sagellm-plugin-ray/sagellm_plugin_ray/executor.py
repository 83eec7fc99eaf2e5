"""The ``ray`` executor: each replay of ``compare``, ``sweep`` and
``evaluate-policies`` a Ray task, placed by Ray on the machines of a Ray
cluster.

It joins the cluster that ``RAY_ADDRESS`` names (``ray start --head`` on
one machine, ``ray start --address HEAD:6379`` on the others, the same
sagellm distributions installed on each), or, without it, starts Ray on
this machine for the call and stops it afterwards. At most ``--workers``
runs are in flight at once; each asks Ray for one CPU, so Ray spreads them
over the cluster's free CPUs. A run's result comes back by value (its
report and recorder, without the runtime), so nothing of one run's plugins
reaches another.

A run that fails fails the same way on any machine (the replay is
deterministic), so tasks are not retried: the first error is raised here
as the run raised it, and the runs still in flight are cancelled."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import ray

#: Ray's own variable for the cluster to join (``ray.init``'s ``address``).
ADDRESS_ENV = "RAY_ADDRESS"


class RayTasks:
    """:class:`sagellm_core.replay.session.Executor` on Ray."""

    def map(self, run: Callable[[Any], Any], jobs: Sequence[Any], workers: int) -> list[Any]:
        started = not ray.is_initialized()
        if started:
            address = os.environ.get(ADDRESS_ENV) or None
            # log_to_driver off: the tasks' progress bars and warnings stay in
            # Ray's logs; the command prints its own table.
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            return _map(ray.remote(num_cpus=1, max_retries=0)(run), jobs, workers)
        finally:
            if started:
                ray.shutdown()


def _map(task: Any, jobs: Sequence[Any], workers: int) -> list[Any]:
    """``task`` over ``jobs``, at most ``workers`` in flight; results in order."""
    results: list[Any] = [None] * len(jobs)
    index: dict[Any, int] = {}
    pending = iter(enumerate(jobs))
    in_flight: list[Any] = []

    def submit() -> None:
        for i, job in pending:
            ref = task.remote(job)
            index[ref] = i
            in_flight.append(ref)
            if len(in_flight) >= workers:
                return

    submit()
    try:
        while in_flight:
            done, rest = ray.wait(in_flight, num_returns=1)
            in_flight[:] = rest
            for ref in done:
                results[index.pop(ref)] = ray.get(ref)
            submit()
    except ray.exceptions.RayTaskError as exc:
        for ref in in_flight:
            ray.cancel(ref, force=True)
        # The run's own exception (a ConfigError, a PluginError), not Ray's
        # wrapper with the remote traceback: its one line is the message.
        cause = exc.cause
        raise (cause if isinstance(cause, BaseException) else exc) from None
    return results
