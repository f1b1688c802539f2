"""What a Triton kernel becomes on a Hopper GPU, found without one: compile for sm_90 on the CPU.

``triton.compile`` with ``GPUTarget("cuda", 90, 32)`` runs the whole NVIDIA pipeline (TTIR,
TTGIR with its software pipelining, PTX, and Triton's bundled ``ptxas`` to a cubin) on any
machine; Triton's bundled ``cuobjdump`` then reads the registers and local memory (spills)
from the cubin. :func:`report` returns, for one launch configuration:

* ``shared`` (bytes of shared memory a program), ``regs`` (registers a thread), ``local``
  (bytes of local memory a thread: spills);
* ``waits``: the ``num`` of every ``ttg.async_wait`` in the TTGIR, in order. In a pipelined
  loop, ``num = k`` lets ``k`` copy groups stay in flight while the iteration computes; ``0``
  inside a loop means every iteration waits for its own copies (the prefill kernel's state
  before the ninth session: BENCHMARKS.md);
* ``loops``: the ``scf.for`` loops; ``programs_per_sm``: how many programs fit on one H200 /
  H100 multiprocessor by registers (65,536; a thread's count rounded up to 8), shared memory
  (233,472 bytes, 1,024 reserved per program), warps (64) and the 32-program limit;
* with ``sass``: ``sass_ops``, the static count of each SASS opcode (``HGMMA``: Hopper's
  warpgroup tensor-core products; ``LDGSTS``: asynchronous global-to-shared copies; ``IMAD`` /
  ``IADD3`` / ``SHF``: integer work, mostly addresses), and ``sass_loads``, the global loads
  with their widths (``LDG.E.128``: 16-byte vector loads).

Presets for this project's attention kernels on Qwen3-0.6B's attention (bf16, 16 query / 8 K/V
heads, head_dim 128, block 16): :func:`prefill_report` (``PrefillConfig``; causal prefill or
the cascade prefix's non-causal launch with log-sum-exps) and :func:`decode_report`
(``DecodeConfig``); :func:`argmax_report` (the greedy argmax's kernels), :func:`lm_head_argmax_report` (the fused LM head + argmax). The kernel modules must be imported without ``TRITON_INTERPRET`` (the
interpreter replaces the kernels with Python functions): the command line clears it and runs
itself in a fresh process when it is set::

    python -m pagedkv.tools.sm90_report prefill 64,64,4,3,1 [--prefix] [--sass] [--json]
    python -m pagedkv.tools.sm90_report decode 32,4,5
    python -m pagedkv.tools.sm90_report argmax
    python -m pagedkv.tools.sm90_report lm-head-argmax 128,128,64,8,3
    python -m pagedkv.tools.sm90_report splitk
    python -m pagedkv.tools.sm90_report qkv-rope 64,64,4,4,2 [--fp8] [--ln]
    python -m pagedkv.tools.sm90_report gate-up 64,32,64,4,4,1 [--ln]
    python -m pagedkv.tools.sm90_report splitk-residual 64,64,64,4,5,4

The numbers are the compiler's, not the device's: what runs faster is measured on the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

REGS_PER_SM = 65536
SHARED_PER_SM = 233472
SHARED_RESERVED = 1024
WARPS_PER_SM = 64
PROGRAMS_PER_SM = 32

# the attention shape of the presets (Qwen3-0.6B)
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16


def programs_per_sm(regs: int, num_warps: int, shared: int) -> int:
    """Programs of ``num_warps`` warps, ``regs`` registers a thread and ``shared`` bytes of
    shared memory that fit on one Hopper multiprocessor at once."""
    per_thread = -(-max(regs, 1) // 8) * 8
    by_regs = REGS_PER_SM // (per_thread * 32 * num_warps)
    by_shared = SHARED_PER_SM // (shared + SHARED_RESERVED)
    by_warps = WARPS_PER_SM // num_warps
    return max(0, min(by_regs, by_shared, by_warps, PROGRAMS_PER_SM))


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def sass_loads(cubin: bytes) -> dict:
    """Static count of each global load instruction with its modifiers (``LDG.E.128``: a
    16-byte vector load; ``LDG.E.U16``: one 2-byte value) in ``cubin``."""
    loads: dict = {}
    for m in re.finditer(r"\b(LDG(?:\.[A-Z0-9_]+)*)\s", _sass(cubin)):
        loads[m.group(1)] = loads.get(m.group(1), 0) + 1
    return loads


def sass_ops(cubin: bytes) -> dict:
    """Static count of each SASS opcode (``IMAD``, ``HGMMA``, ``LDGSTS``, ... without their
    modifiers) in ``cubin``, most frequent first."""
    sass = _sass(cubin)
    ops: dict = {}
    for m in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass,
                         re.MULTILINE):
        ops[m.group(1)] = ops.get(m.group(1), 0) + 1
    return dict(sorted(ops.items(), key=lambda kv: -kv[1]))


def report(kernel, constexprs: dict, pointers: dict, floats: set, aligned: set,
           num_warps: int, num_stages: int, sass: bool = False, maxnreg: int | None = None) -> dict:
    """Compile ``kernel`` (a ``triton.jit`` function, not interpreted) for sm_90. ``constexprs``:
    the constexpr arguments; ``pointers``: argument -> Triton pointer type (``"*bf16"``);
    ``floats``: fp32 arguments; every other argument is an i32; ``aligned``: arguments the
    launcher would specialize as 16-divisible (pointers, strides that are). ``sass``: also
    ``sass_ops``, the static opcode counts (:func:`sass_ops`); ``maxnreg``: the register cap
    Triton's launch option of that name sets."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):
        raise TypeError("report: the kernel is interpreted (TRITON_INTERPRET is set); run "
                        "`python -m pagedkv.tools.sm90_report`, which clears it")
    names = kernel.arg_names
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n in floats else "i32")
           for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
    k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=dict(constexprs),
                                 attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "num_stages": num_stages,
                                **({} if maxnreg is None else {"maxnreg": maxnreg})})
    ttgir = k.asm["ttgir"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    shared = int(k.metadata.shared)
    rep = {
        "shared": shared, "regs": regs, "local": local,
        "waits": [int(m) for m in re.findall(r"ttg\.async_wait[^\n]*\{num = (\d+)", ttgir)],
        "loops": ttgir.count("scf.for"),
        "num_warps": num_warps, "num_stages": num_stages,
        "programs_per_sm": programs_per_sm(regs, num_warps, shared),
        # programmatic dependent launch (pagedkv.kernels.pdl): the grid-dependency waits and
        # launch signals in the PTX, and the ordinal of the first global load / store after
        # the first wait (-1: no wait)
        "gdc_wait": k.asm["ptx"].count("griddepcontrol.wait"),
        "gdc_launch": k.asm["ptx"].count("griddepcontrol.launch_dependents"),
        "global_before_wait": _global_before_wait(k.asm["ptx"]),
        # L2 prefetches before that wait (the fused decode chain's weight prefetch)
        "prefetch_before_wait": _prefetch_before_wait(k.asm["ptx"]),
    }
    if sass:
        rep["sass_ops"] = sass_ops(k.asm["cubin"])
        rep["sass_loads"] = sass_loads(k.asm["cubin"])
    return rep


def _global_before_wait(ptx: str) -> int:
    """Global-memory instructions (loads, stores, async copies, atomics) in the PTX text
    before its first ``griddepcontrol.wait`` (all of them when there is none): 0 for a kernel
    that touches no global memory before its PDL wait."""
    cut = ptx.find("griddepcontrol.wait")
    head = ptx if cut < 0 else ptx[:cut]
    return len(re.findall(r"\b(?:ld|st|cp\.async|atom|red)\.(?:global|[a-z.]*global)", head))


def _prefetch_before_wait(ptx: str) -> int:
    """``prefetch.global.L2`` instructions in the PTX text before its first
    ``griddepcontrol.wait`` (0 without a wait)."""
    cut = ptx.find("griddepcontrol.wait")
    return 0 if cut < 0 else ptx[:cut].count("prefetch.global.L2")


def _chain_pdl(pdl: bool, span: int) -> dict:
    """The PDL constexprs of a fused decode-chain kernel (``pdl.pdl_chain_args``, bf16)."""
    from pagedkv.kernels.pdl import prefetch_lines

    if not pdl:
        return {"PDL": 0}
    lines, per_line = prefetch_lines(span, 2)
    return {"PDL": 1, "PF_LINES": lines, "PF_EPL": per_line}


def prefill_report(config, causal: bool = True, sass: bool = False, off32: bool = True,
                   pdl: bool = False) -> dict:
    """``_prefill_kernel`` under ``config`` (a ``PrefillConfig``): causal prefill, or with
    ``causal=False`` the cascade prefix's launch (float32 output, log-sum-exps); ``off32``:
    32-bit K / V offsets (every cache of up to 2^31 elements a half); ``pdl``: the variant
    launched with programmatic dependent launch."""
    from pagedkv.attention.triton_prefill import _prefill_kernel

    const = dict(HAS_WINDOW=False, SOFTCAP=0.0, HAS_SINKS=False, GROUP=HEADS // KV_HEADS,
                 HEAD_DIM=HEAD_DIM, D_PAD=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE,
                 BLOCK_M=config.block_m, BLOCK_N=config.block_n, DOT_PREC="tf32",
                 RANGE_LOOP=True, CAUSAL=causal, WRITE_LSE=not causal, KV_FP8=False,
                 Q_FP16=False, PACK=config.heads_per_program(HEADS // KV_HEADS),
                 OFF32=off32, PDL=int(pdl))
    ptrs = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", bt_ptr="*i32", qsl_ptr="*i32",
                seq_ptr="*i32", out_ptr="*bf16" if causal else "*fp32", sinks_ptr="*bf16",
                lse_ptr="*fp32")
    aligned = set(ptrs) | {"q_s0", "q_s1", "c_sb", "c_st", "c_sh", "o_s0", "o_s1", "bt_s0",
                           "lse_s0", "o_split", "lse_split"}
    return report(_prefill_kernel, const, ptrs, {"scale_log2", "v_scale"}, aligned,
                  config.num_warps, config.num_stages, sass)


def decode_report(config, sass: bool = False, pdl: bool = False, flat: bool = False,
                  fused_reduce: bool = False, prologue: bool = False) -> dict:
    """``_decode_kernel`` under ``config`` (a ``DecodeConfig``'s tile, warps and stages);
    ``pdl``: the variant launched with programmatic dependent launch; ``flat``: the flat
    split's ``_decode_flat_kernel`` (``DecodeConfig.flat_split``) instead; ``fused_reduce``:
    the split kernel that merges its own ranges (``DecodeConfig.fused_reduce``);
    ``prologue``: with the fused q/k norm + RoPE + K/V write (``QKPrologue``, Qwen3's norms,
    float32 RoPE tables)."""
    from pagedkv.attention.triton_decode import _decode_flat_kernel, _decode_kernel

    group = HEADS // KV_HEADS
    const = dict(SOFTCAP=0.0, HAS_SINKS=False, NUM_HEADS=HEADS, GROUP=group,
                 GROUP_PAD=max(16, group), HEAD_DIM=HEAD_DIM, D_PAD=HEAD_DIM,
                 BLOCK_SIZE=BLOCK_SIZE, TILE_N=config.tile_n, DOT_PREC="tf32",
                 RANGE_LOOP=True, WRITE_LSE=False, KV_FP8=False, Q_FP16=False, PDL=int(pdl))
    ptrs = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", bt_ptr="*i32", qsl_ptr="*i32",
                seq_ptr="*i32", out_ptr="*bf16", m_ptr="*fp32", l_ptr="*fp32",
                acc_ptr="*fp32", sinks_ptr="*bf16", lse_ptr="*fp32")
    const.update(FUSED_REDUCE=fused_reduce, GROUP_P2=group, SPLIT_CHUNK=config.merge_chunk,
                 TABLE_AHEAD=config.table_ahead)
    ptrs["cnt_ptr"] = "*i32"
    const.update(QK_PROLOGUE=prologue, QK_NORM=prologue)
    if prologue:
        ptrs.update(cos_ptr="*fp32", sin_ptr="*fp32", qw_ptr="*bf16", kw_ptr="*bf16",
                    slot_ptr="*i64")
    if flat:
        kernel = _decode_flat_kernel
        const["REQ_CHUNK"] = 256
    else:
        kernel = _decode_kernel
        const["ORDERED"] = False  # the default launch (DecodeConfig.use_order off)
        ptrs["order_ptr"] = "*i32"
    aligned = set(ptrs) | {"q_s0", "q_s1", "c_sb", "c_st", "c_sh", "o_s0", "o_s1", "bt_s0",
                           "lse_s0"}
    return report(kernel, const, ptrs, {"scale_log2", "v_scale", "qk_eps"}, aligned,
                  config.num_warps, config.kernel_stages(), sass,
                  maxnreg=config.flat_registers(prologue) if flat else None)


