"""Decode throughput of a Mamba-2 hybrid (Bamba) with random weights: pagedkv and transformers
in the same run.

Model: a named shape (``--shape``, default ``bamba-9b``: Bamba-9B's dimensions, 29 Mamba-2
layers of 128 heads x 64 with a 128-wide state and 3 attention layers; see
``pagedkv.models.config.SHAPES``), random weights (throughput does not depend on their values;
each engine draws its own). Workload: a static batch of ``--batch`` random prompts of
``--prompt-len`` tokens, greedy, EOS ignored.

Both engines run the same two generations, ``max_tokens = 1`` and ``max_tokens =
--new-tokens``; decode throughput = ``batch * (new_tokens - 1) / (t_new - t_1)`` (the
options, workload, timing, transformers' side and report of ``decode_bench_common``, shared
with ``bench_dsv32_decode``).
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

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_bench_common import parse_args, report, run_engines  # noqa: E402
from pagedkv.models.config import shape_config  # noqa: E402

TINY = dict(shape="bamba-tiny", batch=2, prompt_len=40, new_tokens=6)
DEFAULTS = dict(shape="bamba-9b", batch=16, prompt_len=1024, new_tokens=128)


def _fields(llm, warm: dict) -> dict:
    stats = llm.get_kv_stats()
    groups = llm.scheduler.kv_cache_config.kv_cache_groups
    states = [g for g in groups if type(g.kv_cache_spec).__name__ == "MambaSpec"]
    return {"backend": llm.engine.model.attn_backend.name,
            "kv_cache_blocks": llm.kv_cache_sizing.num_blocks, "block_size": stats["block_size"],
            "state_groups": len(states), "kv_cache_groups": len(groups),
            "cuda_graph_steps": stats["cuda_graph_steps"] - warm["cuda_graph_steps"]}


def main(argv=None) -> dict:
    args, device = parse_args(argv, __doc__.split("\n\n")[0], TINY, DEFAULTS)
    mc = shape_config(args.shape).mamba
    rows = run_engines(args, device, _fields)
    title = (f"Mamba-2 hybrid decode, {args.shape} (random weights: {mc.layer_types.count('mamba')} "
             f"mixers of {mc.num_heads}x{mc.head_dim}, state {mc.d_state}; "
             f"{mc.layer_types.count('attention')} attention layers), batch {args.batch}, "
             f"prompt {args.prompt_len} + {args.new_tokens} new, {device}")
    return report("mamba2_decode", title, args, device, rows)


if __name__ == "__main__":
    main()
