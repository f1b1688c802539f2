"""Decode throughput of a Mamba-2 hybrid (Bamba) with random weights: pagedkv and transformers
in the same run.

Model: a named shape (``--shape``, default ``bamba-9b``: Bamba-9B's dimensions, 29 Mamba-2
layers of 128 heads x 64 with a 128-wide state and 3 attention layers; see
``pagedkv.models.config.SHAPES``), random weights (throughput does not depend on their values;
each engine draws its own). Workload: a static batch of ``--batch`` random prompts of
``--prompt-len`` tokens, greedy, EOS ignored.

Both engines run the same two generations, ``max_tokens = 1`` and ``max_tokens =
--new-tokens``; decode throughput = ``batch * (new_tokens - 1) / (t_new - t_1)`` (the
timing of ``bench_dsv32_decode``, whose helpers and transformers side this script shares).
pagedkv: ``LLM.from_shape`` with the device's defaults (on CUDA the Triton attention backend,
the Mamba-2 kernels (causal conv1d, single-step state update for decode rows, the chunked SSD
scan for prefill rows) and decode CUDA graphs), prefix caching off (one state block per
request, mode ``none``); transformers: ``BambaForCausalLM`` from the same config (sdpa
attention on CUDA; its Mamba-2 mixer runs the torch reference path unless ``mamba_ssm`` and
``causal_conv1d`` are installed), ``generate`` on a static batch.

Prints a table and writes JSON (``--json``). ``--tiny``: the CPU-sized shape (``bamba-tiny``)
with a small batch, on the CPU unless ``--device`` says otherwise (the smoke test runs it;
kernels go through the Triton interpreter when ``TRITON_INTERPRET=1``).

Usage on the H200::

    python bench/bench_mamba2_decode.py --json $OUT/mamba2_decode.json
    python bench/bench_mamba2_decode.py --batch 64 --prompt-len 2048 --no-hf   # pagedkv only
    python bench/bench_mamba2_decode.py --tiny                                  # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_dsv32_decode import _sync, decode_rate, prompts, run_hf  # noqa: E402
from pagedkv.engine.llm import LLM  # noqa: E402
from pagedkv.models.config import shape_config  # noqa: E402
from pagedkv.tools.benchmark import environment, format_table, write_json  # noqa: E402

TINY = dict(shape="bamba-tiny", batch=2, prompt_len=40, new_tokens=6)
DEFAULTS = dict(shape="bamba-9b", batch=16, prompt_len=1024, new_tokens=128)


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
    graph_steps = llm.get_kv_stats()["cuda_graph_steps"]
    t1, tn = gen(1), gen(args.new_tokens)
    stats = llm.get_kv_stats()
    groups = llm.scheduler.kv_cache_config.kv_cache_groups
    states = [g for g in groups if type(g.kv_cache_spec).__name__ == "MambaSpec"]
    row = {"engine": "pagedkv", "backend": llm.engine.model.attn_backend.name,
           "kv_cache_blocks": llm.kv_cache_sizing.num_blocks, "block_size": stats["block_size"],
           "state_groups": len(states), "kv_cache_groups": len(groups),
           "cuda_graph_steps": stats["cuda_graph_steps"] - graph_steps,
           **decode_rate(args.batch, args.new_tokens, t1, tn)}
    llm.shutdown()  # its weights and pool go back before transformers loads its own
    return row


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
    mc = cfg.mamba
    rows = [run_pagedkv(args, device)]
    if not args.no_hf:
        rows.append(run_hf(args, device))
    title = (f"Mamba-2 hybrid decode, {args.shape} (random weights: {mc.layer_types.count('mamba')} "
             f"mixers of {mc.num_heads}x{mc.head_dim}, state {mc.d_state}; "
             f"{mc.layer_types.count('attention')} attention layers), batch {args.batch}, "
             f"prompt {args.prompt_len} + {args.new_tokens} new, {device}")
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
    result = {"benchmark": "mamba2_decode", "shape": args.shape, "batch": args.batch,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "device": str(device), "results": rows, "environment": environment()}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
