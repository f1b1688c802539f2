"""Which of the engine's bf16 tokens far below the fp32 model's top-1 are router flips.

For a tiny mixture-of-experts checkpoint in bf16 (``--family``, default ``deepseek_v3``) the
engine generates greedy tokens for ``--random`` seeded prompts (``diag_bf16_noise.py``'s
prompts and engine, ``--device cpu``: the torch twins and reference attention); transformers'
fp32 model scores them teacher-forced. For every token more than ``--bound`` below its top-1,
the prompt plus our tokens run once more as one prefill through the engine in fp32
(whose tokens equal transformers' fp32 ones: the parity tests) and in bf16, recording every
MoE layer's chosen experts (``SparseMoeBlock.route``) at every row. A router flip shows as
different experts at a row; the flip rate of the rows that predicted those tokens against
that of all the other rows says whether flips explain them.

On the GPU (``--device cuda --family qwen3_next --test-prompts --block-size 64``): the
engine's tokens as the Qwen3-Next bf16 GPU test makes them, the routing replayed eagerly.

Usage: ``python3 bench/diag_moe_flips.py [--family F] [--random N] [--json out.json]``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import diag_bf16_noise as noise  # noqa: E402

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.models import moe  # noqa: E402
from pagedkv.models.harness import teacher_forced_check  # noqa: E402
from pagedkv.models.tiny import build_tiny_checkpoint  # noqa: E402


def routed_experts(llm: LLM, seq: list[int]) -> list[torch.Tensor]:
    """Every MoE layer's chosen experts ``[len(seq), k]`` (sorted along k) in a one-prefill
    run of ``seq``."""
    seen: list[torch.Tensor] = []
    inner = moe.SparseMoeBlock.route

    def route(self, x):
        weights, ids = inner(self, x)
        seen.append(ids.clone())
        return weights, ids

    moe.SparseMoeBlock.route = route
    try:
        llm.generate([seq], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    finally:
        moe.SparseMoeBlock.route = inner
    # one prefill of the whole sequence (prefix caching off): one route call a MoE layer
    assert seen and all(ids.shape[0] == len(seq) for ids in seen), [i.shape for i in seen]
    return [ids.sort(dim=-1).values.cpu() for ids in seen]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="deepseek_v3")
    ap.add_argument("--random", type=int, default=32)
    ap.add_argument("--bound", type=float, default=0.5)
    ap.add_argument("--device", default="cpu",
                    help="cuda: the engine's tokens as diag_bf16_noise's GPU rows make them "
                         "(Triton attention, CUDA graphs); the routing runs eagerly")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--test-prompts", action="store_true",
                    help="the Qwen3-Next GPU test's three prompts instead of --random ones")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = build_tiny_checkpoint(args.family, tempfile.mkdtemp(prefix="moe-flips-"),
                                 dtype="bfloat16")
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf32 = hf32.to(args.device).eval()
    prompts = (noise.PROMPTS if args.test_prompts
               else noise.random_prompts(args.random, hf32.config.vocab_size))
    outs = noise.engine_tokens(path, prompts, "bfloat16", args.block_size, args.device)
    # every run prefills the whole sequence (prefix caching off), eagerly (a hook inside a
    # captured graph would record the capture's tensors, not the replay's)
    engines = {dt: LLM(path, device=args.device, dtype=dt,
                       attention_backend="triton" if args.device == "cuda" else "torch_ref",
                       max_num_seqs=1, max_num_batched_tokens=512, max_model_len=256,
                       block_size=args.block_size, kv_cache_memory_bytes=2 << 20,
                       enable_prefix_caching=False, enforce_eager=True)
               for dt in ("float32", "bfloat16")}
    rows, flips_by_kind = [], {"over": [0, 0], "within": [0, 0]}  # [flipped rows, rows]
    for prompt, ours in zip(prompts, outs):
        with torch.no_grad():
            margins = teacher_forced_check(hf32, prompt, ours).margins
        # one prefill of the prompt and our tokens: row len(prompt) - 1 + i predicted token i
        seq = list(prompt) + list(ours[:-1])
        fp32, bf16 = (routed_experts(engines[dt], seq) for dt in ("float32", "bfloat16"))
        for i, m in enumerate(margins):
            row = len(prompt) - 1 + i
            a = [ids[row].tolist() for ids in fp32]
            b = [ids[row].tolist() for ids in bf16]
            kind = flips_by_kind["over" if m > args.bound else "within"]
            kind[0], kind[1] = kind[0] + (a != b), kind[1] + 1
            if m > args.bound:
                rows.append({"prompt_len": len(prompt), "token": i, "margin": round(m, 4),
                             "experts_fp32": a, "experts_bf16": b, "flip": a != b})
                print(f"margin {m:.3f} (prompt of {len(prompt)}, token {i}): experts a MoE "
                      f"layer fp32 {a}, bf16 {b}{'  <- flip' if a != b else ''}")
    (fo, no), (fw, nw) = flips_by_kind["over"], flips_by_kind["within"]
    print(f"rows with a router flip: {fo} of {no} tokens more than {args.bound} below the fp32 "
          f"top-1, {fw} of {nw} others")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"family": args.family, "device": args.device,
                       "block_size": args.block_size,
                       "prompts": "test" if args.test_prompts else args.random, "bound": args.bound,
                       "flips": flips_by_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
