"""Run LMDeploy's own paging tests twice: with LMDeploy's classes, then with
sagellm's installed (``sagellm_substitute.py``), and check that the adapter
fails nothing that stock LMDeploy passes.

    python plugins/sagellm-plugin-lmdeploy/tests/lmdeploy_suite/run.py --tests DIR

``DIR`` is ``tests/pytorch/paging`` of an LMDeploy source checkout: LMDeploy
ships no tests in its wheels and no sdist on PyPI. Tests that fail with the
stock wheel too are listed with LMDeploy's error, the reason.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from sagellm_core.kit.testing import junit_results

HERE = Path(__file__).resolve().parent


def run_suite(tests: Path, substitute: bool, report: Path) -> tuple[int, dict[str, str]]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    args = [sys.executable, "-m", "pytest", str(tests), "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    args += ["--continue-on-collection-errors", f"--junitxml={report}", "--rootdir", str(tests)]
    if substitute:
        args += ["-p", "sagellm_substitute"]
    subprocess.run(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return junit_results(report)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=Path, required=True, help="tests/pytorch/paging of an LMDeploy checkout")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        total, stock = run_suite(args.tests, False, Path(tmp) / "stock.xml")
        total_ours, ours = run_suite(args.tests, True, Path(tmp) / "sagellm.xml")
    print(f"LMDeploy paging tests from {args.tests}")
    print(f"  stock LMDeploy:      {total - len(stock)} passed, {len(stock)} failed")
    print(f"  sagellm installed:   {total_ours - len(ours)} passed, {len(ours)} failed")
    print("Failing with stock LMDeploy too (the reason is LMDeploy's own error):")
    for name, reason in sorted(stock.items()):
        print(f"  {name}: {reason}")
    regressions = sorted(set(ours) - set(stock))
    if regressions or total_ours != total:
        print("FAILED with sagellm's classes only:")
        for name in regressions:
            print(f"  {name}: {ours[name]}")
        return 1
    print("No test fails with sagellm's classes that passes with LMDeploy's.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
