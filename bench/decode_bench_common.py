"""What the random-weight decode benchmarks (``bench_dsv32_decode``, ``bench_mamba2_decode``)
share: their options, the workload (a static batch of random prompts, greedy, EOS ignored), the
timing (two generations per engine, ``max_tokens = 1`` and ``max_tokens = --new-tokens``;
decode throughput = ``batch * (new_tokens - 1) / (t_new - t_1)``), pagedkv's side
(``LLM.from_shape``, prefix caching off), transformers' side (the shape's config,
``generate`` on the static batch; sdpa attention on CUDA, eager on CPU), the table and the
JSON record."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_w1 import hf_config_from_shape  # noqa: E402
from pagedkv.engine.llm import LLM  # noqa: E402
from pagedkv.models.config import shape_config  # noqa: E402
from pagedkv.tools.benchmark import environment, format_table, write_json  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


def decode_rate(batch: int, new_tokens: int, t_first: float, t_all: float) -> dict:
    """The decode throughput from the two timings (module docstring)."""
    decode_s = t_all - t_first
    return {"t_first_token_s": t_first, "t_all_s": t_all, "decode_s": decode_s,
            "decode_tokens_per_s": batch * (new_tokens - 1) / decode_s if decode_s > 0 else None,
            "output_tokens_per_s": batch * new_tokens / t_all}


def parse_args(argv, description: str, tiny: dict, defaults: dict):
    """``(args, device)``: the benchmarks' options, unset ones from ``tiny`` (``--tiny``) or
    ``defaults``; the device is CUDA when available, the CPU with ``--tiny``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tiny", action="store_true", help="the CPU-sized shape and workload")
    p.add_argument("--shape", default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--device", default=None, help="default: cuda if available (cpu with --tiny)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    base = tiny if args.tiny else defaults
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode steps are timed)")
    device = torch.device(args.device or ("cpu" if args.tiny or not torch.cuda.is_available()
                                          else "cuda"))
    return args, device


def run_pagedkv(args, device: torch.device, fields) -> dict:
    """pagedkv's row: ``LLM.from_shape`` with the device's defaults, prefix caching off; a
    warm-up generation (kernel compilation), then the two timed ones. ``fields(llm, warm)``
    (``warm``: the engine's stats after the warm-up) gives the row's fields before the
    timings."""
    from pagedkv import SamplingParams

    cfg = shape_config(args.shape)
    llm = LLM.from_shape(args.shape, dtype=args.dtype, device=str(device),
                         max_num_seqs=args.batch,
                         max_num_batched_tokens=max(args.prompt_len, 256),
                         max_model_len=args.prompt_len + args.new_tokens + 8,
                         enable_prefix_caching=False,
                         **({"gpu_memory_utilization": args.gpu_memory_utilization}
                            if device.type == "cuda" else {"kv_cache_memory_bytes": 64 << 20}))
    ps = prompts(args.batch, args.prompt_len, cfg.vocab_size)

    def gen(n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                            use_tqdm=False)
        _sync(device)
        got = [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]
        assert all(k == n for k, _ in got), (
            f"asked {n} tokens per request, got (count, finish reason) {got}; "
            f"pool {llm.kv_cache_sizing}, stats {llm.get_kv_stats()}")
        return time.perf_counter() - t0

    gen(2)  # warm-up (kernel compilation)
    warm = llm.get_kv_stats()
    t1, tn = gen(1), gen(args.new_tokens)
    row = {"engine": "pagedkv", **fields(llm, warm),
           **decode_rate(args.batch, args.new_tokens, t1, tn)}
    llm.shutdown()  # its weights and pool go back before transformers loads its own
    return row


@torch.no_grad()
def run_hf(args, device: torch.device) -> dict:
    import transformers

    config = hf_config_from_shape(args.shape)
    dtype = getattr(torch, shape_config(args.shape).dtype if args.dtype == "auto" else args.dtype)
    config.dtype = dtype
    config._attn_implementation = "sdpa" if device.type == "cuda" else "eager"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    ids = torch.tensor(prompts(args.batch, args.prompt_len, config.vocab_size), device=device)
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        _sync(device)
        assert out.shape[1] == args.prompt_len + n
        return time.perf_counter() - t0

    gen(2)
    t1, tn = gen(1), gen(args.new_tokens)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"engine": "transformers generate (static batch)",
            "backend": config._attn_implementation,
            **decode_rate(args.batch, args.new_tokens, t1, tn)}


def run_engines(args, device: torch.device, fields) -> list[dict]:
    """pagedkv's row, then transformers' unless ``--no-hf``. transformers running out of
    device memory (its reference paths without the optional CUDA kernels materialize large
    intermediates: transformers 5.17's Bamba chunk scan asked for 256 GiB at this project's
    Bamba shape) is reported and leaves pagedkv's row standing."""
    rows = [run_pagedkv(args, device, fields)]
    if not args.no_hf:
        try:
            rows.append(run_hf(args, device))
        except torch.OutOfMemoryError as e:
            print(f"transformers baseline skipped: out of device memory ({str(e).splitlines()[0]})",
                  flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def report(name: str, title: str, args, device: torch.device, rows: list[dict],
           **extra) -> dict:
    """Prints the table (each engine's decode and output rates, first-token time, CUDA-graph
    steps where a row has them; the pagedkv / transformers decode ratio) and returns the JSON
    record (``extra``: fields after the workload's), written to ``--json`` when given."""
    table = []
    for r in rows:
        rate = r["decode_tokens_per_s"]
        decode = f"decode {rate:,.1f} tok/s" if rate else "decode n/a"
        graphs = f"   graph steps {r['cuda_graph_steps']}" if "cuda_graph_steps" in r else ""
        table.append((f"{r['engine']} [{r['backend']}]",
                      f"{decode}   output {r['output_tokens_per_s']:,.1f} tok/s   "
                      f"first token {r['t_first_token_s']:.2f} s{graphs}"))
    if len(rows) == 2 and rows[0]["decode_tokens_per_s"] and rows[1]["decode_tokens_per_s"]:
        table.append(("pagedkv / transformers (decode)",
                      f"{rows[0]['decode_tokens_per_s'] / rows[1]['decode_tokens_per_s']:.2f}x"))
    print(format_table(table, title))
    result = {"benchmark": name, "shape": args.shape, "batch": args.batch,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, **extra,
              "device": str(device), "results": rows, "environment": environment()}
    if args.json:
        write_json(args.json, result)
    return result
