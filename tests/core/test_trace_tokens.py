"""The trace loaders build token ids in bulk (numpy) and read Azure
timestamps with ``fromisoformat`` where ``strptime`` would read them the
same (building ids an int at a time was a third of a cache-only
replay, parsing timestamps a tenth of a timed Azure replay's load). These
tests hold the results to the definitions."""

from __future__ import annotations

import json
import struct
from datetime import datetime

import pytest

from sagellm_core.errors import TraceError
from sagellm_core.replay import workloads


def ids_as_unsigned(tokens) -> list[int]:
    return list(struct.unpack(f"{len(tokens)}Q", tokens.tobytes()))


@pytest.mark.parametrize("block_tokens", [1, 16, 512, 1000])
def test_mooncake_token_i_of_block_h_is_h_shifted_or_i(tmp_path, block_tokens):
    hashes = [2**32 - 1, 0, 2**31, 7]  # the top of the range too: the high bit of an int64
    length = 3 * block_tokens + (block_tokens + 1) // 2
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": length, "output_length": 1, "hash_ids": hashes}))
    (request,) = workloads.mooncake(str(path), trace_block_tokens=block_tokens)
    expected = [(h << 32) | i for b, h in enumerate(hashes) for i in range(block_tokens)][:length]
    assert ids_as_unsigned(request.prompt_token_ids) == expected


def test_mooncake_refuses_a_hash_id_out_of_range_or_not_an_integer(tmp_path):
    for bad in ([-1], [2**32], [1.0], [True], ["1"]):
        path = tmp_path / "t.jsonl"
        path.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": bad}))
        with pytest.raises(TraceError, match="hash_ids: a list of integers from 0 to 4,294,967,295"):
            list(workloads.mooncake(str(path)))


@pytest.mark.parametrize("lineno", [2, 255, 256, 70_000])
def test_azure_ids_are_a_run_from_the_lines_base(lineno):
    start = workloads._UNIQUE_BASE + lineno * (1 << 24)
    for count in (1, 374, 1 << 22):
        assert list(workloads._tokens(start, count)) == list(range(start, start + count))


@pytest.mark.parametrize(
    "stamp",
    ["2023-11-16 18:15:46.680590", "2024-02-29 23:59:59.999999", "2023-1-6 8:15:46.68", "2023-11-16 18:15:46.6"],
)
def test_azure_timestamps_read_as_strptime_reads_them(stamp):
    assert workloads._timestamp(stamp) == datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f")


def test_an_impossible_azure_timestamp_is_strptimes_error(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:15:46.6805900,3,4\n")
    with pytest.raises(TraceError, match=r"a.csv:2: time data '2023-13-16 18:15:46.680590' does not match format"):
        list(workloads.azure(str(path)))
