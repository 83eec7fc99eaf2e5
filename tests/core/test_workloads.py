import json

import attrs
import pytest

from sagellm_core.config import WorkloadSettings
from sagellm_core.errors import TraceError
from sagellm_core.replay import workloads
from sagellm_core.replay.workloads import GeneratorSettings, HintedSettings
from sagellm_core.types import KVHints


def write_mooncake(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_mooncake_blocks_map_to_tokens_for_any_block_size(tmp_path):
    trace = write_mooncake(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [7, 8]},
            {"timestamp": 1500, "input_length": 600, "output_length": 9, "hash_ids": [7, 9]},
        ],
    )
    a, b = workloads.mooncake(trace)
    assert a.num_prompt_tokens == 1000 and b.num_prompt_tokens == 600
    assert (a.arrival_s, b.arrival_s) == (0.0, 1.5)
    assert a.prompt_token_ids[:512] == b.prompt_token_ids[:512]  # same hash, same tokens
    assert a.prompt_token_ids[512:600] != b.prompt_token_ids[512:600]
    # 16-token blocks: the first 32 agree, the 33rd differs.
    for i in range(32):
        assert a.prompt_token_ids[i * 16 : (i + 1) * 16] == b.prompt_token_ids[i * 16 : (i + 1) * 16]
    assert a.prompt_token_ids[512:528] != b.prompt_token_ids[512:528]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "t.jsonl:2: not a JSON object: Expecting property name enclosed in double quotes"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 1}', "t.jsonl:2: missing key 'hash_ids'"),
        (
            '{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []}',
            "t.jsonl:2: input_length = 0: a positive integer, at most 4,194,304",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}',
            "t.jsonl:2: hash_ids: a list of integers from 0 to 4,294,967,295",
        ),
        (
            '{"timestamp": 1, "input_length": 1000, "output_length": 1, "hash_ids": [1]}',
            "t.jsonl:2: 1 hash_ids for input_length 1000; 512-token blocks need 2",
        ),
        (
            '{"timestamp": "x", "input_length": 10, "output_length": 1, "hash_ids": [1]}',
            "t.jsonl:2: timestamp = 'x': finite milliseconds",
        ),
        ("[1, 2]", "t.jsonl:2: not a JSON object"),
        (
            '{"timestamp": 1, "input_length": true, "output_length": 1, "hash_ids": [1]}',
            "t.jsonl:2: input_length = True: a positive integer, at most 4,194,304",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": true, "hash_ids": [1]}',
            "t.jsonl:2: output_length = True: a positive integer, at most 4,194,304",
        ),
        (
            '{"timestamp": true, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
            "t.jsonl:2: timestamp = True: finite milliseconds",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [false]}',
            "t.jsonl:2: hash_ids: a list of integers from 0 to 4,294,967,295",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1], "tenant": ["a"]}',
            "t.jsonl:2: tenant = ['a']: a string or an integer",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1], "session": true}',
            "t.jsonl:2: session = True: a string or an integer",
        ),
    ],
)
def test_broken_mooncake_line_is_one_line_error(tmp_path, line, message):
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}
    trace = write_mooncake(tmp_path / "t.jsonl", [good, line])
    with pytest.raises(TraceError) as err:
        list(workloads.mooncake(trace))
    assert str(err.value) == str(tmp_path / message)
    assert "\n" not in str(err.value)


def test_mooncake_keeps_session_tenant_and_cache_salt(tmp_path):
    trace = write_mooncake(
        tmp_path / "t.jsonl",
        [
            {
                "timestamp": 0,
                "input_length": 10,
                "output_length": 1,
                "hash_ids": [0],
                "session": 7,
                "tenant": "acme",
                "cache_salt": "u1",
            },
            {"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [0], "session_id": "s-2"},
            {"timestamp": 2, "input_length": 10, "output_length": 1, "hash_ids": [0]},
        ],
    )
    a, b, c = workloads.mooncake(trace)
    assert (a.session_id, a.tenant, a.cache_salt) == ("7", "acme", "u1")
    assert (b.session_id, b.tenant, b.cache_salt) == ("s-2", "default", None)
    assert (c.session_id, c.tenant, c.cache_salt) == (None, "default", None)


def test_arrivals_must_not_go_backwards(tmp_path):
    trace = write_mooncake(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 5000, "input_length": 10, "output_length": 1, "hash_ids": [0]},
            {"timestamp": 1000, "input_length": 10, "output_length": 1, "hash_ids": [1]},
        ],
    )
    settings = WorkloadSettings(source="mooncake", path=trace)
    with pytest.raises(TraceError, match=r"request 2 \(mooncake-2\) arrives at 1.0s, before the previous one \(5.0s\)"):
        list(workloads.load(settings))


