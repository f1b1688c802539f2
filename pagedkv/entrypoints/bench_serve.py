"""``pagedkv bench serve``: replay a workload against a running OpenAI-compatible server.

Its own small async HTTP client (httpx, one single-connection client per request): each
request is a streamed ``/v1/completions`` call
with the workload's token-id prompt, ``max_tokens`` and ``ignore_eos``; arrivals follow a
Poisson process at ``request_rate`` requests/s (``inf``: all at once), optionally capped at
``max_concurrency`` requests in flight. Measured per request, as vLLM's serving benchmark
does: time to first token (first non-empty chunk), inter-token latencies (between chunks; one
chunk per detokenized delta, about one per token), end-to-end latency, output tokens (the
final usage chunk). Reported: request and output-token throughput over the wall time, and
mean / p50 / p90 / p99 of TTFT, ITL and E2E in milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    error: str | None = None


@dataclass
class ServeBenchResult:
    num_requests: int
    completed: int
    failed: int
    wall_s: float
    request_throughput: float
    output_throughput: float
    total_output_tokens: int
    ttft_ms: dict
    itl_ms: dict
    e2e_ms: dict
    request_rate: float
    max_concurrency: int | None

    def as_dict(self) -> dict:
        return asdict(self)


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = sorted(x * 1e3 for x in values)

    def q(p: float) -> float:
        return v[min(len(v) - 1, max(0, math.ceil(p * len(v)) - 1))]

    return {"mean": statistics.fmean(v), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


async def _one(http, url: str, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(ok=False, prompt_tokens=len(prompt))
    t0 = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = data["error"].get("message")
                    return res
                if data.get("usage") and not data.get("choices"):
                    res.output_tokens = data["usage"]["completion_tokens"]
                    continue
                if not data["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itls.append(now - last)
                last = now
        res.e2e = time.perf_counter() - t0
        res.ok = True
    except Exception as e:  # noqa: BLE001 - recorded per request
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_serve_bench(base_url: str, model: str | None, prompts: list[list[int]],
                          max_tokens: list[int], *, request_rate: float = math.inf,
                          max_concurrency: int | None = None, seed: int = 0,
                          timeout: float = 600.0) -> ServeBenchResult:
    """Replay ``prompts`` (token ids) with their ``max_tokens`` against ``base_url``
    (``model`` None: the first model the server lists)."""
    if len(prompts) != len(max_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(max_tokens)} max_tokens")
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # One single-connection client per request, not one pool of them all: httpcore's pool
    # (1.0) scans every connection for each idle one whenever a request starts or a response
    # closes, O(connections^2) per event, which at 256 streams cost the client seconds of
    # CPU (it read the last streams late). One SSL context for all (building one per client
    # loads the CA bundle each time).
    ssl_context = httpx.create_ssl_context()
    one_conn = httpx.Limits(max_connections=1, max_keepalive_connections=0)

    async def run(i: int) -> RequestResult:
        async with httpx.AsyncClient(timeout=timeout, limits=one_conn, verify=ssl_context) as http:
            return await _one(http, url, model, prompts[i], max_tokens[i])

    async def launch(i: int) -> RequestResult:
        if sem is None:
            return await run(i)
        async with sem:
            return await run(i)

    if model is None:  # the server's (first) served model
        async with httpx.AsyncClient(timeout=timeout, verify=ssl_context) as http:
            r = await http.get(base_url.rstrip("/") + "/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
    start = time.perf_counter()
    tasks = []
    for i in range(len(prompts)):
        tasks.append(asyncio.create_task(launch(i)))
        if math.isfinite(request_rate) and request_rate > 0 and i + 1 < len(prompts):
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return ServeBenchResult(
        num_requests=len(results), completed=len(ok), failed=len(results) - len(ok),
        wall_s=wall, request_throughput=len(ok) / wall if wall else 0.0,
        output_throughput=tokens / wall if wall else 0.0, total_output_tokens=tokens,
        ttft_ms=_stats_ms([r.ttft for r in ok if r.ttft is not None]),
        itl_ms=_stats_ms([x for r in ok for x in r.itls]),
        e2e_ms=_stats_ms([r.e2e for r in ok if r.e2e is not None]),
        request_rate=request_rate, max_concurrency=max_concurrency,
    )


def format_result(r: ServeBenchResult) -> str:
    def row(name, d):
        f = lambda x: "-" if x is None else f"{x:,.1f}"  # noqa: E731
        return f"  {name:<10} mean {f(d['mean'])}  p50 {f(d['p50'])}  p90 {f(d['p90'])}  p99 {f(d['p99'])} ms"

    rate = "inf" if math.isinf(r.request_rate) else f"{r.request_rate:g}"
    return "\n".join([
        f"serving benchmark: {r.completed} of {r.num_requests} requests completed "
        f"({r.failed} failed), request rate {rate}/s, max concurrency {r.max_concurrency or '-'}",
        f"  wall time  {r.wall_s:.2f} s",
        f"  throughput {r.request_throughput:,.2f} req/s, {r.output_throughput:,.1f} output tok/s "
        f"({r.total_output_tokens:,} tokens)",
        row("TTFT", r.ttft_ms), row("ITL", r.itl_ms), row("E2E", r.e2e_ms),
    ])


__all__ = ["RequestResult", "ServeBenchResult", "format_result", "run_serve_bench"]
