"""``sagellm bench serve``: replay a trace's prompts against any
OpenAI-compatible server (sagellm's, vLLM's, LMDeploy's) and report what a
client sees: TTFT, TPOT and end-to-end latency percentiles, throughput.

Prompts come from a ShareGPT file (each conversation's first human message,
real text) or a Mooncake trace, whose hash ids become synthetic text: each
id is a fixed run of words, so requests that share hash-id prefixes share
text prefixes, and a prefix cache on the server can hit them.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
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


@attrs.frozen
class BenchRequest:
    prompt: str
    max_tokens: int
    arrival_s: float


def mooncake_requests(path: Path, words_per_block: int, max_tokens: int) -> list[BenchRequest]:
    out = []
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
            out.append(BenchRequest(text, max(1, min(output, max_tokens)), ts / 1000.0))
    return out


def sharegpt_requests(path: Path, max_tokens: int) -> list[BenchRequest]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise TraceError(f"{path}: not a ShareGPT JSON file: {exc}") from None
    out = []
    for record in data if isinstance(data, list) else []:
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        human, reply = turns[0], turns[1]
        if not (isinstance(human, dict) and isinstance(reply, dict) and human.get("value")):
            continue
        length = max(1, min(max_tokens, int(len(str(reply.get("value", "")).split()) * 1.3)))
        out.append(BenchRequest(str(human["value"]), length, 0.0))
    if not out:
        raise TraceError(f"{path}: no conversations with a human turn and a reply")
    return out


def load(args) -> list[BenchRequest]:
    path = Path(args.trace)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    requests = (
        mooncake_requests(path, args.words_per_block, args.max_tokens)
        if path.suffix == ".jsonl"
        else sharegpt_requests(path, args.max_tokens)
    )
    requests = requests[: args.max_requests] if args.max_requests else requests
    if args.rate:
        rng, t, timed = random.Random(args.seed), 0.0, []
        for r in requests:
            timed.append(attrs.evolve(r, arrival_s=t))
            t += rng.expovariate(args.rate)
        return timed
    first = requests[0].arrival_s if requests else 0.0
    return [attrs.evolve(r, arrival_s=r.arrival_s - first) for r in requests]


async def one(client, url: str, model: str, request: BenchRequest, start: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, request.arrival_s - (time.perf_counter() - start)))
    sent = time.perf_counter()
    first = None
    tokens = 0
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"ok": False, "status": response.status_code}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text") and first is None:
                    first = time.perf_counter()
    except Exception as exc:  # noqa: BLE001 - counted as a failure
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    end = time.perf_counter()
    first = first or end
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
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1000)) as client:
        model = args.model
        if model is None:
            try:
                listing = (await client.get(f"{url}/v1/models")).json()
                model = listing["data"][0]["id"]
            except Exception as exc:  # noqa: BLE001
                raise SagellmError(
                    f"--url {url}: cannot list its models ({type(exc).__name__}: {exc}); pass --model"
                ) from None
        start = time.perf_counter()
        tasks = [asyncio.create_task(one(client, url, model, r, start)) for r in requests]
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
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end")):
        p = report[key]
        if p:
            table.add_row(f"{label} mean / p50 / p99 (s)", f"{p['mean']:.4f} / {p['p50']:.4f} / {p['p99']:.4f}")
    table.add_row("throughput (output tok/s)", str(report["throughput_output_tokens_per_s"]))
    table.add_row("throughput (req/s)", str(report["throughput_requests_per_s"]))
    table.add_row("wall time (s)", str(report["wall_s"]))
    Console().print(table)


def main(args) -> int:
    if args.max_requests is not None and args.max_requests < 1:
        raise SagellmError(f"--max-requests {args.max_requests}: at least 1")
    if args.rate is not None and not (args.rate > 0 and math.isfinite(args.rate)):
        raise SagellmError(f"--rate {args.rate}: a positive number of requests per second")
    if args.json and not Path(args.json).parent.is_dir():
        raise SagellmError(f"--json {args.json}: the folder does not exist")
    requests = load(args)
    report = asyncio.run(run(args, requests))
    if not args.quiet:
        print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["completed"] else 1