def argmax_report(sass: bool = False) -> dict:
    """The greedy argmax's two kernels (``pagedkv.kernels.argmax``) on bf16 logits with the
    launcher's settings: the chunk kernel's report, the reduce kernel's under ``"reduce"``."""
    from pagedkv.kernels.argmax import _BLOCK, _argmax_chunks_kernel, _argmax_reduce_kernel

    rep = report(_argmax_chunks_kernel, dict(BLOCK=_BLOCK, RANGE_LOOP=True),
                 dict(x_ptr="*bf16", key_ptr="*i32", idx_ptr="*i32"), set(),
                 {"x_ptr", "key_ptr", "idx_ptr", "x_s0"}, 4, 3, sass)
    rep["reduce"] = report(_argmax_reduce_kernel, dict(BLOCK_C=16),
                           dict(key_ptr="*i32", idx_ptr="*i32", out_ptr="*i64"), set(),
                           {"key_ptr", "idx_ptr", "out_ptr"}, 1, 3, sass)
    return rep


def lm_head_argmax_report(config, sass: bool = False) -> dict:
    """The fused LM head + argmax kernel (``pagedkv.kernels.lm_head_argmax``) on bf16 inputs
    under ``config`` (an ``LMHeadArgmaxConfig``)."""
    from pagedkv.kernels.lm_head_argmax import _lm_head_argmax_kernel

    const = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                 EVEN_K=True, ROUND=1, DOT_PREC="tf32", RANGE_LOOP=True)
    ptrs = dict(h_ptr="*bf16", w_ptr="*bf16", key_ptr="*i32", idx_ptr="*i32")
    return report(_lm_head_argmax_kernel, const, ptrs, set(), set(ptrs) | {"h_s0", "w_s0", "K"},
                  config.num_warps, config.num_stages, sass)


