#!/usr/bin/env python3
"""Benchmark: the serving front's delivery capacity on CPU (no GPU, no model).

Three processes:

* the front (this process): the real ``pagedkv serve`` app - ``make_process_server`` (the
  ``EngineCoreClient`` with its reader thread, ``OpenAIServing``, ``build_app``: FastAPI,
  Starlette's streaming response, uvicorn) - serving ``/v1/completions`` on 127.0.0.1;
* its engine process: ``bench/synthetic_engine.py``, started by the front exactly like the real
  engine process (same pipe protocol), which every ``--step-ms`` milliseconds sends one step
  message with one ``OutputDelta`` (one token) per running request;
* the client (a subprocess of this script, ``client`` mode): ``--streams`` concurrent streamed
  ``/v1/completions`` requests (token-id prompts, ``max_tokens`` = ``--tokens``,
  ``ignore_eos``, usage included, as ``pagedkv bench serve`` sends them) all at once, over raw
  asyncio sockets (the cheapest client at hand: it only collects the bytes while the clock
  runs; the chunked bodies are decoded, every SSE event parsed and the text checked against
  what the synthetic engine sent afterwards).

Reported per round: delivered output tokens/s (completion tokens of the usage chunks over the
client's wall time), the offered rate (streams x steps/s), SSE chunks with text per token (a
lagging stream skips to its newest output: fewer, larger chunks), and the front process's CPU
time (all its threads: event loop, reader thread) per delivered token and per chunk.
``--profile FILE`` runs the front's event loop thread under cProfile for the measured rounds
and prints the top functions. The front calls ``tune_gc_for_serving`` as ``pagedkv serve``
does (``--default-gc``: Python's collector settings); its seconds in the collector are
reported too.

Usage (2-core machine; the numbers are only comparable on one machine, run alone):
    .venv/bin/python bench/bench_serve_front_cpu.py --streams 256 --tokens 256 --step-ms 10
    .venv/bin/python bench/bench_serve_front_cpu.py --step-ms 2 --rounds 3 --json /tmp/f.json
    .venv/bin/python bench/bench_serve_front_cpu.py --rounds 1 --profile /tmp/front.prof
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODEL = "synthetic"


# --------------------------------------------------------------------------------------------
# the client (a separate process)


async def _one_stream(port: int, body: bytes, t_start: float) -> dict:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                 + body)
    head = await reader.readuntil(b"\r\n\r\n")
    buf = bytearray()
    reads = 0
    t_first = None
    while not buf.endswith(b"\r\n0\r\n\r\n"):
        data = await reader.read(1 << 16)
        if not data:
            break
        if t_first is None:
            t_first = time.perf_counter() - t_start
        reads += 1
        buf += data
    t_end = time.perf_counter() - t_start
    writer.close()
    return {"head": bytes(head), "body": bytes(buf), "reads": reads, "t_first": t_first,
            "t_end": t_end}


def _dechunk(body: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        eol = body.index(b"\r\n", pos)
        size = int(body[pos:eol].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2


def _check(res: dict, tokens: int, vocab_size: int) -> dict:
    """Parse one stream's events; its text chunks, completion tokens and whether the text is
    the synthetic engine's."""
    from bench.synthetic_engine import synthetic_text

    status = res["head"].split(b"\r\n", 1)[0]
    if b" 200 " not in status + b" ":
        raise RuntimeError(f"HTTP status {status!r}: {res['body'][:300]!r}")
    events = _dechunk(res["body"]).decode("utf-8").split("\n\n")
    if events[-1] != "" or events[-2] != "data: [DONE]":
        raise RuntimeError(f"the stream does not end with [DONE]: {events[-3:]!r}")
    text, chunks, usage, finish = [], 0, None, None
    for ev in events[:-2]:
        if not ev.startswith("data: "):
            raise RuntimeError(f"not an SSE data event: {ev[:200]!r}")
        data = json.loads(ev[6:])
        if data.get("usage") and not data.get("choices"):
            usage = data["usage"]["completion_tokens"]
            continue
        choice = data["choices"][0]
        if choice["text"]:
            chunks += 1
            text.append(choice["text"])
        if choice["finish_reason"]:
            finish = choice["finish_reason"]
    expect = "".join(synthetic_text(k, vocab_size) for k in range(tokens))
    return {"chunks": chunks, "tokens": usage or 0, "finish": finish,
            "text_ok": "".join(text) == expect}


