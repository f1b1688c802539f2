"""The prefill kernel's K/V copies are software-pipelined two tiles ahead (no GPU needed).

Triton's pipeliner gives each load a latency of ``(num_stages - 1) / (indirection + 1)``
iterations. With the block-table load inside the key tile (the K/V addresses depending on a
load of the same iteration) the K/V copies got one tile: every iteration began by waiting for
all outstanding copies (``ttg.async_wait {num = 0}``) and paid the memory latency. The kernel
now loads the next tile's table entries one iteration ahead (``_tile_blocks``), and at the
default 3 stages the loop waits with ``num = 2``: the copies of the next tile (K and V: two
groups) stay in flight while this one is computed. H200 (BENCHMARKS.md, ninth session): 8 x
2048 causal 512 -> 487 us, the cascade prefix 20.7 -> 19.4 us.

This compiles the kernel for sm_90 on the CPU (Triton's bundled ptxas, no device) in a
subprocess without ``TRITON_INTERPRET`` (the test session interprets kernels) and reads the
TTGIR. It checks the compiler of the Triton version the H200 runs (3.6); other versions may
schedule differently and are skipped."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(
    not triton.__version__.startswith("3.6."),
    reason="the pipelining checked here is Triton 3.6's (the version on the H200)")

_SCRIPT = textwrap.dedent("""
    import json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from pagedkv.attention.triton_prefill import PrefillConfig, _prefill_kernel

    causal = sys.argv[1] == "causal"
    cfg = PrefillConfig()
    const = dict(HAS_WINDOW=False, SOFTCAP=0.0, HAS_SINKS=False, GROUP=2, HEAD_DIM=128,
                 D_PAD=128, BLOCK_SIZE=16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                 DOT_PREC="tf32", RANGE_LOOP=True, CAUSAL=causal, WRITE_LSE=not causal,
                 KV_FP8=False, Q_FP16=False, PACK=cfg.pack_heads)
    ptrs = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", bt_ptr="*i32", qsl_ptr="*i32",
                seq_ptr="*i32", out_ptr="*bf16" if causal else "*fp32", sinks_ptr="*bf16",
                lse_ptr="*fp32")
    names = _prefill_kernel.arg_names
    sig = {n: "constexpr" if n in const else ptrs.get(
        n, "fp32" if n in ("scale_log2", "v_scale") else "i32") for n in names}
    aligned = {"q_s0", "q_s1", "c_sb", "c_st", "c_sh", "o_s0", "o_s1", "bt_s0", "lse_s0",
               "o_split", "lse_split"} | set(ptrs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
    k = triton.compile(ASTSource(fn=_prefill_kernel, signature=sig, constexprs=const,
                                 attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ttgir = k.asm["ttgir"]
    waits = [int(m) for m in re.findall(r"ttg.async_wait[^\\n]*num = (\\d+)", ttgir)]
    print(json.dumps({"waits": waits, "shared": k.metadata.shared,
                      "stages": cfg.num_stages, "loops": ttgir.count("scf.for")}))
""")


def _compile(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True,
                         env=env, timeout=600)
    if res.returncode != 0:
        if "ptxas" in res.stderr and "not found" in res.stderr.lower():
            pytest.skip("no ptxas in this Triton install")
        raise AssertionError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["causal", "prefix"])
def test_prefill_kv_copies_two_tiles_ahead(mode):
    """Both loops (unmasked tiles, then the masked diagonal / sequence end) wait for all but
    the next tile's two copy groups; the shared memory (query tile + 3 K/V buffers) leaves
    room for two programs on an H200 multiprocessor (228 KB, 1 KB reserved per program)."""
    got = _compile(mode)
    assert got["stages"] == 3 and got["loops"] == 2
    # per loop: the in-loop wait, then the drain after it
    assert got["waits"] == [2, 0, 2, 0], got
    assert 2 * (got["shared"] + 1024) <= 228 * 1024, got