def splitk_report(config, sass: bool = False) -> dict:
    """The split-K GEMM kernel (``pagedkv.kernels.splitk_gemm``) on bf16 operands under
    ``config`` (a ``SplitKConfig``)."""
    from pagedkv.kernels.splitk_gemm import _splitk_gemm_kernel

    const = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                 DOT_PREC="tf32", RANGE_LOOP=True)
    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*fp32")
    return report(_splitk_gemm_kernel, const, ptrs, set(),
                  set(ptrs) | {"x_s0", "w_s0", "o_split", "o_s0", "N", "K", "k_per_split"},
                  config.num_warps, config.num_stages, sass)


def qkv_rope_report(config, splits: int = 2, fp8: bool = False, sass: bool = False,
                    ln: bool = False, pdl: bool = False) -> dict:
    """The fused QKV projection (``pagedkv.kernels.qkv_rope_cache``) at the Qwen3-0.6B shape
    (hidden 1024, q/k norms, no bias) on bf16 inputs under ``config`` (a ``QKVRopeConfig``;
    its ``block_m`` as launched) with ``splits`` inner-dimension splits; ``fp8``: FP8 caches;
    ``ln``: the input RMSNorm applied on the fly (the fused decode chain)."""
    from pagedkv.kernels.qkv_rope_cache import _qkv_rope_cache_kernel
    from pagedkv.kernels._common import cdiv

    chunk = cdiv(cdiv(1024, splits), config.block_k) * config.block_k
    const = dict(K=1024, K_CHUNK=chunk, NUM_HEADS=HEADS, NUM_KV_HEADS=KV_HEADS,
                 HEAD_DIM=HEAD_DIM, HAS_NORM=True, HAS_BIAS=False, LN=ln, BLOCK_M=config.block_m,
                 BLOCK_K=config.block_k, SPLITS=splits, DOT_PREC="tf32", FP8=fp8,
                 **_chain_pdl(pdl, chunk))
    cache = "*fp8e4nv" if fp8 else "*bf16"
    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", q_ptr="*bf16", cos_ptr="*bf16",
                sin_ptr="*bf16", qw_ptr="*bf16", kw_ptr="*bf16", slot_ptr="*i64",
                kc_ptr=cache, vc_ptr=cache, part_ptr="*fp32", ss_ptr="*fp32", cnt_ptr="*i32",
                ln_ptr="*bf16")
    return report(_qkv_rope_cache_kernel, const, ptrs, {"eps", "k_scale", "v_scale", "ln_eps"},
                  set(ptrs) | {"x_s0", "w_s0", "q_s0", "q_s1", "kc_s0", "kc_s1", "kc_s2",
                               "vc_s0", "vc_s1", "vc_s2"},
                  config.num_warps, config.num_stages, sass)


