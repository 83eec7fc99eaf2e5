"""The prefix-cache plugin's block-hash index keys blocks as vLLM does: its
hashes equal those vLLM's own request block hasher gives the same request."""

import pytest
from sagellm_plugin_prefix_cache.hashindex import HashPrefixCache, HashSettings
from sagellm_plugin_vllm import compat as v

from sagellm_core import PluginContext
from sagellm_core.types import Request

BS = 16


@pytest.mark.parametrize("salt", [None, "user-7"])
def test_block_hashes_equal_vllms(salt):
    v.init_none_hash(v.sha256)
    tokens = [(i * 7919) % 32000 for i in range(BS * 5 + 3)]
    ours = HashPrefixCache(HashSettings(), PluginContext("hash", BS, 100))
    r = Request("r", tokens, 1, cache_salt=salt)
    ours.sagellm_acquire_prefix(request=r)
    ours.sagellm_insert_prefix(request=r, token_ids=r.prompt_token_ids[: BS * 5], block_ids=list(range(5)))
    theirs = v.VllmRequest(
        request_id="r",
        prompt_token_ids=tokens,
        sampling_params=v.SamplingParams(max_tokens=1),
        pooling_params=None,
        arrival_time=0.0,
        cache_salt=salt,
        block_hasher=v.get_request_block_hasher(BS, v.sha256),
    )
    assert [ours.block_hash(b) for b in range(5)] == [bytes(h) for h in theirs.block_hashes]
