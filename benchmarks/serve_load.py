"""Load test for ``accel serve``: N concurrent clients, each sending M requests one after another.

Talks only to a server on this machine: the URL's host must be a loopback address
(127.0.0.0/8, ::1) or ``localhost``; anything else is refused before a byte is sent. The run
is bounded: N x M requests at most, each with a timeout, and the whole run ends after
``--deadline`` seconds (requests still open are cancelled and counted as failed).

    accel serve --port 8000 &                                  # in another shell
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --clients 8 --requests 4
    python benchmarks/serve_load.py --clients 16 --requests 2 --max-tokens 64 --json out.json

Reports requests/s, completion tokens/s, p50/p95 latency and time to first token (streaming),
failed requests (HTTP errors, timeouts, error events) and truncated ones (a stream that ended
without ``data: [DONE]`` or without a finish reason). Against ``accel serve`` it also reads the
engine's counters from ``/metrics`` before and after the load and reports where the server's
time went: seconds in verify steps and in prefills, their share of the run's wall time, and the
mean rows per step (a server without those counters, such as ``transformers serve``, gets no
such line).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

MAX_TOTAL_REQUESTS = 10_000

#: The ``accel serve`` counters (``GET /metrics``) whose change over the run says where the
#: engine's time went.
ENGINE_COUNTERS = ("accel_step_seconds_total", "accel_prefill_seconds_total", "accel_verify_steps_total",
                   "accel_batch_rows_stepped_total", "accel_prefills_total")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for a good night's sleep.",
    "How do I boil an egg so the yolk stays soft?",
    "What is the difference between weather and climate?",
    "Name five animals that live in the Arctic.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
]


def loopback_url(url: str) -> str:
    """``url`` without a trailing slash, if it names this machine; ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL")
    host = parts.hostname
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:  # a name: not resolved, so it cannot point elsewhere
            loopback = False
        if not loopback:
            raise ValueError(f"refusing {host!r}: serve_load only talks to this machine (127.0.0.0/8, ::1, localhost)")
    return url.rstrip("/")


@dataclass
class Sample:
    ok: bool
    truncated: bool
    latency_s: float
    ttft_s: float | None
    completion_tokens: int
    finish_reason: str | None
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


