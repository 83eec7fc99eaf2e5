"""``sagellm bench serve`` against a server that misbehaves: each answer that
is not a whole, parsed event stream is a failure counted by its reason."""

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import uvicorn
from sagellm_plugin_server import bench
from sagellm_plugin_server.testing import free_port

from sagellm_core.cli import main


def chunk(text: str, finish_reason: str | None = None) -> bytes:
    body = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}\n\n'
DONE = b"data: [DONE]\n\n"
#: What the server answers to a prompt that starts with each word: (status,
#: content type, body parts). ``stall`` and ``silent`` then wait for the
#: client to give up.
ANSWERS = {
    "good": (200, "text/event-stream", [chunk("a"), chunk(" b", "length"), USAGE, DONE]),
    "status": (500, "application/json", [b'{"error": {"message": "boom"}}']),
    "json": (200, "application/json", [b'{"choices": [{"text": "a", "finish_reason": "length"']),
    "garbage": (200, "text/event-stream", [chunk("a"), b'data: {"choices": [{"text": \n\n', DONE]),
    "truncated": (200, "text/event-stream", [chunk("a"), chunk(" b")]),
    "unfinished": (200, "text/event-stream", [chunk("a"), chunk(" b"), DONE]),
    "error": (200, "text/event-stream", [chunk("a"), b'data: {"error": {"message": "engine died"}}\n\n']),
    "stall": (200, "text/event-stream", [chunk("a")]),
    "silent": None,
}
EXPECTED = {
    "status": "http_500",
    "json": "not_event_stream",
    "garbage": "unparsable",
    "truncated": "truncated",
    "unfinished": "no_finish_reason",
    "error": "error_event",
    "stall": "timeout",
    "silent": "first_token_timeout",
}


async def misbehaving_app(scope, receive, send):
    """An OpenAI-style endpoint (raw ASGI) answering as ANSWERS says."""
    assert scope["type"] == "http"
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/v1/models":
        parts, status, kind = [b'{"object": "list", "data": [{"id": "fake"}]}'], 200, "application/json"
    else:
        word = json.loads(body)["prompt"].split()[0]
        if ANSWERS[word] is None:
            while (await receive())["type"] != "http.disconnect":
                pass
            return
        status, kind, parts = ANSWERS[word]
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind.encode())]})
    for part in parts:
        await send({"type": "http.response.body", "body": part, "more_body": True})
    if scope["path"] != "/v1/models" and word == "stall":
        while (await receive())["type"] != "http.disconnect":
            pass
        return
    await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def misbehaving_server():
    server = uvicorn.Server(
        uvicorn.Config(misbehaving_app, host="127.0.0.1", port=free_port(), log_level="critical", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "the test server did not start"
    yield f"http://127.0.0.1:{server.config.port}"
    server.should_exit = True
    thread.join(10)


def sharegpt(path, prompts):
    records = [{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "x y"}]} for p in prompts]
    path.write_text(json.dumps(records))
    return path


def test_each_kind_of_broken_answer_is_a_failure_with_its_reason(misbehaving_server, tmp_path, capsys):
    trace = sharegpt(tmp_path / "trace.json", [f"{word} please" for word in ANSWERS])
    out = tmp_path / "bench.json"
    args = ["bench", "serve", "--url", misbehaving_server, "--trace", str(trace), "--json", str(out)]
    assert main([*args, "--timeout", "8", "--first-token-timeout", "4", "--quiet"]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == len(ANSWERS) and report["completed"] == 1 and report["model"] == "fake"
    assert report["failures"] == {reason: 1 for reason in EXPECTED.values()}
    assert report["failed"] == len(EXPECTED) and report["output_tokens"] == 2  # the good one's usage
    assert main([*args, "--timeout", "8", "--first-token-timeout", "4"]) == 0
    table = capsys.readouterr().out
    assert all(f"failed: {reason}" in table for reason in EXPECTED.values())


def test_no_server_is_a_connection_failure_for_every_request(tmp_path):
    trace = sharegpt(tmp_path / "trace.json", ["good one", "good two"])
    out = tmp_path / "bench.json"
    url = f"http://127.0.0.1:{free_port()}"
    args = ["bench", "serve", "--url", url, "--model", "m", "--trace", str(trace), "--json", str(out), "--quiet"]
    assert main(args) == 1  # nothing completed
    assert json.loads(out.read_text())["failures"] == {"connection": 2}


@pytest.mark.parametrize("flag", ["--timeout", "--first-token-timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_timeouts_must_be_positive(tmp_path, capsys, flag, value):
    trace = sharegpt(tmp_path / "trace.json", ["good"])
    args = ["bench", "serve", "--url", "http://127.0.0.1:1", "--trace", str(trace), flag, value, "--quiet"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"{flag} {float(value)}: a positive number of seconds") and "\n" not in err


def test_azure_rows_become_prompts_of_their_token_counts(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,12,109\n"
        "2023-11-16 18:15:51.0000000,374,3\n"
    )
    args = SimpleNamespace(trace=str(path), max_tokens=64, max_requests=None, rate=None, seed=0, words_per_block=32)
    requests = bench.load(args)
    assert [len(r.prompt.split()) for r in requests] == [374, 12, 374]
    assert [r.max_tokens for r in requests] == [44, 64, 3]
    assert [r.arrival_s for r in requests] == pytest.approx([0.0, 4.314579, 4.3194100])
    assert requests[0].prompt != requests[2].prompt  # no prefix information: no two prompts alike
    assert bench.load(args) == requests  # seeded
    assert len(bench.load(SimpleNamespace(**{**vars(args), "max_requests": 2}))) == 2


def test_a_broken_azure_row_is_one_line_naming_it(tmp_path, capsys):
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,-3,44\n")
    assert main(["bench", "serve", "--url", "http://127.0.0.1:1", "--trace", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{path}:2: token counts must be positive" in err and "\n" not in err


def test_the_azure_code_trace_reads():
    trace = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "traces" / "azure_code_2023.csv"
    if not trace.is_file():
        pytest.skip(f"the shared traces are not beside the project ({trace})")
    args = SimpleNamespace(trace=str(trace), max_tokens=64, max_requests=50, rate=None, seed=0, words_per_block=1)
    requests = bench.load(args)
    assert len(requests) == 50 and requests[0].arrival_s == 0.0
    assert all(r.prompt and 1 <= r.max_tokens <= 64 for r in requests)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