def test_azure_csv(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
    )
    a, b = workloads.azure(str(path))
    assert (a.num_prompt_tokens, a.output_tokens, b.output_tokens) == (374, 44, 109)
    assert b.arrival_s == pytest.approx(4.314579, abs=1e-5)
    assert not set(a.prompt_token_ids) & set(b.prompt_token_ids)  # lengths only: nothing shared


@pytest.mark.parametrize(
    "content, message",
    [
        ("time,a,b\n", "a.csv:1: header"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,abc,4\n", "a.csv:2: invalid literal"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,4\n", "a.csv:2: time data 'yesterday'"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,3\n", "a.csv:2: expected 3 columns, got 2"),
    ],
)
def test_broken_azure_line(tmp_path, content, message):
    path = tmp_path / "a.csv"
    path.write_text(content)
    with pytest.raises(TraceError, match=message):
        list(workloads.azure(str(path)))


def test_generator_sessions_share_system_prompts_and_grow():
    s = WorkloadSettings(
        seed=1, options=GeneratorSettings(tenants=2, sessions_per_tenant=3, turns=3, system_prompt_tokens=64)
    )
    requests = list(workloads.generate(s))
    assert len(requests) == 2 * 3 * 3 == workloads.count(s)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    by_session = {}
    for r in requests:
        by_session.setdefault(r.session_id, []).append(r)
    for turns in by_session.values():
        for prev, cur in zip(turns, turns[1:]):
            # The next prompt extends the previous prompt and its reply.
            history = prev.prompt_token_ids + prev.output_token_ids
            assert cur.prompt_token_ids[: len(history)] == history
            assert cur.num_prompt_tokens > len(history)
    tenant0 = [r for r in requests if r.tenant == "tenant-0"]
    assert len({r.prompt_token_ids[:64].tobytes() for r in tenant0}) == 1
    first = {r.tenant: r.prompt_token_ids[:64].tobytes() for r in requests}
    assert first["tenant-0"] != first["tenant-1"]


def test_the_generator_sends_the_hints_its_sessions_know_and_changes_no_request():
    """Truthful: every turn but a session's last pins the tenant's system
    prompt, the last releases the session; a stated share wrong (the
    opposite about whether the session goes on) or missing; the requests the
    same in every mode."""

    def load(**keys):
        options = HintedSettings(tenants=2, sessions_per_tenant=40, turns=3, system_prompt_tokens=64, **keys)
        return list(workloads.load(WorkloadSettings(seed=5, options=options)))

    def facts(requests):
        return [(r.request_id, r.prompt_token_ids.tobytes(), r.arrival_s, r.session_id) for r in requests]

    plain, told = load(), load(hints=True)
    assert facts(told) == facts(plain) and all(r.kv_hints is None for r in plain)
    last = {r.session_id: r.request_id for r in told}
    for r in told:
        ends = last[r.session_id] == r.request_id
        assert r.kv_hints == (KVHints(release=True) if ends else KVHints(pin=64)), r.request_id
    for key in ("hints_wrong", "hints_missing"):
        spoiled = load(hints=True, **{key: 0.3})
        assert facts(spoiled) == facts(told)
        changed = [(a.kv_hints, b.kv_hints) for a, b in zip(told, spoiled) if a.kv_hints != b.kv_hints]
        assert 0.2 < len(changed) / len(told) < 0.4, key
        if key == "hints_missing":
            assert all(b is None for _, b in changed)
        else:
            assert all(b is not None and a.release != b.release for a, b in changed)


def test_generator_is_seeded():
    s = WorkloadSettings(seed=3, options=GeneratorSettings(sessions_per_tenant=2))
    a = [(r.request_id, r.arrival_s, r.prompt_token_ids.tobytes()) for r in workloads.generate(s)]
    b = [(r.request_id, r.arrival_s, r.prompt_token_ids.tobytes()) for r in workloads.generate(s)]
    c = [
        (r.request_id, r.arrival_s)
        for r in workloads.generate(WorkloadSettings(seed=4, options=GeneratorSettings(sessions_per_tenant=2)))
    ]
    assert a == b
    assert [x[:2] for x in a] != c


def test_time_scale_stretches_arrivals():
    base = [
        r.arrival_s for r in workloads.load(WorkloadSettings(seed=2, options=GeneratorSettings(sessions_per_tenant=2)))
    ]
    slow = [
        r.arrival_s
        for r in workloads.load(
            WorkloadSettings(seed=2, time_scale=3.0, options=GeneratorSettings(sessions_per_tenant=2))
        )
    ]
    assert slow == pytest.approx([3.0 * a for a in base]) and max(base) > 0


def test_session_range_keeps_whole_sessions_reproducibly():
    from sagellm_core.replay.workloads import session_draw

    base = WorkloadSettings(source="generator", options=GeneratorSettings(tenants=2, sessions_per_tenant=20, turns=3))
    everything = list(workloads.load(base))
    low = list(workloads.load(attrs.evolve(base, session_to=0.5)))
    high = list(workloads.load(attrs.evolve(base, session_from=0.5)))
    assert sorted(r.request_id for r in low + high) == sorted(r.request_id for r in everything)
    assert all(session_draw(r) < 0.5 for r in low) and 0 < len(low) < len(everything)
    sessions = {r.session_id for r in low}
    assert all(r.session_id not in sessions for r in high)  # a conversation is never split


def test_tenant_skew_makes_a_few_tenants_bring_most_sessions():
    from collections import Counter

    even = WorkloadSettings(source="generator", options=GeneratorSettings(tenants=4, sessions_per_tenant=50, turns=1))
    skewed = attrs.evolve(even, options=attrs.evolve(even.options, tenant_skew=1.5))
    count = Counter(r.tenant for r in workloads.load(even))
    assert set(count.values()) == {50}
    skew = Counter(r.tenant for r in workloads.load(skewed))
    assert sum(skew.values()) == 200 and skew["tenant-0"] > 2 * skew["tenant-3"]
    # The unskewed workload is what it was: arrivals and prompts untouched.
    again = [(r.arrival_s, r.num_prompt_tokens) for r in workloads.load(even)]
    assert again == [
        (r.arrival_s, r.num_prompt_tokens)
        for r in workloads.load(attrs.evolve(even, options=attrs.evolve(even.options, tenant_skew=0.0)))
    ]


def test_ttft_slo_gives_every_request_a_deadline_after_its_scaled_arrival():
    base = WorkloadSettings(seed=2, time_scale=2.0, options=GeneratorSettings(sessions_per_tenant=2))
    assert all(r.deadline_s is None for r in workloads.load(base))
    timed = list(workloads.load(attrs.evolve(base, ttft_slo_s=1.5)))
    assert [r.deadline_s for r in timed] == pytest.approx([r.arrival_s + 1.5 for r in timed])


# Hardening classes 2, 5 and 6: every trace value that would lose requests,
# exhaust memory or raise a traceback is one line naming the line, checked
# before anything is allocated.

MOONCAKE_HOSTILE = [
    ('{"timestamp": NaN, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp = nan: finite"),
    ('{"timestamp": Infinity, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp = inf: finite"),
    ('{"timestamp": 1, "input_length": 1000000000, "output_length": 1, "hash_ids": [1]}', "input_length = 1000000000"),
    (
        '{"timestamp": 1, "input_length": 10, "output_length": 1000000000, "hash_ids": [1]}',
        "output_length = 1000000000",
    ),
    ('{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [4611686018427387904]}', "hash_ids: a list"),
]


@pytest.mark.parametrize("line, message", MOONCAKE_HOSTILE)
def test_class2_and_class5_hostile_mooncake_values_are_one_line_errors(tmp_path, line, message):
    trace = write_mooncake(tmp_path / "t.jsonl", [line])
    with pytest.raises(TraceError, match=f"t.jsonl:1: {message}") as err:
        list(workloads.mooncake(trace))
    assert "\n" not in str(err.value)


def test_class5_an_overlong_mooncake_line_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    monkeypatch.setattr(workloads, "MAX_LINE_CHARS", 100)
    trace = write_mooncake(
        tmp_path / "t.jsonl", [{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [0] * 40}]
    )
    with pytest.raises(TraceError, match=r"t.jsonl:1: a \d+-character line; at most 100"):
        list(workloads.mooncake(trace))


def test_class5_a_huge_trace_block_builds_only_the_prompt(tmp_path):
    # 10 tokens in one 4M-token block: the ids stop at the prompt's end.
    trace = write_mooncake(
        tmp_path / "t.jsonl", [{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [3]}]
    )
    (request,) = workloads.mooncake(trace, trace_block_tokens=1 << 22)
    assert list(request.prompt_token_ids) == [(3 << 32) | i for i in range(10)]


@pytest.mark.parametrize("context, generated", [(10**9, 4), (4, 10**9), (0, 4)])
def test_class5_azure_token_counts_are_bounded(tmp_path, context, generated):
    path = tmp_path / "a.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,{context},{generated}\n")
    with pytest.raises(TraceError, match="a.csv:2: token counts must be positive and at most 4,194,304"):
        list(workloads.azure(str(path)))