async def one_request(http: httpx.AsyncClient, args: argparse.Namespace, model: str, prompt: str) -> Sample:
    body: dict = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.strategy:
        body["accel"] = args.strategy
    if args.endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    start = time.perf_counter()
    if not args.stream:
        r = await http.post(path, json=body)
        latency = time.perf_counter() - start
        if r.status_code != 200:
            return Sample(False, False, latency, None, 0, None, f"HTTP {r.status_code}: {r.text[:200]}")
        out = r.json()
        return Sample(True, False, latency, None, out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"])

    body.update(stream=True, stream_options={"include_usage": True})
    ttft, tokens, finish, done = None, 0, None, False
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            return Sample(False, False, time.perf_counter() - start, None, 0, None, f"HTTP {r.status_code}: {text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                return Sample(False, False, time.perf_counter() - start, ttft, tokens, None, event["error"]["message"])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                finish = choice.get("finish_reason") or finish
    latency = time.perf_counter() - start
    truncated = not done or finish is None
    return Sample(not truncated, truncated, latency, ttft, tokens, finish)


async def client_loop(http, args, model, index: int, samples: list[Sample]) -> None:
    for i in range(args.requests):
        n = index * args.requests + i
        prompt = args.prompts[n % len(args.prompts)]
        if args.distinct:  # no two requests alike: they share only the chat template's system turn
            prompt = f"(request {n}) {prompt}"
        if args.prefix_text:  # a document every request asks about (retrieval-augmented requests)
            prompt = f"{args.prefix_text}\n\n{prompt}"
        try:
            samples.append(await one_request(http, args, model, prompt))
        except (httpx.HTTPError, json.JSONDecodeError, KeyError) as err:
            samples.append(Sample(False, False, 0.0, None, 0, None, f"{type(err).__name__}: {err}"))


def parse_counters(text: str) -> dict[str, float] | None:
    """The :data:`ENGINE_COUNTERS` in a Prometheus text exposition, or None unless all are
    there (samples with labels are summed per metric name)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2 or line.startswith("#"):
            continue
        name = parts[0].partition("{")[0]
        if name in ENGINE_COUNTERS:
            try:
                found[name] = found.get(name, 0.0) + float(parts[1])
            except ValueError:
                return None
    return found if len(found) == len(ENGINE_COUNTERS) else None


async def engine_counters(http: httpx.AsyncClient) -> dict[str, float] | None:
    """The server's :data:`ENGINE_COUNTERS` now, or None (no ``/metrics``, or not accel's)."""
    try:
        r = await http.get("/metrics")
    except httpx.HTTPError:
        return None
    return parse_counters(r.text) if r.status_code == 200 else None


def engine_time(before: dict[str, float] | None, after: dict[str, float] | None, wall: float) -> dict | None:
    """Where the engine's time went between two :func:`engine_counters` readings: seconds in
    verify steps and in prefills, their shares of ``wall``, steps, prefills, mean rows per step."""
    if before is None or after is None:
        return None
    d = {name: after[name] - before[name] for name in ENGINE_COUNTERS}
    steps = d["accel_verify_steps_total"]
    return {
        "step_s": d["accel_step_seconds_total"], "prefill_s": d["accel_prefill_seconds_total"],
        "steps": int(steps), "prefills": int(d["accel_prefills_total"]),
        "step_share": d["accel_step_seconds_total"] / wall if wall else 0.0,
        "prefill_share": d["accel_prefill_seconds_total"] / wall if wall else 0.0,
        "ms_per_step": d["accel_step_seconds_total"] * 1e3 / steps if steps else None,
        "rows_per_step": d["accel_batch_rows_stepped_total"] / steps if steps else None,
    }


async def run(args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    timeout = httpx.Timeout(args.timeout)
    samples: list[Sample] = []
    async with httpx.AsyncClient(base_url=args.url, timeout=timeout, limits=limits) as http:
        models = (await http.get("/v1/models")).json()["data"]
        model = args.model or models[0]["id"]
        before = await engine_counters(http)
        start = time.perf_counter()
        tasks = [asyncio.create_task(client_loop(http, args, model, c, samples)) for c in range(args.clients)]
        _, pending = await asyncio.wait(tasks, timeout=args.deadline)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - start
        after = await engine_counters(http)
    unfinished = args.clients * args.requests - len(samples)
    summary = summarize(samples, wall, unfinished, args)
    summary["engine"] = engine_time(before, after, wall)
    return summary


def summarize(samples: list[Sample], wall: float, unfinished: int, args: argparse.Namespace) -> dict:
    ok = [s for s in samples if s.ok]
    latencies = [s.latency_s for s in ok]
    ttfts = [s.ttft_s for s in ok if s.ttft_s is not None]
    return {
        "url": args.url, "endpoint": args.endpoint, "stream": args.stream, "clients": args.clients,
        "requests_per_client": args.requests, "max_tokens": args.max_tokens, "wall_s": wall,
        "completed": len(ok),
        "failed": sum(1 for s in samples if not s.ok and not s.truncated) + unfinished,
        "truncated": sum(1 for s in samples if s.truncated),
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "tokens_per_s": sum(s.completion_tokens for s in ok) / wall if wall else 0.0,
        "latency_p50_s": percentile(latencies, 50), "latency_p95_s": percentile(latencies, 95),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
        "finish_reasons": dict(Counter(s.finish_reason for s in ok)),
        "errors": [s.error for s in samples if s.error][:10],
        "samples": [asdict(s) for s in samples] if args.json else None,
    }


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients")
    p.add_argument("--requests", type=int, default=4, help="requests per client, sent one after another")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="non-streaming requests (no TTFT)")
    p.add_argument("--strategy", action="append", default=None, metavar="SPEC",
                   help="per-request strategies (the 'accel' field), e.g. prompt_lookup:num_tokens=8")
    p.add_argument("--model", default=None, help="model id to send (default: the server's first)")
    p.add_argument("--prompts", type=Path, default=None, help="prompt file, one a line (default: built-in)")
    p.add_argument("--distinct", action="store_true", help="number every request's prompt, so that no two are "
                   "the same (the built-in prompts repeat after 8 requests)")
    p.add_argument("--prefix-file", type=Path, default=None, help="a text put before every prompt, as a document "
                   "each request asks about")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument("--json", type=Path, default=None, help="write the summary and every sample here")
    args = p.parse_args(argv)
    try:
        args.url = loopback_url(args.url)
    except ValueError as err:
        p.error(str(err))
    if args.clients <= 0 or args.requests <= 0 or args.clients * args.requests > MAX_TOTAL_REQUESTS:
        p.error(f"--clients and --requests must be > 0, with at most {MAX_TOTAL_REQUESTS} requests in all")
    if args.max_tokens <= 0 or args.timeout <= 0 or args.deadline <= 0:
        p.error("--max-tokens, --timeout and --deadline must be > 0")
    args.prompts = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()] \
        if args.prompts else PROMPTS
    if not args.prompts:
        p.error("the prompt file holds no prompts")
    args.prefix_text = args.prefix_file.read_text().strip() if args.prefix_file else ""

    summary = asyncio.run(run(args))
    print(f"{summary['completed']} completed, {summary['failed']} failed, {summary['truncated']} truncated "
          f"in {summary['wall_s']:.2f} s ({args.clients} clients x {args.requests} requests, "
          f"{args.endpoint}, {'streaming' if args.stream else 'non-streaming'}, max_tokens {args.max_tokens})")
    print(f"requests/s {summary['requests_per_s']:.2f} | tokens/s {summary['tokens_per_s']:.1f} | "
          f"latency p50 {_fmt(summary['latency_p50_s'])} s p95 {_fmt(summary['latency_p95_s'])} s | "
          f"TTFT p50 {_fmt(summary['ttft_p50_s'])} s p95 {_fmt(summary['ttft_p95_s'])} s")
    engine = summary["engine"]
    if engine is not None:
        per_step = "" if engine["ms_per_step"] is None else \
            f", {engine['ms_per_step']:.0f} ms each with {engine['rows_per_step']:.1f} rows on average"
        print(f"engine: {engine['step_s']:.2f} s in {engine['steps']} verify steps ({engine['step_share']:.0%} of the "
              f"wall{per_step}), {engine['prefill_s']:.2f} s in {engine['prefills']} prefills "
              f"({engine['prefill_share']:.0%})")
    if summary["finish_reasons"]:
        print("finish reasons:", ", ".join(f"{k} {v}" for k, v in summary["finish_reasons"].items()))
    for error in summary["errors"]:
        print("error:", error, file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if summary["failed"] == 0 and summary["truncated"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
