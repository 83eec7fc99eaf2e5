"""Compaction in the real engine: the `runs` pool moves cached blocks no
request holds, and their K/V bytes move with them inside the engine's KV
tensor (the device's `copy_blocks`), so every later prefix hit on a moved
block computes exactly what it would have without the move."""

import pytest
from sagellm_plugin_torch import testing as helpers

from sagellm_core.types import Request

PREFIXES = [list(range(5, 18)), list(range(30, 41)), list(range(50, 59))]  # 13, 11, 9 tokens: partial last blocks


def core_with(tmp_path, tiny_model_dir, pool: str):
    path = helpers.write_config(
        tmp_path, model=str(tiny_model_dir), num_blocks=24, block_size=4, max_num_seqs=4, max_num_batched_tokens=64
    )
    path.write_text(path.read_text().replace('plugin = "paged"\n', pool))
    return helpers.engine_core(path)


@pytest.mark.parametrize("moves", ["islands", "gather", "pieces"])
def test_compaction_moves_real_kv_bytes_and_changes_no_token(tmp_path, tiny_model_dir, moves):
    compacting = f'plugin = "runs"\ncompact = true\nmoves = "{moves}"\nmax_fragmentation = 0.0\nmin_steps_between = 1\n'
    runs = []
    for pool in ('plugin = "runs"\n', compacting):
        core = core_with(tmp_path, tiny_model_dir, pool)
        generated = {}
        for wave in range(6):  # each wave reuses the prefixes the earlier ones cached, moved or not
            requests = [
                Request(
                    f"w{wave}-{i}", PREFIXES[(i + wave) % 3] + [70 + wave, 80 + i, 90 + wave * i], 1 + (i + wave) % 4
                )
                for i in range(5)
            ]
            generated.update(core.generate(requests))
            core.rt.check_invariants()
        c = core.rt.counters
        runs.append((generated, c.hit_blocks, c.evicted_blocks, c.moved_blocks))
    (plain, plain_hits, plain_evicted, _), (moved, hits, evicted, moved_blocks) = runs
    assert moved_blocks > 0 and hits > 0 and evicted > 0  # blocks moved, and the cache was hit and full
    assert (hits, evicted) == (plain_hits, plain_evicted)
    assert moved == plain  # a hit on a block whose bytes did not move would compute other tokens
