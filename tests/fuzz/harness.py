"""Run one hostile case of the ``sagellm`` command in a child process with a
memory limit (``RLIMIT_AS``) and a time limit, and judge its outcome.

The child is forked from the test process (which has imported sagellm and
its plugins already, so a case costs milliseconds, not a second of
imports): it sets its limits, points its stdout and stderr at files, runs
``sagellm_core.cli.main(argv)`` and exits with its status. A case passes
when it ends one of two ways:

* **a clean error**: exit status 2 and exactly one line on stderr, naming
  the culprit (one of the strings the case expects);
* **a correct run**: exit status 0 and a report that is strict JSON (no
  ``NaN``, no ``Infinity``) whose counts add up: every request read is
  finished or rejected, the rejections by reason sum to the rejected, and,
  where the case knows how many requests its workload holds, that many were
  read.

Anything else -- a traceback, another status, a second line, a hang, a
child killed for memory, requests lost -- fails the case. Every outcome is
tallied per class for the table ``conftest.py`` prints.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

#: Seconds one case may run (its replay is tiny; a hang is what this catches).
TIME_LIMIT_S = float(os.environ.get("SAGELLM_FUZZ_TIME_LIMIT_S", "30"))
#: Address space a case may add to what the test process already maps.
MEMORY_LIMIT_BYTES = int(os.environ.get("SAGELLM_FUZZ_MEMORY_MB", "1536")) << 20
#: class -> outcome -> cases
TALLY: dict[str, Counter] = defaultdict(Counter)
OUTCOMES = ("cases", "clean errors", "correct runs", "tracebacks", "hangs", "lost requests", "other failures")


def _mapped_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * resource.getpagesize()


class Outcome:
    def __init__(self, status: int, stdout: str, stderr: str, report: Path, seconds: float):
        self.status, self.stdout, self.stderr, self.report, self.seconds = status, stdout, stderr, report, seconds

    @property
    def lines(self) -> list[str]:
        return self.stderr.splitlines()

    def __repr__(self) -> str:
        return f"Outcome(status={self.status}, stderr={self.stderr[-2000:]!r})"


def run_cli(argv: Sequence[str], env: dict[str, str] | None = None, setup: Callable[[], None] | None = None) -> Outcome:
    """``sagellm ARGV`` in a forked child under the limits; ``setup`` runs in
    the child first (a monkeypatch that must not leak into the tests)."""
    with tempfile.TemporaryDirectory(prefix="sagellm-fuzz-") as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        argv = [a.replace("{tmp}", folder) for a in argv]
        flags = [i for i, a in enumerate(argv[:-1]) if a == "--json"]
        report = Path(argv[flags[-1] + 1]) if flags else Path(folder) / "report.json"
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            status = 99
            try:
                limit = _mapped_bytes() + MEMORY_LIMIT_BYTES
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
                signal.signal(signal.SIGALRM, signal.SIG_DFL)  # killed by the alarm, not caught by a plugin
                signal.alarm(int(TIME_LIMIT_S) + 1)
                fd_out = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                fd_err = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(fd_out, 1)
                os.dup2(fd_err, 2)
                sys.stdout = open(1, "w", closefd=False)
                sys.stderr = open(2, "w", closefd=False)
                os.environ.update(env or {})
                os.chdir(folder)
                if setup is not None:
                    setup()
                from sagellm_core.cli import main

                status = main(list(argv))
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                traceback.print_exc()
                status = 98
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(status if isinstance(status, int) else 97)
        deadline = start + TIME_LIMIT_S + 5
        while True:
            done, wait_status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                wait_status = -1
                break
            time.sleep(0.005)
        seconds = time.monotonic() - start
        if wait_status == -1 or os.WIFSIGNALED(wait_status):
            status = -(os.WTERMSIG(wait_status) if wait_status != -1 else signal.SIGKILL)
        else:
            status = os.WEXITSTATUS(wait_status)
        result = Outcome(status, out.read_text(errors="replace"), err.read_text(errors="replace"), report, seconds)
        result.report_text = report.read_text(errors="replace") if report.is_file() else None
        return result


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def judge(
    klass: str, outcome: Outcome, culprits: Sequence[str] = (), expected_read: int | None = None, may_run: bool = True
) -> str:
    """Tally ``outcome`` under ``klass``; raise AssertionError unless it is a
    clean error naming one of ``culprits`` or (``may_run``) a correct run."""
    tally = TALLY[klass]
    tally["cases"] += 1
    problem = _problem(outcome, culprits, expected_read, may_run)
    if problem is None:
        kind = "clean errors" if outcome.status == 2 else "correct runs"
        tally[kind] += 1
        return kind
    kind, why = problem
    tally[kind] += 1
    raise AssertionError(f"{kind}: {why}; {outcome!r}")


def _problem(outcome: Outcome, culprits, expected_read, may_run):
    if outcome.status < 0 or outcome.status == 137:
        return "hangs", f"killed by signal {-outcome.status} after {outcome.seconds:.1f}s (time or memory limit)"
    if "Traceback (most recent call last)" in outcome.stderr:
        return "tracebacks", "a traceback"
    if outcome.status == 2:
        lines = outcome.lines
        if len(lines) != 1:
            return "other failures", f"{len(lines)} lines on stderr, not one"
        if culprits and not any(c in lines[0] for c in culprits):
            return "other failures", f"the error does not name any of {list(culprits)}"
        return None
    if outcome.status == 0 and may_run:
        if outcome.report_text is None:
            return "other failures", "exit 0 without a report"
        try:
            report = _strict(outcome.report_text)
        except ValueError as exc:
            return "other failures", f"the report is not strict JSON: {exc}"
        for r in report if isinstance(report, list) else [report]:
            read, done, rejected = r["requests_read"], r["requests"], r["rejected"]
            if done + rejected != read or sum(r["rejections"].values()) != rejected:
                return "lost requests", f"read {read}, finished {done}, rejected {rejected} ({r['rejections']})"
            if expected_read is not None and read != expected_read:
                return "lost requests", f"the workload holds {expected_read} requests, the run read {read}"
        return None
    return "other failures", f"exit status {outcome.status}"


def table() -> str:
    """The tally as a Markdown table, one row per class."""
    lines = ["| class | " + " | ".join(OUTCOMES) + " |", "|---|" + "---:|" * len(OUTCOMES)]
    total: Counter = Counter()
    for klass in sorted(TALLY):
        counts = TALLY[klass]
        total.update(counts)
        lines.append(f"| {klass} | " + " | ".join(str(counts[o]) for o in OUTCOMES) + " |")
    lines.append("| **all** | " + " | ".join(str(total[o]) for o in OUTCOMES) + " |")
    return "\n".join(lines) + "\n"
