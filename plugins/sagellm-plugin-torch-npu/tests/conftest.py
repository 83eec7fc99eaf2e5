from pathlib import Path

import pytest

pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama whose head size (16) Ascend's kernels accept."""
    from sagellm_plugin_torch.testing import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-npu"), hidden_size=64, num_heads=4, num_kv_heads=2)
