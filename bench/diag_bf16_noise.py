"""bf16 noise against the fp32 model: how far bf16 rounding alone moves a tiny checkpoint's
greedy tokens in transformers, beside the engine's (pages of 16 and 64, bf16 and fp32).

Written for the tiny Qwen3-Next checkpoint of ``test_gpu_bf16_teacher_forced_top1[default]``
(tests/engine/test_engine_qwen3_next.py) on the GPU (the default ``--family qwen3_next``,
``--checkpoint default``); ``--checkpoint dense`` / ``full_moe`` are its ablations, and
``--family F [--options JSON]`` any other tiny family. ``--device cpu`` runs the engine's
torch twins and reference attention; ``tests/engine/test_engine_bf16_cpu.py`` runs it that way
for several families.

Every row scores one set of greedy tokens teacher-forced (``teacher_forced_check``: how many
are the scorer's top-1, the largest logit margin of one that is not, how many sit more than 0.5
below the top-1, the mean margin) under transformers in bf16 (the GPU test's scorer) and in
fp32 (the checkpoint's own weights upcast):

- ``hf_bf16``: transformers' own bf16 greedy tokens (its ``generate``), the noise floor;
- ``engine_bf16_bs{16,64}``: the engine as the GPU test builds it (Triton attention, CUDA
  graphs on the GPU);
- ``engine_fp32_bs{16,64}``: the engine in fp32 on the same weights;
- ``engine_bf16_bs{16,64}_triton_prefill``: bf16 with Triton's paged prefill kernel (the rows
  above take cuDNN's where its frontend imports).

Two prompt sets: ``test``, the Qwen3-Next GPU test's three prompts, and ``random``, ``--random``
seeded prompts of U[5, 200] tokens (more tokens: whether a row is noisier than another beyond
one token).

Usage: ``python3 bench/diag_bf16_noise.py [--device cpu] [--family F] --json out.json``."""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
import transformers

from pagedkv import LLM, SamplingParams
from pagedkv.models.harness import teacher_forced_checks
from pagedkv.models.tiny import build_tiny_checkpoint

PROMPTS = [list(range(3, 3 + n)) for n in (5, 40, 100)]  # the test's prompts
# --checkpoint: the test's default checkpoint and two ablations (where large margins come from)
CHECKPOINTS = {
    "default": {},  # linear + full attention, both MoE
    "dense": dict(mlp_only_layers=(0, 1)),  # the same with dense MLPs
    "full_moe": dict(linear_options={"layer_types": ["full_attention"] * 2}),
}
N = 24  # the test's tokens a prompt


def random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` seeded prompts of U[5, 200] token ids in [3, vocab): a distribution of margins
    beside the test's three prompts."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(5, 201, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


def score(model, prompts: list[list[int]], outs: list[list[int]]) -> dict:
    """Teacher-forced agreement of ``outs`` under ``model``: exact / total, the largest margin,
    how many tokens sit more than 0.5 below the top-1, and the mean margin."""
    tf = teacher_forced_checks(model, prompts, outs)
    return {"exact": tf.exact, "total": len(tf.margins), "max_margin": round(tf.max_margin, 4),
            "over_0.5": tf.count_over(0.5), "mean_margin": round(tf.mean_margin, 7)}


def engine_tokens(path: str, prompts: list[list[int]], dtype: str, block_size: int, device: str,
                  prefill: str = "auto") -> list[list[int]]:
    # the test's engine (make_llm's pool and sanitizer, Triton attention on CUDA; prefill
    # "triton": Triton's paged prefill kernel rather than cuDNN's where the frontend imports)
    from pagedkv.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(paged_prefill=prefill) if device == "cuda" else "torch_ref"
    llm = LLM(path, device=device, dtype=dtype, attention_backend=backend, max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=256, block_size=block_size,
              kv_cache_memory_bytes=2 << 20, sanitize=True)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--cache", default=None, help="where the checkpoint is built (a temp dir)")
    ap.add_argument("--device", default="cuda",
                    help="cpu: the torch twins and reference attention (as test_engine_bf16_cpu)")
    ap.add_argument("--random", type=int, default=24,
                    help="seeded random prompts scored as a second set (0: none)")
    ap.add_argument("--no-test-set", action="store_true", help="the random set alone")
    ap.add_argument("--checkpoint", default="default", choices=sorted(CHECKPOINTS),
                    help="qwen3_next's checkpoint: the test's or an ablation")
    ap.add_argument("--family", default="qwen3_next",
                    help="another tiny family (pagedkv.models.tiny) instead of qwen3_next")
    ap.add_argument("--options", default=None,
                    help="JSON of TinySpec options for --family (replaces --checkpoint's)")
    ap.add_argument("--variants", default=None,
                    help="engine rows, comma-separated DTYPE_BS[_triton] (e.g. bf16_64,"
                         "fp32_16,bf16_64_triton); default: bf16 / fp32 at 16 and 64, and on "
                         "CUDA bf16 with Triton's prefill at 16 and 64")
    args = ap.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="bf16-noise-")
    options = json.loads(args.options) if args.options else (
        CHECKPOINTS[args.checkpoint] if args.family == "qwen3_next" else {})
    path = build_tiny_checkpoint(args.family, cache, dtype="bfloat16", **options)
    auto = transformers.AutoModelForCausalLM
    hf16 = auto.from_pretrained(path, dtype=torch.bfloat16).to(args.device).eval()
    hf32 = auto.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    sets = {} if args.no_test_set else {"test": PROMPTS}
    if args.random:
        sets["random"] = random_prompts(args.random, hf32.config.vocab_size)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "family": args.family, "options": options, "sets": {}}
    if args.variants:
        dtypes = {"bf16": "bfloat16", "fp32": "float32"}
        variants = [(dtypes[v.split("_")[0]], int(v.split("_")[1]),
                     "triton" if v.endswith("_triton") else "auto")
                    for v in args.variants.split(",")]
    else:
        variants = [("bfloat16", bs, "auto") for bs in (16, 64)]
        variants += [("float32", bs, "auto") for bs in (16, 64)]
        if args.device == "cuda":
            variants += [("bfloat16", bs, "triton") for bs in (16, 64)]
    for set_name, prompts in sets.items():
        rows: dict[str, list[list[int]]] = {"hf_bf16": []}
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p], device=args.device)
                out = hf16.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False)
                rows["hf_bf16"].append(out[0, len(p):].tolist())
        for dtype, bs, prefill in variants:
            name = f"engine_{'bf16' if dtype == 'bfloat16' else 'fp32'}_bs{bs}"
            name += "_triton_prefill" if prefill == "triton" else ""
            rows[name] = engine_tokens(path, prompts, dtype, bs, args.device, prefill)
        out_rows = result["sets"][set_name] = {}
        print(f"== {set_name} prompts ({len(prompts)} x {N} tokens): exact / total, largest "
              "margin, tokens over 0.5, mean margin")
        with torch.no_grad():
            for name, toks in rows.items():
                a, b = score(hf16, prompts, toks), score(hf32, prompts, toks)
                out_rows[name] = {"under_hf_bf16": a, "under_hf_fp32": b, "tokens": toks}
                print(f"{name:32s} under hf bf16 {a['exact']}/{a['total']} {a['max_margin']:.3f} "
                      f"{a['over_0.5']} {a['mean_margin']:.5f} | under hf fp32 "
                      f"{b['exact']}/{b['total']} {b['max_margin']:.3f} {b['over_0.5']} "
                      f"{b['mean_margin']:.5f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
