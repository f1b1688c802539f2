"""Decode throughput of DeepSeek-V3.2 (DSA) with random weights: pagedkv and transformers in
the same run.

Model: a named shape (``--shape``, default ``deepseek-v3.2-small``: DeepSeek-V2-Lite's
dimensions with V3.2's attention, the indexer at V3.2's size, top-k 2048; see
``pagedkv.models.config.SHAPES``), random weights (throughput does not depend on their values;
each engine draws its own). Workload: a static batch of ``--batch`` random prompts of
``--prompt-len`` tokens, greedy, EOS ignored. Defaults put the context past the top-k (2560 >
2048), so every decode token attends to a strict subset of its context.

Both engines run the same two generations: ``max_tokens = 1`` (prefill and the first token)
and ``max_tokens = --new-tokens``; the decode throughput is ``batch * (new_tokens - 1) /
(t_new - t_1)`` (tokens per second of decode steps alone); total output tokens per second
are reported too. pagedkv: ``LLM.from_shape`` with its defaults for the device (on CUDA the
Triton DSA kernels: indexer scores, sparse latent attention; eager decode steps: DSA has no
CUDA graphs yet); transformers: ``DeepseekV32ForCausalLM`` from the same config
(``attn_implementation`` sdpa on CUDA, eager on CPU), ``generate`` with a static batch.

Prints a table and writes JSON (``--json``). ``--tiny``: the CPU-sized shape
(``deepseek-v3.2-tiny``, top-k 16) with a small batch, on the CPU unless ``--device`` says
otherwise (the smoke test runs it).

Usage on the H200::

    python bench/bench_dsv32_decode.py --json $OUT/dsv32_decode.json
    python bench/bench_dsv32_decode.py --batch 32 --prompt-len 4096 --no-hf   # pagedkv only
    python bench/bench_dsv32_decode.py --tiny                                  # CPU smoke run
"""

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

TINY = dict(shape="deepseek-v3.2-tiny", batch=2, prompt_len=40, new_tokens=6)
DEFAULTS = dict(shape="deepseek-v3.2-small", batch=8, prompt_len=2560, new_tokens=64)


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


def run_pagedkv(args, device: torch.device) -> dict:
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
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return time.perf_counter() - t0

    gen(2)  # warm-up (kernel compilation)
    t1, tn = gen(1), gen(args.new_tokens)
    backend = llm.engine.model.attn_backend
    row = {"engine": "pagedkv", "backend": f"{backend.name} ({backend.kernels})",
           "kv_cache_blocks": llm.kv_cache_sizing.num_blocks,
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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    base = TINY if args.tiny else DEFAULTS
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode steps are timed)")
    device = torch.device(args.device or ("cpu" if args.tiny or not torch.cuda.is_available()
                                          else "cuda"))
    cfg = shape_config(args.shape)
    rows = [run_pagedkv(args, device)]
    if not args.no_hf:
        rows.append(run_hf(args, device))
    ctx = args.prompt_len + args.new_tokens
    title = (f"DeepSeek-V3.2 decode, {args.shape} (random weights), batch {args.batch}, "
             f"prompt {args.prompt_len} + {args.new_tokens} new (top-k {cfg.indexer.topk}, "
             f"context {args.prompt_len}..{ctx}), {device}")
    table = []
    for r in rows:
        rate = r["decode_tokens_per_s"]
        decode = f"decode {rate:,.1f} tok/s" if rate else "decode n/a"
        table.append((f"{r['engine']} [{r['backend']}]",
                      f"{decode}   output {r['output_tokens_per_s']:,.1f} tok/s   "
                      f"first token {r['t_first_token_s']:.2f} s"))
    if len(rows) == 2 and rows[0]["decode_tokens_per_s"] and rows[1]["decode_tokens_per_s"]:
        table.append(("pagedkv / transformers (decode)",
                      f"{rows[0]['decode_tokens_per_s'] / rows[1]['decode_tokens_per_s']:.2f}x"))
    print(format_table(table, title))
    result = {"benchmark": "dsv32_decode", "shape": args.shape, "batch": args.batch,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "index_topk": cfg.indexer.topk, "device": str(device), "results": rows,
              "environment": environment()}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
