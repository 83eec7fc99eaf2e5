"""sagellm's prefix-cache plugin deciding LMDeploy's prefix matches.

With ``[prefix_cache] plugin = ...`` in the config, :class:`SagellmBlockTrie`
asks the plugin instead of walking LMDeploy's trie: the plugin's index
(``radix``: namespaces, pinned prefixes, KV events; ``hash``: vLLM's
chained block hashes) holds LMDeploy's block ids, and LMDeploy's allocator
keeps the reference counts, as with its own trie: one reference for the
cache, one per sequence using the block.

* A match is ``sagellm_acquire_prefix`` on the sequence's tokens up to
  LMDeploy's own limit (``get_prefix_cache_max_match_step``: one token is
  always computed); the sequence takes a reference to each matched block.
* After LMDeploy allocates, the sequence's full blocks are inserted
  (``sagellm_insert_prefix``); a page cached meanwhile under another block
  is swapped for that block, as LMDeploy's trie folds duplicates.
* Locks: each call releases its plugin lock at once
  (``sagellm_release_prefix``). Which blocks sequences hold is LMDeploy's
  reference count, so every path that frees blocks (finish, preemption, a
  rolled-back tentative match) stays LMDeploy's; the evictable blocks are
  those only the cache references, less the plugin's pinned ones.

Text KV only: a sequence with multimodal spans or input embeddings, one
returning routed experts, or one whose MTP recompute overlap LMDeploy keeps
fresh, neither matches nor is cached (its blocks would be keyed by
placeholder tokens), and a model with SSM state checkpoints is refused.
"""

from __future__ import annotations

from sagellm_core.runtime import Runtime
from sagellm_core.types import CachedBlock, PrefixInsert, PrefixMatch, Request

EMPTY = PrefixMatch()


class PluginMatcher:
    def __init__(self, runtime: Runtime, block_size: int):
        self.runtime = runtime
        self.block_size = block_size

    @staticmethod
    def reusable(seq) -> bool:
        """Whether ``seq``'s KV is named by its token ids alone."""
        prefix_cache = seq.prefix_cache
        return not (
            prefix_cache.multimodal_spans
            or seq.history_embeddings.embeddings
            or seq.return_routed_experts
            or prefix_cache.recompute_overlap.recompute_blocks > 0
        )

    def request(self, seq, num_tokens: int) -> Request:
        # LMDeploy keeps adapters apart in its trie; the plugin's namespace
        # (a cache salt) does the same here.
        return Request(
            request_id=f"{seq.session_id}/{seq.seq_id}",
            prompt_token_ids=seq.history_cache[:num_tokens],  # int64: taken in one copy
            output_tokens=seq.sampling_param.max_new_tokens,
            cache_salt=f"adapter={seq.adapter_name}" if seq.adapter_name else None,
        )

    def _query(self, seq) -> Request:
        # The plugin leaves the last of the tokens it is given to compute.
        return self.request(seq, seq.get_prefix_cache_max_match_step() + 1)

    def lookup(self, seq) -> PrefixMatch:
        return self.runtime.host.lookup(self._query(seq)) if self.reusable(seq) else EMPTY

    def match(self, seq) -> list[CachedBlock]:
        """The cached blocks ``seq`` reuses after the blocks it holds: none
        unless it holds exactly its computed full blocks, and they are the
        plugin's match so far (a continued session)."""
        bs = self.block_size
        held = seq.num_history_ids // bs
        if not self.reusable(seq) or seq.num_history_ids % bs or seq.num_blocks != held:
            return []
        request = self._query(seq)
        # Acquired, not looked up, so the plugin counts the hit (pinning).
        match = self.runtime.host.acquire_prefix(request)
        self.runtime.host.release_prefix(request)
        if match.num_blocks <= held:
            return []
        if held and match.block_ids[:held] != tuple(seq.logical_blocks.get_real_blocks()[:held].tolist()):
            return []
        return list(match.blocks[held:])

    def insert(self, seq) -> tuple[PrefixInsert, dict[int, int]] | None:
        """Cache ``seq``'s computed full blocks. Returns the plugin's answer
        and each given block's position in the sequence."""
        if not self.reusable(seq):
            return None
        num_valid = seq.num_valid_ids
        if seq.kv_token_limit is not None:
            num_valid = min(num_valid, seq.kv_token_limit)
        num_full = min(num_valid // self.block_size, seq.num_blocks)
        if num_full == 0:
            return None
        block_ids = seq.logical_blocks.get_real_blocks()[:num_full].tolist()
        request = self.request(seq, num_full * self.block_size)
        result = self.runtime.host.insert_prefix(request, request.prompt_token_ids, block_ids)
        self.runtime.host.release_prefix(request)
        if result is None:
            return None
        return result, {block_id: i for i, block_id in enumerate(block_ids)}
