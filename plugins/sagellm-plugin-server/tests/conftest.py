from pathlib import Path

import pytest
from sagellm_plugin_server.testing import Server, server_config
from sagellm_plugin_torch import testing


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return testing.save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-server"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    srv = Server(server_config(tmp_path_factory.mktemp("server"), tiny_model_dir))
    yield srv
    srv.stop()
