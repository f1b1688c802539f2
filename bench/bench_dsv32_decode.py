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

The options, workload, timing, transformers' side and report are ``decode_bench_common``'s.
Prints a table and writes JSON (``--json``). ``--tiny``: the CPU-sized shape
(``deepseek-v3.2-tiny``, top-k 16) with a small batch, on the CPU unless ``--device`` says
otherwise (the smoke test runs it).

Usage on the H200::

    python bench/bench_dsv32_decode.py --json $OUT/dsv32_decode.json
    python bench/bench_dsv32_decode.py --batch 32 --prompt-len 4096 --no-hf   # pagedkv only
    python bench/bench_dsv32_decode.py --tiny                                  # CPU smoke run
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_bench_common import parse_args, report, run_engines  # noqa: E402
from pagedkv.models.config import shape_config  # noqa: E402

TINY = dict(shape="deepseek-v3.2-tiny", batch=2, prompt_len=40, new_tokens=6)
DEFAULTS = dict(shape="deepseek-v3.2-small", batch=8, prompt_len=2560, new_tokens=64)


def _fields(llm, warm: dict) -> dict:
    backend = llm.engine.model.attn_backend
    return {"backend": f"{backend.name} ({backend.kernels})",
            "kv_cache_blocks": llm.kv_cache_sizing.num_blocks}


def main(argv=None) -> dict:
    args, device = parse_args(argv, __doc__.split("\n\n")[0], TINY, DEFAULTS)
    cfg = shape_config(args.shape)
    rows = run_engines(args, device, _fields)
    ctx = args.prompt_len + args.new_tokens
    title = (f"DeepSeek-V3.2 decode, {args.shape} (random weights), batch {args.batch}, "
             f"prompt {args.prompt_len} + {args.new_tokens} new (top-k {cfg.indexer.topk}, "
             f"context {args.prompt_len}..{ctx}), {device}")
    return report("dsv32_decode", title, args, device, rows, index_topk=cfg.indexer.topk)


if __name__ == "__main__":
    main()
