"""The hardening suite: hostile inputs and faulty plugins.

Short by default (a minute or two); longer with environment variables:

* ``SAGELLM_FUZZ_EXAMPLES=N``: hypothesis examples per property (default 20);
* ``SAGELLM_FUZZ_API_SECONDS=S``: the randomized run of the runtime's API
  per policy (default 3);
* ``SAGELLM_FUZZ_NIGHTLY=1``: 1,000 examples, 600 s of API run, random
  (not derandomized) generation;
* ``SAGELLM_FUZZ_TABLE=FILE``: also write the per-class table there.

At the end of a run the table of outcomes per class is printed: cases,
clean errors, correct runs, tracebacks, hangs, lost requests.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

HERE = Path(__file__).parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import harness  # noqa: E402

NIGHTLY = os.environ.get("SAGELLM_FUZZ_NIGHTLY") == "1"
EXAMPLES = int(os.environ.get("SAGELLM_FUZZ_EXAMPLES", "1000" if NIGHTLY else "20"))
API_SECONDS = float(os.environ.get("SAGELLM_FUZZ_API_SECONDS", "600" if NIGHTLY else "3"))

settings.register_profile(
    "sagellm-fuzz",
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not NIGHTLY,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
FUZZ = settings.get_profile("sagellm-fuzz")


def _declare(folder: Path, entry_points: dict, name: str):
    from sagellm_core.kit.testing import declare_plugins

    declare_plugins(folder, entry_points, name=name)


def _undeclare(folder: Path) -> None:
    if str(folder) in sys.path:
        sys.path.remove(str(folder))
    importlib.invalidate_caches()


WARM_CONFIG = """
[engine]
name = "replay"
mode = "timed"
[workload]
tenants = 1
sessions_per_tenant = 1
turns = 2
system_prompt_tokens = 16
[prefix_cache]
plugin = "radix"
[kv_pool]
plugin = "paged"
num_blocks = 64
[eviction]
plugin = "lru"
[lifetime]
plugin = "stat"
[scheduler]
passes = ["fcfs"]
[kv_stores]
tiers = ["host"]
"""


@pytest.fixture(scope="session", autouse=True)
def warm(tmp_path_factory):
    """One run in this process first, so the first-party plugins are
    imported once here and every forked case inherits them."""
    import matplotlib  # noqa: F401  -- --plot cases

    from sagellm_core.cli import main

    config = tmp_path_factory.mktemp("warm") / "warm.toml"
    config.write_text(WARM_CONFIG)
    assert main(["replay", "--config", str(config), "--quiet"]) == 0


@pytest.fixture(scope="module")
def fault_plugins(tmp_path_factory):
    """The fault-injection plugins (``faults.py``) as an installed
    distribution, for this module's tests only."""
    from faults import FAULTY

    folder = tmp_path_factory.mktemp("fault-plugins")
    entry_points: dict[str, dict[str, str]] = {}
    for section, (name, cls, _) in FAULTY.items():
        group = {"scheduler": "sagellm.scheduler_passes"}.get(section, f"sagellm.{section}")
        entry_points.setdefault(group, {})[name] = f"faults:{cls}"
    entry_points["sagellm.lifetime"]["exit-at-start"] = "faults:ExitAtStart"
    entry_points["sagellm.prefix_cache"]["lying-radix"] = "faults:LyingRadix"
    _declare(folder, entry_points, "sagellm-fuzz-faults")
    yield folder
    _undeclare(folder)


@pytest.fixture(scope="session")
def sharegpt_tokenizer():
    """The ShareGPT plugin's tokenizer, loaded once here: the forked cases
    inherit it instead of each loading it."""
    sharegpt = pytest.importorskip("sagellm_plugin_sharegpt")
    sharegpt._tokenizer()


def pytest_terminal_summary(terminalreporter):
    if not harness.TALLY:
        return
    text = harness.table()
    terminalreporter.write_sep("=", "sagellm hardening: outcomes per class")
    terminalreporter.write(text)
    target = os.environ.get("SAGELLM_FUZZ_TABLE")
    if target:
        Path(target).write_text(text)
