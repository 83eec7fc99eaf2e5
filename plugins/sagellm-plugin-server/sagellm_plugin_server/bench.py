"""``sagellm bench serve``: replay a trace's prompts against any
OpenAI-compatible server (sagellm's, vLLM's, LMDeploy's) and report what a
client sees: TTFT, TPOT and end-to-end latency percentiles, throughput, and
every failure by its reason.

Prompts come from a ShareGPT file (each conversation's first human message,
real text), a Mooncake trace, whose hash ids become synthetic text (each id
a fixed run of words, so requests that share hash-id prefixes share text
prefixes, and a prefix cache on the server can hit them), or an Azure LLM
inference trace, whose context token counts become as many words of
synthetic text (about a token a word; the trace has no prefix information,
so no two prompts share one).

A request counts as completed only when its event stream ended as OpenAI's
does: every event's data a JSON chunk, a ``finish_reason``, then ``[DONE]``.
Anything else is a failure with its reason (:data:`FAILURES`).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import attrs

from sagellm_core.errors import SagellmError, TraceError

WORDS = (
    "the of and to in is that for it as with was on be by at this have from or one had not but what all were when we"
    " there can an your which their said if do will each about how up out them then she many some so these would"
    " other into has more her two like him see time could no make than first been its who now people my made over"
    " did down only way find use may water long little very after words called just where most know"
).split()

#: Why a request failed, as the report counts it. An HTTP status other than
#: 200 is counted as ``http_<status>``.
FAILURES = {
    "not_event_stream": "the answer is not an event stream (its content type is not text/event-stream)",
    "unparsable": "an event's data is not a JSON completion chunk",
    "error_event": "the server sent an error in the stream",
    "truncated": "the stream ended (or the connection broke) before [DONE]",
    "no_finish_reason": "[DONE] came with no choice having a finish_reason",
    "first_token_timeout": "no text within --first-token-timeout",
    "timeout": "not finished within --timeout",
    "connection": "no answer: the connection failed",
}


@attrs.frozen
class BenchRequest:
    prompt: str
    max_tokens: int
    arrival_s: float


def mooncake_requests(path: Path, words_per_block: int, max_tokens: int) -> Iterator[BenchRequest]:
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                hashes, output, ts = row["hash_ids"], int(row["output_length"]), float(row["timestamp"])
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: not a Mooncake record ({type(exc).__name__}: {exc})") from None
            text = " ".join(" ".join(random.Random(h).choices(WORDS, k=words_per_block)) for h in hashes)
            yield BenchRequest(text, max(1, min(output, max_tokens)), ts / 1000.0)


def azure_requests(path: Path, max_tokens: int, seed: int) -> Iterator[BenchRequest]:
    """Each row's ``ContextTokens`` as that many words of text drawn for the
    row alone, ``GeneratedTokens`` (capped) as ``max_tokens``, ``TIMESTAMP``
    as the arrival. The rows are read by the replay's own Azure loader."""
    from sagellm_core.replay import workloads

    for request in workloads.azure(str(path)):
        words = random.Random(f"{seed}:{request.request_id}").choices(WORDS, k=len(request.prompt_token_ids))
        yield BenchRequest(" ".join(words), max(1, min(request.output_tokens, max_tokens)), request.arrival_s)


def sharegpt_requests(path: Path, max_tokens: int) -> Iterator[BenchRequest]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise TraceError(f"{path}: not a ShareGPT JSON file: {exc}") from None
    found = False
    for record in data if isinstance(data, list) else []:
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        human, reply = turns[0], turns[1]
        if not (isinstance(human, dict) and isinstance(reply, dict) and human.get("value")):
            continue
        found = True
        length = max(1, min(max_tokens, int(len(str(reply.get("value", "")).split()) * 1.3)))
        yield BenchRequest(str(human["value"]), length, 0.0)
    if not found:
        raise TraceError(f"{path}: no conversations with a human turn and a reply")


def load(args) -> list[BenchRequest]:
    path = Path(args.trace)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    if path.suffix == ".jsonl":
        source = mooncake_requests(path, args.words_per_block, args.max_tokens)
    elif path.suffix == ".csv":
        source = azure_requests(path, args.max_tokens, args.seed)
    else:
        source = sharegpt_requests(path, args.max_tokens)
    requests = list(islice(source, args.max_requests))
    if args.rate:
        rng, t, timed = random.Random(args.seed), 0.0, []
        for r in requests:
            timed.append(attrs.evolve(r, arrival_s=t))
            t += rng.expovariate(args.rate)
        return timed
    first = requests[0].arrival_s if requests else 0.0
    return [attrs.evolve(r, arrival_s=r.arrival_s - first) for r in requests]


@attrs.define
class StreamCheck:
    """What one streamed completion's events have shown so far. ``take``
    each event's data as it arrives, then ``end`` when the stream ends: each
    says the failure it found, or None."""

    #: When the first text arrived (``time.perf_counter``).
    first_text_s: float | None = None
    text_chunks: int = 0
    usage_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False

    def take(self, data: str, now: float) -> str | None:
        if data == "[DONE]":
            self.done = True
            return None
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError):
            return "unparsable"
        if not isinstance(chunk, dict):
            return "unparsable"
        if "error" in chunk:
            return "error_event"
        choices = chunk.get("choices", [])
        if not (isinstance(choices, list) and all(isinstance(c, dict) for c in choices)):
            return "unparsable"
        for choice in choices:
            text, reason = choice.get("text"), choice.get("finish_reason")
            if not (isinstance(text, (str, type(None))) and isinstance(reason, (str, type(None)))):
                return "unparsable"
            if text:
                self.text_chunks += 1
                self.first_text_s = now if self.first_text_s is None else self.first_text_s
            self.finish_reason = reason or self.finish_reason
        usage = chunk.get("usage")
        if usage is not None:
            tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
            if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0):
                return "unparsable"
            self.usage_tokens = tokens
        return None

    def end(self) -> str | None:
        if not self.done:
            return "truncated"
        return None if self.finish_reason else "no_finish_reason"

    @property
    def tokens(self) -> int:
        """Output tokens: the server's usage, else one a chunk of text."""
        return self.text_chunks if self.usage_tokens is None else self.usage_tokens


