"""A bf16 yardstick for ``test_gpu_bf16_teacher_forced_top1[default]`` (tests/engine/
test_engine_qwen3_next.py) on the GPU: how far bf16 rounding alone moves the tiny Qwen3-Next
checkpoint's greedy tokens, beside the engine's at pages of 16 and 64.

For the test's checkpoint (``build_tiny_checkpoint("qwen3_next", dtype="bfloat16")``) and
prompts, every row scores one set of greedy tokens teacher-forced (``teacher_forced_check``:
how many are the scorer's top-1, and the largest logit margin of one that is not) under
transformers in bf16 (the test's scorer) and in fp32 (the checkpoint's own weights upcast):

- ``hf_bf16``: transformers' own bf16 greedy tokens (its ``generate``), the noise floor;
- ``engine_bf16_bs{16,64}``: the engine as the test builds it (Triton attention, CUDA graphs);
- ``engine_fp32_bs{16,64}``: the engine in fp32 on the same weights;
- ``engine_bf16_bs{16,64}_triton_prefill``: bf16 with Triton's paged prefill kernel (the rows
  above take cuDNN's where its frontend imports).

Usage: ``python3 bench/diag_qwen3_next_bf16_gpu.py --json out.json``."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import transformers

from pagedkv import LLM, SamplingParams
from pagedkv.models.harness import teacher_forced_check
from pagedkv.models.tiny import build_tiny_checkpoint

PROMPTS = [list(range(3, 3 + n)) for n in (5, 40, 100)]  # the test's prompts
N = 24  # the test's tokens a prompt


def score(model, outs: list[list[int]]) -> dict:
    exact = total = 0
    worst = 0.0
    for p, o in zip(PROMPTS, outs):
        tf = teacher_forced_check(model, p, o)
        exact, total, worst = exact + tf.exact, total + len(tf.margins), max(worst, tf.max_margin)
    return {"exact": exact, "total": total, "max_margin": round(worst, 4)}


def engine_tokens(path: str, dtype: str, block_size: int, device: str,
                  prefill: str = "auto") -> list[list[int]]:
    # the test's engine (make_llm's pool and sanitizer, Triton attention on CUDA; prefill
    # "triton": Triton's paged prefill kernel rather than cuDNN's where the frontend imports)
    from pagedkv.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(paged_prefill=prefill) if device == "cuda" else "torch_ref"
    llm = LLM(path, device=device, dtype=dtype, attention_backend=backend, max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=256, block_size=block_size,
              kv_cache_memory_bytes=2 << 20, sanitize=True)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--cache", default=None, help="where the checkpoint is built (a temp dir)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (torch_ref attention)")
    args = ap.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="qwen3next-bf16-")
    path = build_tiny_checkpoint("qwen3_next", cache, dtype="bfloat16")
    auto = transformers.AutoModelForCausalLM
    hf16 = auto.from_pretrained(path, dtype=torch.bfloat16).to(args.device).eval()
    hf32 = auto.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    rows: dict[str, list[list[int]]] = {}
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p], device=args.device)
            out = hf16.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False)
            rows.setdefault("hf_bf16", []).append(out[0, len(p):].tolist())
    for dtype in ("bfloat16", "float32"):
        for bs in (16, 64):
            rows[f"engine_{'bf16' if dtype == 'bfloat16' else 'fp32'}_bs{bs}"] = \
                engine_tokens(path, dtype, bs, args.device)
    if args.device == "cuda":
        for bs in (16, 64):
            rows[f"engine_bf16_bs{bs}_triton_prefill"] = \
                engine_tokens(path, "bfloat16", bs, args.device, prefill="triton")
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "commit": os.environ.get("COMMIT"),
              "rows": {}}
    with torch.no_grad():
        for name, toks in rows.items():
            result["rows"][name] = {"under_hf_bf16": score(hf16, toks),
                                    "under_hf_fp32": score(hf32, toks)}
    for name, r in result["rows"].items():
        a, b = r["under_hf_bf16"], r["under_hf_fp32"]
        print(f"{name:32s} under hf bf16 {a['exact']}/{a['total']} margin {a['max_margin']:.3f}"
              f" | under hf fp32 {b['exact']}/{b['total']} margin {b['max_margin']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