async def _client(port: int, streams: int, tokens: int, prompt_len: int) -> dict:
    bodies = [json.dumps({"model": MODEL, "prompt": [(i * 31 + j) % 1000 + 1
                                                     for j in range(prompt_len)],
                          "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                          "stream": True, "stream_options": {"include_usage": True}}).encode()
              for i in range(streams)]
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    results = await asyncio.gather(*(_one_stream(port, b, t0) for b in bodies))
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return {"wall_s": wall, "client_cpu_s": cpu, "results": results}


def _bench_serve_client(args) -> dict:
    """``--client bench-serve``: ``pagedkv bench serve``'s own client (httpx, one JSON parse
    per event), all requests at once; tokens from its usage chunks, text not checked."""
    from pagedkv.entrypoints.bench_serve import run_serve_bench

    prompts = [[(i * 31 + j) % 1000 + 1 for j in range(args.prompt_len)]
               for i in range(args.streams)]
    cpu0 = time.process_time()
    r = asyncio.run(run_serve_bench(f"http://127.0.0.1:{args.port}", MODEL, prompts,
                                    [args.tokens] * args.streams))
    if r.failed:
        raise RuntimeError(f"{r.failed} requests failed")
    itl = r.itl_ms
    return {"wall_s": r.wall_s, "client_cpu_s": time.process_time() - cpu0,
            "tokens": r.total_output_tokens,
            "chunks": None, "reads": None, "text_ok": True,
            "finish_ok": r.completed == args.streams, "ttft_ms_p50": r.ttft_ms["p50"],
            "itl_ms_mean": itl["mean"]}


def client_main(args) -> None:
    import base64
    import pickle

    if args.client == "bench-serve":
        if args.profile_client:
            import cProfile

            prof = cProfile.Profile()
            summary = prof.runcall(_bench_serve_client, args)
            prof.dump_stats(args.profile_client)
        else:
            summary = _bench_serve_client(args)
        sys.stdout.write(base64.b64encode(pickle.dumps(summary)).decode() + "\n")
        return
    out = asyncio.run(_client(args.port, args.streams, args.tokens, args.prompt_len))
    checked = [_check(r, args.tokens, args.vocab_size) for r in out["results"]]
    summary = {
        "wall_s": out["wall_s"], "client_cpu_s": out["client_cpu_s"],
        "tokens": sum(c["tokens"] for c in checked),
        "chunks": sum(c["chunks"] for c in checked),
        "reads": sum(r["reads"] for r in out["results"]),
        "text_ok": all(c["text_ok"] for c in checked),
        "finish_ok": all(c["finish"] == "length" for c in checked),
        "ttft_ms_p50": 1e3 * statistics.median(r["t_first"] for r in out["results"]),
    }
    sys.stdout.write(base64.b64encode(pickle.dumps(summary)).decode() + "\n")


# --------------------------------------------------------------------------------------------
# the front (this process)


async def _run_client(port: int, args, streams: int, tokens: int) -> dict:
    import base64
    import pickle

    proc = await asyncio.create_subprocess_exec(
        sys.executable, os.path.abspath(__file__), "client", "--port", str(port),
        "--streams", str(streams), "--tokens", str(tokens), "--prompt-len",
        str(args.prompt_len), "--vocab-size", str(args.vocab_size), "--client", args.client,
        *(["--profile-client", args.profile_client] if args.profile_client else []),
        stdout=asyncio.subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT))
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the client failed (exit code {proc.returncode})")
    return pickle.loads(base64.b64decode(out.strip().splitlines()[-1]))


class _GCTimer:
    """Seconds the front spends in the garbage collector (``gc.callbacks``), by generation."""

    def __init__(self) -> None:
        import gc

        self.seconds = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.seconds[g] += time.perf_counter() - self._t0
            self.count[g] += 1


async def _front(args) -> list[dict]:
    import uvicorn

    from bench.synthetic_engine import ENV
    from pagedkv.entrypoints.engine_core import EngineSpec
    from pagedkv.entrypoints.openai_server import make_process_server, tune_gc_for_serving

    os.environ[ENV] = json.dumps({"step_ms": args.step_ms, "vocab_size": args.vocab_size,
                                  "max_model_len": max(4096, args.tokens + args.prompt_len + 1)})
    app, client, _ = make_process_server(EngineSpec(shape=MODEL), model_name=MODEL,
                                         engine_module="bench.synthetic_engine")
    if not args.default_gc:  # what pagedkv serve does once its app is built
        tune_gc_for_serving()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           http=args.http))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    rows = []
    prof = None
    gct = _GCTimer()
    try:
        await _run_client(port, args, min(16, args.streams), 16)  # warm-up
        if args.profile:
            import cProfile

            prof = cProfile.Profile()
        for r in range(args.rounds):
            if prof is not None:
                prof.enable()
            t0, cpu0 = time.perf_counter(), time.process_time()
            gc0, gcn0 = list(gct.seconds), list(gct.count)
            steps0 = client.last_gauges.get("synthetic_steps", 0)
            send0 = client.last_gauges.get("synthetic_send_s", 0.0)
            res = await _run_client(port, args, args.streams, args.tokens)
            cpu = time.process_time() - cpu0
            steps = client.last_gauges.get("synthetic_steps", 0) - steps0
            gc_s = [b - a for a, b in zip(gc0, gct.seconds)]
            gc_n = [b - a for a, b in zip(gcn0, gct.count)]
            send_s = client.last_gauges.get("synthetic_send_s", 0.0) - send0
            if prof is not None:
                prof.disable()
            wall = time.perf_counter() - t0
            tok = res["tokens"]
            row = {
                "round": r, "streams": args.streams, "tokens_per_stream": args.tokens,
                "step_ms": args.step_ms,
                "offered_tok_s": args.streams * 1e3 / args.step_ms if args.step_ms else None,
                "engine_steps_per_s": steps / res["wall_s"],
                "engine_send_ms_per_step": 1e3 * send_s / steps if steps else None,
                "delivered_tok_s": tok / res["wall_s"], "tokens": tok, "client_wall_s":
                res["wall_s"],
                "chunks_per_token": res["chunks"] / tok if tok and res["chunks"] else None,
                "front_cpu_s": cpu, "front_cpu_share": cpu / wall,
                "front_us_per_token": 1e6 * cpu / tok if tok else None,
                "front_us_per_chunk": 1e6 * cpu / res["chunks"] if res["chunks"] else None,
                "client": args.client, "front_gc_s_by_generation": gc_s,
                "front_gc_collections": gc_n,
                "client_cpu_s": res["client_cpu_s"], "ttft_ms_p50": res["ttft_ms_p50"],
                "text_ok": res["text_ok"], "finish_ok": res["finish_ok"],
            }
            rows.append(row)
            print(f"round {r}: {row['delivered_tok_s']:,.0f} tok/s delivered "
                  f"(offered {row['offered_tok_s'] or 0:,.0f}; engine "
                  f"{row['engine_steps_per_s']:.0f} steps/s, "
                  f"{_f(row['engine_send_ms_per_step'], '.2f')} ms/step sending), "
                  f"{_f(row['chunks_per_token'], '.3f')} chunks/token, front CPU "
                  f"{row['front_us_per_token']:.1f} us/token "
                  f"{_f(row['front_us_per_chunk'], '.1f')} us/chunk "
                  f"({100 * row['front_cpu_share']:.0f}% of a core), client CPU "
                  f"{row['client_cpu_s']:.2f} s, front GC {sum(gc_s):.3f} s, "
                  f"text ok {row['text_ok']}, finish ok "
                  f"{row['finish_ok']}", flush=True)
    finally:
        server.should_exit = True
        await task
    if prof is not None:
        import pstats

        prof.dump_stats(args.profile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile_top)
    return rows


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", nargs="?", default="front", choices=["front", "client"])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per stream")
    ap.add_argument("--step-ms", type=float, default=10.0,
                    help="the synthetic engine's step period (0: as fast as it can)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", default=None, help="cProfile the front's loop into FILE")
    ap.add_argument("--profile-top", type=int, default=35)
    ap.add_argument("--json", default=None, help="write the rounds to this file")
    ap.add_argument("--profile-client", default=None,
                    help="(--client bench-serve) cProfile the client into FILE")
    ap.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"],
                    help="uvicorn's HTTP protocol (auto: httptools where installed, as "
                         "pagedkv serve)")
    ap.add_argument("--default-gc", action="store_true",
                    help="keep Python's collector settings (no tune_gc_for_serving)")
    ap.add_argument("--port", type=int, default=0, help="(client mode) the front's port")
    ap.add_argument("--client", default="raw", choices=["raw", "bench-serve"],
                    help="raw asyncio sockets (cheapest) or pagedkv bench serve's httpx client")
    args = ap.parse_args(argv)
    if args.mode == "client":
        client_main(args)
        return 0
    rows = asyncio.run(_front(args))
    best = max(rows, key=lambda r: r["delivered_tok_s"])
    med = statistics.median(r["front_us_per_token"] for r in rows)
    print(f"best round {best['delivered_tok_s']:,.0f} tok/s; median front CPU {med:.1f} us/token")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rows, "best_tok_s": best["delivered_tok_s"],
                       "median_front_us_per_token": med}, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(r["text_ok"] and r["finish_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