def gate_up_report(config, splits: int = 1, sass: bool = False, ln: bool = False,
                   pdl: bool = False) -> dict:
    """The gate/up projection with SiLU in its epilogue (``pagedkv.kernels.gate_up_silu``) at
    the Qwen3-0.6B shape (I 3072, K 1024, no bias) on bf16 inputs under ``config`` (a
    ``GateUpConfig``; its ``block_m`` as launched) with ``splits`` inner-dimension splits;
    ``ln``: the post-attention RMSNorm applied on the fly."""
    from pagedkv.kernels.gate_up_silu import _gate_up_silu_kernel
    from pagedkv.kernels.paired_splitk import chunk_and_splits

    chunk, splits = chunk_and_splits(1024, splits, config.block_k)
    const = dict(I=3072, K=1024, K_CHUNK=chunk, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                 BLOCK_K=config.block_k, SPLITS=splits, HAS_BIAS=False, NORM=ln,
                 DOT_PREC="tf32", **_chain_pdl(pdl, chunk))
    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32",
                cnt_ptr="*i32", ln_ptr="*bf16", ss_ptr="*fp32")
    return report(_gate_up_silu_kernel, const, ptrs, {"eps"},
                  set(ptrs) | {"x_s0", "w_s0", "o_s0"},
                  config.num_warps, config.num_stages, sass)


