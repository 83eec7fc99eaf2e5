from pathlib import Path

import pytest

pytest.importorskip("lmdeploy", reason="LMDeploy is not installed (tox -e lmdeploy installs it)")

HERE = Path(__file__).resolve().parent
TRACES = HERE.parents[2].parent / "shared" / "data" / "traces"


@pytest.fixture
def mooncake():
    path = TRACES / "mooncake_conversation.jsonl"
    if not path.exists():
        pytest.skip(f"the shared traces are not at {TRACES}")
    return path
