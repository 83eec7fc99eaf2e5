from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def smollm2():
    from sagellm_plugin_torch import models

    return models.load("smollm2")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama checkpoint folder (safetensors): the same
    architecture as SmolLM2, fast enough for property-based tests, and it
    exercises the checkpoint-folder path."""
    from sagellm_plugin_torch.testing import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