def splitk_residual_report(config, splits: int = 4, sass: bool = False,
                           pdl: bool = False) -> dict:
    """The split-K projection with its residual add in the epilogue
    (``splitk_gemm._splitk_residual_kernel``) on bf16 operands under ``config`` (a
    ``SplitKConfig``) with ``splits`` splits."""
    from pagedkv.kernels.splitk_gemm import _splitk_residual_kernel

    from pagedkv.kernels.splitk_gemm import split_chunk

    const = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                 SPLITS=splits, HAS_BIAS=False, DOT_PREC="tf32", RANGE_LOOP=True,
                 **_chain_pdl(pdl, split_chunk(2048, splits, config.block_k)))
    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", h_ptr="*bf16", out_ptr="*bf16",
                part_ptr="*fp32", cnt_ptr="*i32")
    return report(_splitk_residual_kernel, const, ptrs, set(),
                  set(ptrs) | {"x_s0", "w_s0", "h_s0", "o_s0", "N", "K", "k_per_split"},
                  config.num_warps, config.num_stages, sass)


def _ints(text: str, n: int, what: str) -> list[int]:
    vals = [int(v) for v in text.split(",")]
    if len(vals) != n:
        raise SystemExit(f"{what}: expected {n} comma-separated ints, got {text!r}")
    return vals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kernel", choices=["prefill", "decode", "decode-flat", "argmax",
                                          "lm-head-argmax", "splitk", "qkv-rope",
                                          "gate-up", "splitk-residual"])
    p.add_argument("config", nargs="?", default=None,
                   help="prefill: BM,BN,WARPS,STAGES,PACK; decode: TILE,WARPS,STAGES; "
                        "lm-head-argmax, splitk: BM,BN,BK,WARPS,STAGES; "
                        "qkv-rope: BM,BK,WARPS,STAGES,SPLITS; "
                        "gate-up, splitk-residual: BM,BN,BK,WARPS,STAGES,SPLITS "
                        "(default: the CUDA defaults)")
    p.add_argument("--prefix", action="store_true",
                   help="prefill: the cascade prefix's non-causal launch")
    p.add_argument("--sass", action="store_true", help="also the static SASS opcode counts")
    p.add_argument("--pdl", action="store_true",
                   help="the programmatic-dependent-launch variant (pagedkv.kernels.pdl)")
    p.add_argument("--fused-reduce", action="store_true",
                   help="decode, decode-flat: the split kernel that merges its own ranges")
    p.add_argument("--table-ahead", action=argparse.BooleanOptionalAction, default=None,
                   help="decode, decode-flat: the block-table entries loaded a tile ahead "
                        "(DecodeConfig.table_ahead, the default) or in the tile "
                        "(--no-table-ahead); with a config, the plain loop unless "
                        "--table-ahead, and STAGES are the loop's stages either way")
    p.add_argument("--prologue", action="store_true",
                   help="decode, decode-flat: with the fused q/k norm + RoPE + K/V write "
                        "(QKPrologue)")
    p.add_argument("--merge-chunk", type=int, default=None,
                   help="decode, decode-flat: the ranges a merge loads at once "
                        "(DecodeConfig.merge_chunk; default 16, wide_merge_chunk 32)")
    p.add_argument("--maxnreg", type=int, default=None,
                   help="decode-flat: the register cap (0: none; default DecodeConfig's)")
    p.add_argument("--fp8", action="store_true", help="qkv-rope: FP8 caches")
    p.add_argument("--ln", action="store_true",
                   help="qkv-rope, gate-up: the input RMSNorm applied on the fly")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):  # the kernels must compile: a fresh process
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.run([sys.executable, "-m", "pagedkv.tools.sm90_report",
                               *(argv if argv is not None else sys.argv[1:])], env=env).returncode
    if args.kernel == "argmax":
        rep = argmax_report(sass=args.sass)
    elif args.kernel == "lm-head-argmax":
        from pagedkv.kernels.lm_head_argmax import LMHeadArgmaxConfig, config_for

        cfg = config_for(256)
        if args.config:
            bm, bn, bk, w, st = _ints(args.config, 5, "lm-head-argmax config")
            cfg = LMHeadArgmaxConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w,
                                     num_stages=st)
        rep = lm_head_argmax_report(cfg, sass=args.sass)
    elif args.kernel == "splitk":
        from pagedkv.kernels.splitk_gemm import SplitKConfig

        cfg = SplitKConfig()
        if args.config:
            cfg = SplitKConfig(*_ints(args.config, 5, "splitk config"))
        rep = splitk_report(cfg, sass=args.sass)
    elif args.kernel == "qkv-rope":
        from pagedkv.kernels.qkv_rope_cache import QKVRopeConfig

        cfg, splits = QKVRopeConfig(), 2
        if args.config:
            bm, bk, w, st, splits = _ints(args.config, 5, "qkv-rope config")
            cfg = QKVRopeConfig(block_m=bm, block_k=bk, num_warps=w, num_stages=st)
        rep = qkv_rope_report(cfg, splits=splits, fp8=args.fp8, sass=args.sass, ln=args.ln,
                              pdl=args.pdl)
    elif args.kernel == "gate-up":
        from pagedkv.kernels.gate_up_silu import GateUpConfig

        cfg, splits = GateUpConfig(), 1
        if args.config:
            bm, bn, bk, w, st, splits = _ints(args.config, 6, "gate-up config")
            cfg = GateUpConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st)
        rep = gate_up_report(cfg, splits=splits, sass=args.sass, ln=args.ln, pdl=args.pdl)
    elif args.kernel == "splitk-residual":
        from pagedkv.kernels.splitk_gemm import SplitKConfig

        cfg, splits = SplitKConfig(), 4
        if args.config:
            *vals, splits = _ints(args.config, 6, "splitk-residual config")
            cfg = SplitKConfig(*vals)
        rep = splitk_residual_report(cfg, splits=splits, sass=args.sass, pdl=args.pdl)
    elif args.kernel == "prefill":
        from pagedkv.attention.triton_prefill import PrefillConfig

        cfg = PrefillConfig()
        if args.config:
            bm, bn, w, st, pack = _ints(args.config, 5, "prefill config")
            cfg = PrefillConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st,
                                pack_heads=pack)
        rep = prefill_report(cfg, causal=not args.prefix, sass=args.sass, pdl=args.pdl)
    else:
        from pagedkv.attention.triton_decode import DecodeConfig

        cfg = DecodeConfig()
        if args.config:  # the plain loop at STAGES unless --table-ahead (then that loop's)
            tile, w, st = _ints(args.config, 3, "decode config")
            cfg = DecodeConfig(tile_n=tile, num_warps=w, num_stages=st,
                               table_ahead=bool(args.table_ahead), table_ahead_stages=st)
        elif args.table_ahead is not None:
            cfg = dataclasses.replace(cfg, table_ahead=args.table_ahead)
        if args.maxnreg is not None:
            cfg = dataclasses.replace(cfg, flat_max_registers=args.maxnreg or None)
        if args.fused_reduce:
            cfg = dataclasses.replace(cfg, fused_reduce=True)
        if args.merge_chunk is not None:
            cfg = dataclasses.replace(cfg, merge_chunk=args.merge_chunk)
        rep = decode_report(cfg, sass=args.sass, pdl=args.pdl, flat=args.kernel == "decode-flat",
                            fused_reduce=args.fused_reduce, prologue=args.prologue)
    if args.json:
        print(json.dumps(rep))
    else:
        print(" ".join(f"{k}={v}" for k, v in rep.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