async def one(
    client,
    url: str,
    model: str,
    request: BenchRequest,
    start: float,
    timeout_s: float,
    first_token_timeout_s: float | None,
) -> dict[str, Any]:
    """Send one request at its arrival; its figures, or its failure reason."""
    import httpx
    from httpx_sse import SSEError, aconnect_sse

    await asyncio.sleep(max(0.0, request.arrival_s - (time.perf_counter() - start)))
    loop = asyncio.get_running_loop()
    sent, check, answered = time.perf_counter(), StreamCheck(), False
    first_bound = first_token_timeout_s is not None and first_token_timeout_s < timeout_s
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with asyncio.timeout(first_token_timeout_s if first_bound else timeout_s) as limit:
            async with aconnect_sse(client, "POST", f"{url}/v1/completions", json=body) as source:
                answered = True
                if source.response.status_code != 200:
                    return {"ok": False, "reason": f"http_{source.response.status_code}"}
                async for event in source.aiter_sse():
                    had_text = check.first_text_s is not None
                    failure = check.take(event.data, time.perf_counter())
                    if failure is not None:
                        return {"ok": False, "reason": failure}
                    if first_bound and not had_text and check.first_text_s is not None:
                        limit.reschedule(loop.time() + timeout_s - (time.perf_counter() - sent))
                    if check.done:
                        break
        failure = check.end()
    except TimeoutError:
        failure = "first_token_timeout" if first_bound and check.first_text_s is None else "timeout"
    except SSEError:
        failure = "not_event_stream"
    except httpx.HTTPError:
        failure = "truncated" if answered else "connection"
    if failure is not None:
        return {"ok": False, "reason": failure}
    end = time.perf_counter()
    first = check.first_text_s or end
    tokens = check.tokens
    return {
        "ok": True,
        "ttft_s": first - sent,
        "e2e_s": end - sent,
        "tokens": tokens,
        "tpot_s": (end - first) / (tokens - 1) if tokens > 1 else None,
    }


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 6)

    return {"mean": round(sum(ordered) / len(ordered), 6), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


async def run(args, requests: list[BenchRequest]) -> dict[str, Any]:
    import httpx

    url = args.url.rstrip("/")
    # No httpx timeout: each request's own deadlines (--timeout,
    # --first-token-timeout) bound it, and say which one ended it.
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=1000)) as client:
        model = args.model
        if model is None:
            try:
                response = await asyncio.wait_for(client.get(f"{url}/v1/models"), args.timeout)
                model = response.json()["data"][0]["id"]
            except Exception as exc:  # noqa: BLE001
                raise SagellmError(
                    f"--url {url}: cannot list its models ({type(exc).__name__}: {exc}); pass --model"
                ) from None
        start = time.perf_counter()
        tasks = [
            asyncio.create_task(one(client, url, model, r, start, args.timeout, args.first_token_timeout))
            for r in requests
        ]
        results = []
        if args.quiet:
            results = await asyncio.gather(*tasks)
        else:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(
                TextColumn("[bold]bench serve"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
            ) as bar:
                task = bar.add_task("requests", total=len(tasks))
                for done in asyncio.as_completed(tasks):
                    results.append(await done)
                    bar.advance(task)
        wall = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "url": url,
        "model": model,
        "trace": str(args.trace),
        "requests": len(requests),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failures": dict(Counter(r["reason"] for r in results if not r["ok"]).most_common()),
        "wall_s": round(wall, 3),
        "ttft_s": percentiles([r["ttft_s"] for r in ok]),
        "tpot_s": percentiles([r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
        "e2e_s": percentiles([r["e2e_s"] for r in ok]),
        "output_tokens": tokens,
        "throughput_output_tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "throughput_requests_per_s": round(len(ok) / wall, 4) if wall > 0 else None,
    }


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"bench serve: {report['url']} ({report['model']})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("requests completed / failed", f"{report['completed']} / {report['failed']}")
    for reason, count in report["failures"].items():
        table.add_row(f"  failed: {reason}", str(count))
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end")):
        p = report[key]
        if p:
            table.add_row(f"{label} mean / p50 / p99 (s)", f"{p['mean']:.4f} / {p['p50']:.4f} / {p['p99']:.4f}")
    table.add_row("throughput (output tok/s)", str(report["throughput_output_tokens_per_s"]))
    table.add_row("throughput (req/s)", str(report["throughput_requests_per_s"]))
    table.add_row("wall time (s)", str(report["wall_s"]))
    Console().print(table)


def _positive_seconds(flag: str, value: float | None) -> None:
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise SagellmError(f"{flag} {value}: a positive number of seconds")


def main(args) -> int:
    if args.max_requests is not None and args.max_requests < 1:
        raise SagellmError(f"--max-requests {args.max_requests}: at least 1")
    if args.rate is not None and not (args.rate > 0 and math.isfinite(args.rate)):
        raise SagellmError(f"--rate {args.rate}: a positive number of requests per second")
    _positive_seconds("--timeout", args.timeout)
    _positive_seconds("--first-token-timeout", args.first_token_timeout)
    if args.json and not Path(args.json).parent.is_dir():
        raise SagellmError(f"--json {args.json}: the folder does not exist")
    requests = load(args)
    report = asyncio.run(run(args, requests))
    if not args.quiet:
        print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["completed"] else 1
