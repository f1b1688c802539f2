"""Which GPU engine configurations give the CPU reference's greedy tokens (a diagnostic, not a
timing): the tiny Qwen3 checkpoint in float32, the prompts of
``tests/engine/test_engine_gpu.py::test_balanced_graph_variants_match_eager`` (6 x 40 tokens),
greedy; the reference is the torch-reference engine on the CPU in the same process, at the same
block size. Each GPU variant prints its first tokens and whether they equal the reference.

Why: in the twenty-seventh session (block size 64 as the CUDA default, cab5814) that test's
``enforce_eager`` engine differed from its first token while the CUDA-graph engine equalled the
CPU engines; it failed under the suite's 4 workers, where exact fp32 comparisons had failed
before and passed alone. This separates the block size, the eager path and its parts
(compiled regions, async scheduling, warm-up, prefix caching, cascade). The ``pair_*``
variants rebuild the test itself: its CUDA-graph engine (the balanced rule widened, cascade off)
and its eager engine alive together in one process, generating graph first (the test's order)
or eager first. If the eager engine is right alone and in ``pair_eager_first`` but wrong in
``pair_graph_first``, the graph engine's replays write memory the eager engine now owns (a
buffer a graph captured and its owner freed); if it is wrong everywhere at one block size, the
eager path at that size is.

    python3 bench/diag_eager_tokens_gpu.py --block-size 64 [--variants eager_default ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedkv.models.tiny import build_tiny_checkpoint  # noqa: E402

PROMPTS = [[5 + (i * 7 + j) % 300 for j in range(40)] for i in range(6)]

# name -> the GPU engine's options beyond the common ones
VARIANTS = {
    "eager_default": dict(enforce_eager=True),
    "eager_no_compile": dict(enforce_eager=True, compile_model=False),
    "eager_sync": dict(enforce_eager=True, async_scheduling=False),
    "eager_no_warmup": dict(enforce_eager=True, warmup=False),
    "eager_no_prefix_caching": dict(enforce_eager=True, enable_prefix_caching=False),
    "eager_no_cascade": dict(enforce_eager=True, backend=dict(cascade=None)),
    "graphs_default": dict(),
    "graphs_no_cascade": dict(backend=dict(cascade=None)),
}


def engine_tokens(path: str, block_size: int, n: int, **options) -> list[list[int]]:
    backend = options.pop("backend", None)
    opts = dict(dtype="float32", max_num_seqs=16, max_num_batched_tokens=512, max_model_len=256,
                num_gpu_blocks_override=256, block_size=block_size)
    if backend is not None:
        opts["attention_backend"] = TritonAttentionBackend(**backend)
    opts.update(options)
    llm = LLM(path, **opts)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def pair_tokens(path: str, block_size: int, n: int, eager_first: bool,
                device: str = "cuda") -> dict:
    """The test's two engines, both alive: ``{"graph": tokens, "eager": tokens}``."""
    import dataclasses

    from pagedkv.attention.triton_decode import DecodeConfig

    cfg = dataclasses.replace(DecodeConfig(), balanced_min_programs_per_sm=0.0)
    opts = dict(dtype="float32", device=device, max_num_seqs=16, max_num_batched_tokens=512,
                max_model_len=256, num_gpu_blocks_override=256, block_size=block_size)
    graph = LLM(path, **opts, attention_backend=TritonAttentionBackend(decode_config=cfg,
                                                                       cascade=None))
    eager = LLM(path, **opts, attention_backend="triton", enforce_eager=True)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out = {}
    try:
        for name in (("eager", "graph") if eager_first else ("graph", "eager")):
            llm = eager if name == "eager" else graph
            outs = llm.generate(PROMPTS, sp, use_tqdm=False)
            out[name] = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        graph.shutdown()
        eager.shutdown()
    return out


PAIRS = {"pair_graph_first": False, "pair_eager_first": True}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS) + list(PAIRS),
                   choices=list(VARIANTS) + list(PAIRS))
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda",
                   help="where the variants run (cpu: a dry run of the script, with "
                        "TRITON_INTERPRET=1 in the environment)")
    args = p.parse_args()
    path = build_tiny_checkpoint("qwen3", tempfile.mkdtemp())
    want = engine_tokens(path, args.block_size, args.tokens, device="cpu",
                         attention_backend="torch_ref")
    print(f"cpu torch_ref block {args.block_size}: {want[0][:8]}", flush=True)
    rows = []
    for name in args.variants:
        t0 = time.perf_counter()
        if name in PAIRS:
            both = pair_tokens(path, args.block_size, args.tokens, PAIRS[name], args.device)
            for part, got in both.items():
                equal = [g == w for g, w in zip(got, want)]
                rows.append(dict(variant=f"{name}:{part}", block_size=args.block_size,
                                 equal=equal, first=got[0][:8]))
                print(f"{name + ':' + part:26s} block {args.block_size}: {sum(equal)}/"
                      f"{len(equal)} prompts equal the reference; prompt 0 {got[0][:8]}",
                      flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
            continue
        got = engine_tokens(path, args.block_size, args.tokens, device=args.device,
                            **VARIANTS[name])
        equal = [g == w for g, w in zip(got, want)]
        rows.append(dict(variant=name, block_size=args.block_size, equal=equal, first=got[0][:8],
                         seconds=round(time.perf_counter() - t0, 1)))
        print(f"{name:26s} block {args.block_size}: {sum(equal)}/{len(equal)} prompts equal the "
              f"reference; prompt 0 {got[0][:8]} ({rows[-1]['seconds']} s)", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(reference=want, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
