"""Workload W1 of PERF.md: offline throughput of pagedkv (and, with --with-hf, of Hugging Face
transformers on the same prompts), one GPU.

W1: ``random.seed(0)``; 256 requests of ``randint(100, 1024)`` prompt tokens of
``randint(0, 10000)``; then ``max_tokens = randint(100, 1024)`` each; EOS ignored; 133,966 output
tokens. Model: the Qwen3-0.6B architecture with random bf16 weights (``--shape qwen3-0.6b``, the
default) or a checkpoint directory (``--model DIR``); ``max_model_len`` 4096.

Counts the tokens actually generated. Prints a table last and writes JSON (``--json``).

References measured in the same run with ``--with-hf`` (transformers builds its own random
weights from the same architecture; throughput does not depend on weight values):

* ``generate_batch`` (continuous batching, paged attention) on the W1 prompts with one
  ``max_new_tokens`` for all requests (``--hf-max-new-tokens``, default 256: PERF.md's reference
  row, since ``generate_batch`` takes no per-request length);
* with ``--hf-static``: ``generate`` on a static batch of ``--hf-static-batch`` x 512 prompt
  tokens -> 256 new tokens (PERF.md's "easier, fixed-length" row).

Engine options: ``LLM``'s defaults unless given (on CUDA async scheduling and the compiled
model regions are on; ``--no-async-scheduling`` / ``--no-compile-model`` turn them off), so the
number is what ``LLM(path)`` gives.

Usage on the H200::

    python bench/bench_w1.py --json w1.json                 # pagedkv only
    python bench/bench_w1.py --with-hf --hf-static --json w1.json
    python bench/bench_w1.py --num-requests 32 --scale 0.25  # quick variant
    python bench/bench_w1.py --kv-cache-dtype fp8 --workload w2 --json w2_fp8.json
    python bench/bench_w1.py --shape llama-3.1-8b -tp 2 --json w1_tp2.json   # 2 GPUs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from pagedkv.tools.benchmark import (  # noqa: E402
    environment,
    format_table,
    result_table,
    WORKLOAD_MAX_MODEL_LEN,
    run_throughput,
    workload,
    write_json,
)
from pagedkv.engine.llm import LLM  # noqa: E402


def build_pagedkv(args) -> tuple[LLM, str]:
    kw = dict(
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        mixed_cuda_graphs=args.mixed_cuda_graphs,
        enable_prefix_caching=not args.no_prefix_caching,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        async_scheduling=args.async_scheduling,
        compile_model=args.compile_model,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        decode_context_parallel_size=args.decode_context_parallel_size,
    )
    if args.no_cascade or args.prefill_config or args.reduce_heads or args.fresh_prefill \
            or args.decode_order is not None or args.flat_split is not None \
            or args.lpt_one_range is not None or args.fused_reduce is not None \
            or args.decode_config or args.paged_prefill:
        # the Triton backend with cascade (shared-prefix) attention off, or with other
        # prefill launches (which the cascade prefix launch then takes as well), or another
        # reduce width of the decode kernel
        from pagedkv.attention.triton_backend import CascadeConfig, TritonAttentionBackend
        from pagedkv.attention.triton_decode import DecodeConfig
        from pagedkv.attention.triton_prefill import PrefillConfig

        pc = None
        if args.prefill_config:
            bm, bn, w, st, pack = (int(v) for v in args.prefill_config.split(","))
            pc = PrefillConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st,
                               pack_heads=pack)
        dc = None
        if args.reduce_heads or args.decode_order is not None or args.flat_split is not None \
                or args.lpt_one_range is not None or args.fused_reduce is not None:
            order = DecodeConfig.use_order if args.decode_order is None else args.decode_order
            lpt = (DecodeConfig.lpt_one_range and order) if args.lpt_one_range is None \
                else args.lpt_one_range
            dc = DecodeConfig(reduce_heads=args.reduce_heads or DecodeConfig.reduce_heads,
                              use_order=order or lpt, lpt_one_range=lpt,
                              flat_split=DecodeConfig.flat_split if args.flat_split is None
                              else args.flat_split,
                              fused_reduce=DecodeConfig.fused_reduce
                              if args.fused_reduce is None else args.fused_reduce)
            if args.fused_reduce is False:
                dc = dc.unfused()
        if args.decode_config:  # fields set last, over the flags above
            import dataclasses

            dc = dataclasses.replace(dc or DecodeConfig(),
                                     **decode_config_fields(args.decode_config))
        kw["attention_backend"] = TritonAttentionBackend(
            prefill_config=pc, decode_config=dc, fresh_prefill=args.fresh_prefill or "auto",
            paged_prefill=args.paged_prefill or "auto",
            cascade=None if args.no_cascade else CascadeConfig())
    if args.model:
        return LLM(args.model, tokenizer=False, **kw), args.model
    return LLM.from_shape(args.shape, **kw), f"{args.shape} (random weights)"


def decode_config_fields(text: str) -> dict:
    """``k=v,...`` as ``DecodeConfig`` keyword arguments (bools as 0 / 1, ``none`` as None,
    other fields as their default's type, int where the default is None); an unknown field
    exits with its name."""
    import dataclasses

    from pagedkv.attention.triton_decode import DecodeConfig
    types = {f.name: f.type for f in dataclasses.fields(DecodeConfig)}
    kw = {}
    for item in text.split(","):
        k, v = item.split("=")
        if k not in types:
            raise SystemExit(f"--decode-config: DecodeConfig has no field {k!r}")
        default = getattr(DecodeConfig(), k)
        if v.lower() == "none":
            kw[k] = None
        elif types[k] in (bool, "bool"):
            kw[k] = bool(int(v))
        else:
            kw[k] = int(v) if default is None else type(default)(v)
    return kw


# ``--[no-]X`` flags that set a module switch before the engine starts: (argument, module,
# class or None, attribute)
SWITCHES = (
    ("splitk", "pagedkv.kernels.splitk_gemm", None, "SPLITK_ENABLED"),
    ("splitk_gate_up", "pagedkv.kernels.splitk_gemm", None, "SPLITK_GATE_UP_ENABLED"),
    ("fused_qkv", "pagedkv.models.decoder", "DecoderForCausalLM", "fuse_qkv_projection"),
    ("fused_decode", "pagedkv.models.decoder", "DecoderForCausalLM", "fuse_decode_chain"),
    ("persistent_decode", "pagedkv.models.decoder", "DecoderForCausalLM",
     "fuse_persistent_decode"),
    ("decode_prologue", "pagedkv.models.decoder", "DecoderForCausalLM", "fuse_decode_prologue"),
    ("fused_gate_up", "pagedkv.kernels.gate_up_silu", None, "FUSED_GATE_UP_ENABLED"),
    ("pdl", "pagedkv.kernels.pdl", None, "PDL_ENABLED"),
)


def configure_splitk(args) -> None:
    """The kernel switches (``SWITCHES``: split-K, the fused decode kernels, PDL) and
    ``--splitk-table``: the split-K launches a sweep chose (entries with ``use`` false are left
    to cuBLAS: split count 1)."""
    import importlib
    import json

    from pagedkv.kernels import splitk_gemm as sk

    for arg, module, owner, name in SWITCHES:
        value = getattr(args, arg)
        if value is not None:
            mod = importlib.import_module(module)
            setattr(getattr(mod, owner) if owner else mod, name, value)
    if args.splitk_table:
        with open(args.splitk_table) as f:
            table = json.load(f)
        for key, e in table.items():
            n, k = (int(v) for v in key.split(","))
            bm, bn, bk, warps, stages = e["config"]
            sk.SPLITK_CONFIGS[(n, k)] = sk.SplitKConfig(bm, bn, bk, warps, stages)
            sk.SPLITK_SPLITS[(n, k)] = int(e["splits"]) if e.get("use", True) else 1
        print(f"split-K launches from {args.splitk_table}: {table}", flush=True)


def configure_lm_head_argmax(args) -> None:
    """``--[no-]lm-head-argmax`` / ``--lm-head-argmax-table``: the fused LM head + greedy argmax
    on or off, and the launch configs a sweep chose (``bench_lm_head_argmax_gpu.py
    --table-out``: bucket of rows -> config)."""
    import json

    from pagedkv.kernels import lm_head_argmax as lha

    if args.lm_head_argmax is not None:
        lha.LM_HEAD_ARGMAX_ENABLED = args.lm_head_argmax
    if args.lm_head_argmax_table:
        with open(args.lm_head_argmax_table) as f:
            table = json.load(f)
        for bucket, e in table.items():
            lha.CONFIGS[int(bucket)] = lha.LMHeadArgmaxConfig(*e["config"])
        print(f"LM head + argmax launches from {args.lm_head_argmax_table}: "
              f"{ {b: e['config'] for b, e in table.items()} }", flush=True)


def hf_config_from_shape(name: str):
    """transformers' config of a named shape whose family has its own config class (Gemma 3,
    DeepSeek-V3, MoE: the shape dict is that class's ``to_dict``); None for the dense Llama-like
    shapes (built through the tiny-checkpoint spec)."""
    import transformers

    from pagedkv.models.config import shape_config, shape_config_dict

    if shape_config(name).family in ("llama", "qwen2", "qwen3", "mistral"):
        return None
    raw = shape_config_dict(name)
    raw.pop("architectures", None)
    raw.pop("dtype", None)
    return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)


def hf_model(args):
    import transformers

    dtype = torch.bfloat16 if args.dtype in ("auto", "bfloat16", "bf16") else getattr(torch, args.dtype)
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, dtype=dtype, attn_implementation="sdpa").cuda().eval()
    elif hf_config_from_shape(args.shape) is not None:  # families with their own config
        config = hf_config_from_shape(args.shape)
        config.dtype = dtype
        config._attn_implementation = "sdpa"
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    else:
        from pagedkv.models.tiny import FAMILY_ARCHITECTURES, hf_config_dict, shape_spec_options, tiny_spec

        family, opts = shape_spec_options(args.shape)
        opts["dtype"] = str(dtype).removeprefix("torch.")
        config_cls = getattr(transformers, FAMILY_ARCHITECTURES[family].replace("ForCausalLM", "Config"))
        model_cls = getattr(transformers, FAMILY_ARCHITECTURES[family])
        config = config_cls(**hf_config_dict(tiny_spec(family, **opts)))
        config._attn_implementation = "sdpa"
        with torch.device("cuda"):
            model = model_cls(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def run_hf_generate_batch(model, prompts, max_new_tokens: int) -> dict:
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    model.generate_batch(prompts[:4], generation_config=gc, max_new_tokens=8)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gc)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(r.generated_tokens) for r in out.values())
    return {"engine": "transformers generate_batch", "requests": len(prompts),
            "max_new_tokens": max_new_tokens, "output_tokens": tokens, "elapsed_s": dt,
            "output_tokens_per_s": tokens / dt}


@torch.no_grad()
def run_hf_static(model, batch: int, prompt_len: int = 512, new_tokens: int = 256) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10000, (batch, prompt_len), generator=gen).cuda()
    mask = torch.ones_like(ids)
    model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = (out.shape[1] - prompt_len) * batch
    return {"engine": "transformers generate (static)", "requests": batch, "prompt_len": prompt_len,
            "max_new_tokens": new_tokens, "output_tokens": tokens, "elapsed_s": dt,
            "output_tokens_per_s": tokens / dt}


def _record_step_times(llm, record: dict) -> None:
    """Wrap the engine's ``step`` to time every step of every ``generate`` call (the warm-up
    generations included, labelled by call); each call's summary is printed when the next call
    starts and at exit."""
    import atexit

    engine, runner = llm.engine, llm.engine.runner
    calls: list[list[tuple[float, bool]]] = []
    segs: list[int] = []
    inner_step, inner_generate = engine.step, llm.generate

    def seg_count() -> int:
        return int(torch.cuda.memory_stats().get("segment.all.allocated", 0)) \
            if torch.cuda.is_available() else 0

    def step(*a, **kw):
        g0 = runner.num_graph_steps
        m0 = getattr(runner, "num_mixed_graph_steps", 0)
        t = time.perf_counter()
        out = inner_step(*a, **kw)
        kind = ("g" if runner.num_graph_steps > g0
                else "m" if getattr(runner, "num_mixed_graph_steps", 0) > m0 else "")
        calls[-1].append((time.perf_counter() - t, kind))
        return out

    def summary(i: int) -> None:
        st = calls[i]
        graph = sum(dt for dt, g in st if g == "g")
        mixed = sum(dt for dt, g in st if g == "m")
        other = sum(dt for dt, g in st if not g)
        slow = sorted(range(len(st)), key=lambda j: -st[j][0])[:6]
        line = (f"generate call {i}: {len(st)} steps, graph steps {graph:.3f} s, mixed-graph "
                f"steps {mixed:.3f} s, other steps "
                f"{other:.3f} s, new allocator segments {segs[i + 1] - segs[i] if i + 1 < len(segs) else '?'}; "
                "slowest: " + ", ".join(f"#{j} {st[j][0] * 1e3:.1f} ms{' ' + st[j][1] if st[j][1] else ''}" for j in slow))
        print(line, flush=True)
        record.setdefault("step_times", []).append(line)

    def generate(*a, **kw):
        segs.append(seg_count())
        if calls:
            summary(len(calls) - 1)
        calls.append([])
        return inner_generate(*a, **kw)

    def at_exit():
        segs.append(seg_count())
        if calls:
            summary(len(calls) - 1)

    engine.step = step
    llm.generate = generate
    atexit.register(at_exit)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: --shape)")
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--workload", default="w1", choices=["w1", "w2", "w3"],
                   help="w1 (default), w2 long context, w3 shared prefix (issue 13)")
    p.add_argument("--num-requests", type=int, default=None, help="default: the workload's own")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: the engine's, 64 on CUDA)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: LLM()'s (16384 on a >= 70 GiB GPU that is not an A100, else 8192)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: 4096 for W1 / W3, 8704 for W2")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--mixed-cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA graphs of mixed prefill / decode steps (LLM's default: on; "
                        "--no-mixed-cuda-graphs: those steps eager)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step k+1 while step k runs on the device (default: LLM's, "
                        "on with CUDA)")
    p.add_argument("--compile-model", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the norm/RoPE/MLP regions (default: LLM's, on with "
                        "CUDA; falls back to eager with a warning if compilation fails)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="the attention KV cache: auto (the model's dtype) or fp8 (e4m3)")
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "torch_ref", "triton", "triton+cudnn"])
    p.add_argument("--no-cascade", action="store_true",
                   help="the Triton backend without cascade (shared-prefix) attention")
    p.add_argument("--prefill-config", default=None, metavar="BM,BN,WARPS,STAGES,PACK",
                   help="the Triton backend's prefill launches (PrefillConfig: tokens and keys "
                        "a tile, warps, stages, query heads a program), e.g. 64,64,4,4,1 (A/B)")
    p.add_argument("--paged-prefill", default=None, choices=["auto", "triton", "cudnn"],
                   help="the Triton backend's prefill requests: its paged kernel or cuDNN's "
                        "paged attention (TritonAttentionBackend(paged_prefill=...); A/B runs)")
    p.add_argument("--fresh-prefill", default=None, choices=["auto", "triton", "varlen"],
                   help="the Triton backend's fresh-prefill path (TritonAttentionBackend"
                        "(fresh_prefill=...); A/B runs)")
    p.add_argument("--reduce-heads", type=int, default=None, metavar="N",
                   help="query heads a decode reduce program merges (DecodeConfig.reduce_heads)")
    p.add_argument("--decode-order", action=argparse.BooleanOptionalAction, default=None,
                   help="the decode kernel launches the requests longest first "
                        "(DecodeConfig.use_order; default: the DecodeConfig default, on; "
                        "--no-decode-order also turns the one-range policy off unless "
                        "--lpt-one-range is given)")
    p.add_argument("--flat-split", action=argparse.BooleanOptionalAction, default=None,
                   help="the decode kernel splits the batch's work evenly over one wave of "
                        "programs (DecodeConfig.flat_split; default: the DecodeConfig default)")
    p.add_argument("--lpt-one-range", action=argparse.BooleanOptionalAction, default=None,
                   help="decode launches of one range per request, longest first, where the "
                        "lengths allow it (DecodeConfig.lpt_one_range; implies --decode-order; "
                        "default: the DecodeConfig default, on)")
    p.add_argument("--decode-config", default="",
                   help="k=v,... DecodeConfig fields (bools 0 / 1), set over the decode flags "
                        "above (A/B runs, e.g. balanced_fraction=1.0)")
    p.add_argument("--fused-reduce", action=argparse.BooleanOptionalAction, default=None,
                   help="every decode split launch merges its own ranges, no reduce launch "
                        "(DecodeConfig.fused_reduce); --no-fused-reduce: none does (not even the "
                        "one-wave launches the default fuses; default: the DecodeConfig "
                        "default)")
    p.add_argument("--splitk", action=argparse.BooleanOptionalAction, default=None,
                   help="the decode-step o / down projections through the split-K kernel "
                        "(pagedkv.kernels.splitk_gemm; on by default) or cuBLAS (A/B runs)")
    p.add_argument("--splitk-gate-up", action=argparse.BooleanOptionalAction, default=None,
                   help="the decode-step gate/up projection as split-K partials summed by the "
                        "activation kernel (splitk_gemm.SPLITK_GATE_UP_ENABLED; off by default)")
    p.add_argument("--fused-qkv", action=argparse.BooleanOptionalAction, default=None,
                   help="decode-sized batches' QKV GEMM fused with the q/k norms, RoPE and the "
                        "KV write (pagedkv.kernels.qkv_rope_cache; "
                        "DecoderForCausalLM.fuse_qkv_projection, off by default)")
    p.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                   help="programmatic dependent launch of this package's kernels "
                        "(pagedkv.kernels.pdl.PDL_ENABLED, environment PAGEDKV_PDL; off by "
                        "default); with --fused-decode the chain's kernels also prefetch their "
                        "weights into the L2 before their wait")
    p.add_argument("--fused-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="decode-sized batches' layers as the fused decode chain (norms inside "
                        "the QKV and gate/up kernels, residual adds in the o / down split-K "
                        "epilogues; DecoderForCausalLM.fuse_decode_chain, off by default)")
    p.add_argument("--persistent-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="decode-sized batches' layers after attention as one persistent launch "
                        "each (pagedkv.kernels.persistent_layer; "
                        "DecoderForCausalLM.fuse_persistent_decode, off by default)")
    p.add_argument("--decode-prologue", action=argparse.BooleanOptionalAction, default=None,
                   help="decode-only steps: the q/k norms, RoPE and K/V write inside the decode "
                        "attention launch (pagedkv.attention.triton_decode.QKPrologue; "
                        "DecoderForCausalLM.fuse_decode_prologue, off by default)")
    p.add_argument("--fused-gate-up", action=argparse.BooleanOptionalAction, default=None,
                   help="decode-sized batches' gate/up GEMM with SiLU in its epilogue "
                        "(pagedkv.kernels.gate_up_silu.FUSED_GATE_UP_ENABLED; off by default)")
    p.add_argument("--splitk-table", default=None,
                   help="JSON of per-shape split-K launches (bench_splitk_gemm_gpu.py "
                        "--table-out) installed before the engine starts")
    p.add_argument("--lm-head-argmax", action=argparse.BooleanOptionalAction, default=None,
                   help="greedy steps through the fused LM head + argmax kernel "
                        "(pagedkv.kernels.lm_head_argmax.LM_HEAD_ARGMAX_ENABLED) or the GEMM "
                        "then the argmax (A/B runs)")
    p.add_argument("--lm-head-argmax-table", default=None,
                   help="JSON of the fused kernel's launch configs by rows "
                        "(bench_lm_head_argmax_gpu.py --table-out) installed before the start")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks (worker processes); with --shape each rank draws its own random "
                        "shard (pagedkv.distributed.shard.random_shard)")
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    p.add_argument("--with-hf", action="store_true", help="also time transformers generate_batch")
    p.add_argument("--hf-max-new-tokens", type=int, default=256)
    p.add_argument("--hf-static", action="store_true", help="also time transformers static generate")
    p.add_argument("--hf-static-batch", type=int, default=256)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--repeat", type=int, default=1,
                   help="timed runs on the same engine (each after its warm-up and a prefix-cache "
                        "reset); the table shows the first, the JSON has all and their median")
    p.add_argument("--step-times", action="store_true",
                   help="per timed run: wall time of graph-replay vs other steps, the slowest "
                        "steps, and new CUDA allocator segments (where a first run loses time)")
    p.add_argument("--json", default="bench_w1.json")
    args = p.parse_args(argv)
    if args.max_model_len is None:
        args.max_model_len = WORKLOAD_MAX_MODEL_LEN[args.workload]

    configure_splitk(args)
    configure_lm_head_argmax(args)
    wl = workload(args.workload, args.num_requests, args.scale)
    record: dict = {"environment": environment(), "args": vars(args), "workload": {
        "name": wl.name, "requests": wl.num_requests, "prompt_tokens": wl.prompt_tokens,
        "requested_output_tokens": wl.requested_output_tokens}}
    rows: list[tuple[str, str]] = []

    t_start = time.perf_counter()
    llm, label = build_pagedkv(args)
    # the engine's start-up: weights, KV pool, compiled regions, warm-up, CUDA-graph capture
    record["startup_s"] = time.perf_counter() - t_start
    if torch.cuda.is_available():  # what the engine holds after start-up (graph pools included)
        free, total = torch.cuda.mem_get_info()
        record["device_memory_after_startup"] = {
            "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "used_by_process_and_others": total - free, "total": total}
    print(f"{wl.name}: {wl.num_requests} requests, {wl.prompt_tokens:,} prompt tokens, "
          f"{wl.requested_output_tokens:,} output tokens; pagedkv model {label}; "
          f"{llm.kv_cache_sizing.describe()}; start-up {record['startup_s']:.1f} s", flush=True)
    if args.repeat < 1:
        raise SystemExit("--repeat must be >= 1")
    if args.step_times:
        _record_step_times(llm, record)
    res = run_throughput(llm, wl, temperature=args.temperature, use_tqdm=args.progress)
    record["pagedkv"] = res.as_dict()
    record["pagedkv_kv"] = llm.get_kv_stats()
    print(result_table(res, f"pagedkv ({label})"), flush=True)
    rows.append(("pagedkv", f"{res.output_tokens_per_s:,.0f} tok/s ({res.output_tokens:,} tokens, "
                            f"{res.elapsed_s:.1f} s)"))
    if args.repeat > 1:
        rates = [res.output_tokens_per_s]
        for _ in range(args.repeat - 1):
            rates.append(run_throughput(llm, wl, temperature=args.temperature).output_tokens_per_s)
        record["pagedkv_repeats_tok_s"] = rates
        record["pagedkv_median_tok_s"] = statistics.median(rates)
        rows.append((f"pagedkv, median of {len(rates)} runs",
                     f"{statistics.median(rates):,.0f} tok/s ({', '.join(f'{r:,.0f}' for r in rates)})"))
    del llm
    torch.cuda.empty_cache() if torch.cuda.is_available() else None

    if args.with_hf or args.hf_static:
        try:
            model = hf_model(args)
        except Exception as e:  # record why the reference could not run, keep our numbers
            record["hf_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            model = None
        if model is not None and args.with_hf:
            try:
                prompts = [p[: args.max_model_len - args.hf_max_new_tokens] for p in wl.prompts]
                hf = run_hf_generate_batch(model, prompts, args.hf_max_new_tokens)
                record["hf_generate_batch"] = hf
                rows.append((f"transformers generate_batch (-> {args.hf_max_new_tokens})",
                             f"{hf['output_tokens_per_s']:,.0f} tok/s ({hf['output_tokens']:,} tokens)"))
            except Exception as e:
                record["hf_generate_batch_error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        if model is not None and args.hf_static:
            try:
                hf = run_hf_static(model, args.hf_static_batch, new_tokens=args.hf_max_new_tokens)
                record["hf_static"] = hf
                rows.append((f"transformers generate static {args.hf_static_batch}x512->"
                             f"{args.hf_max_new_tokens}",
                             f"{hf['output_tokens_per_s']:,.0f} tok/s"))
            except Exception as e:
                record["hf_static_error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()

    if args.json:
        write_json(args.json, record)
    print(format_table(rows, f"\n{wl.name} output throughput"))
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
