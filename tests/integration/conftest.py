from pathlib import Path

import pytest

from sagellm_core.kit.testing import declare_plugins

HERE = Path(__file__).parent
PROJECT = HERE.parent.parent
TRACES = PROJECT.parent / "shared" / "data" / "traces"


@pytest.fixture
def bad_plugins(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.syspath_prepend(str(tmp_path))
    declare_plugins(
        tmp_path,
        {
            "sagellm.eviction": {
                "stranger": "sagellm_core.kit.testing:StrangerVictims",
                "greedy": "bad_plugins:GreedyVictims",
                "not-a-decision": "bad_plugins:NotADecision",
                "unfiltered": "bad_plugins:UnfilteredVictims",
            },
            "sagellm.kv_pool": {
                "generous": "bad_plugins:GenerousPool",
                "reusing": "bad_plugins:ReusingPool",
                "miscounting": "bad_plugins:MiscountingPool",
            },
            "sagellm.prefix_cache": {
                "over-matching": "bad_plugins:OverMatching",
                "adopting-strangers": "bad_plugins:AdoptingStrangers",
            },
            "sagellm.lifetime": {
                "crashing": "bad_plugins:CrashingLifetime",
                "multi-line": "bad_plugins:MultiLineCrash",
                "negative": "bad_plugins:NegativeLifetime",
                "garbage": "bad_plugins:GarbageLifetime",
            },
            "sagellm.scheduler_passes": {
                "dropping": "bad_plugins:DroppingPass",
                "stalling": "bad_plugins:StallingPass",
            },
        },
        name="sagellm-bad-plugins",
    )


@pytest.fixture
def traces():
    if not (TRACES / "mooncake_conversation.jsonl").exists():
        pytest.skip(f"the shared traces are not at {TRACES}")
    return TRACES
