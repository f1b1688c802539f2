"""``pagedkv.tools.sm90_report``: the occupancy arithmetic by hand, and one real compile."""

import json
import os
import subprocess
import sys

import pytest
import triton

from pagedkv.tools.sm90_report import programs_per_sm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_programs_per_sm_by_hand():
    # the prefill default: 224 x 32 x 4 = 28,672 registers (2 by registers); 114,688 + 1,024
    # bytes of shared memory (233,472 // 115,712 = 2)
    assert programs_per_sm(224, 4, 114688) == 2
    # the decode default: 96 x 128 = 12,288 registers (5); 38,144 + 1,024 shared (5)
    assert programs_per_sm(96, 4, 38144) == 5
    # registers round up to 8 a thread: 110 -> 112, 65,536 // 14,336 = 4
    assert programs_per_sm(110, 4, 21632) == 4
    assert programs_per_sm(104, 4, 21632) == 4 and programs_per_sm(102, 4, 21632) == 4
    assert programs_per_sm(96, 4, 21632) == 5
    # shared memory: 147,456 + 1,024 leaves room for one
    assert programs_per_sm(128, 4, 147456) == 1
    # warps: 16-warp programs, 64 warps an SM; tiny programs stop at 32
    assert programs_per_sm(32, 16, 0) == 4
    assert programs_per_sm(16, 1, 0) == 32
    assert programs_per_sm(255, 8, 233472) == 0


@pytest.mark.skipif(not triton.__version__.startswith("3.6."),
                    reason="the numbers checked are Triton 3.6's compiler's")
def test_decode_report_cli_under_the_interpreter_flag():
    """The command line runs with TRITON_INTERPRET set (as in this test session): it re-runs
    itself without it. The decode default's numbers (ncu on the H200 read the same register
    count for the prefill default: 224)."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "pagedkv.tools.sm90_report", "decode", "--json"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    # the default loop loads the block table a tile ahead (DecodeConfig.table_ahead) at 3 stages
    assert got["num_stages"] == 3 and got["num_warps"] == 4 and got["loops"] == 1
    assert got["local"] == 0 and got["programs_per_sm"] == 5, got


@pytest.mark.skipif(not triton.__version__.startswith("3.6."),
                    reason="the numbers checked are Triton 3.6's compiler's")
def test_flat_decode_kernel_fits_the_wave_it_launches(compiled_run):
    """The flat split launches ``DecodeConfig.flat_programs_per_sm`` programs an SM: the
    default kernel must fit that many without spilling, its tile loop still
    software-pipelined; capped at 96 registers (``flat_max_registers``) 5 fit, unspilled."""
    from pagedkv.attention.triton_decode import DecodeConfig

    got = {cap: json.loads(compiled_run("-m", "pagedkv.tools.sm90_report", "decode-flat",
                                        "--maxnreg", cap, "--json"))
           for cap in ("0", "96")}
    plain, capped = got["0"], got["96"]
    assert DecodeConfig().flat_max_registers is None
    assert plain["programs_per_sm"] >= DecodeConfig().flat_programs_per_sm, plain
    for rep in (plain, capped):  # the table-ahead loop: one tile's K and V copies in flight
        assert rep["local"] == 0 and rep["loops"] == 1 and rep["waits"] == [2, 0], rep
    assert capped["regs"] <= 96 and capped["programs_per_sm"] == 5, capped


@pytest.mark.skipif(not triton.__version__.startswith("3.6."),
                    reason="the numbers checked are Triton 3.6's compiler's")
def test_fused_reduce_decode_kernels_keep_their_footprint(compiled_run):
    """The split kernel that merges its own ranges (``DecodeConfig.fused_reduce``) compiles
    for sm_90 with the plain one's shared memory and at least its programs an SM (the
    balanced rule counts 5), unspilled, its tile loop pipelined as the plain one's, with the
    block table a tile ahead (the default) and without; its counter is one global atomic with
    an acquire (the L1 invalidated: CCTL) and the merge's partial loads bypass the L1
    (``.STRONG.GPU``)."""
    for ahead in ([], ["--no-table-ahead"]):
        plain, fused = (json.loads(compiled_run("-m", "pagedkv.tools.sm90_report", "decode",
                                                *ahead, *extra, "--json", "--sass"))
                        for extra in ([], ["--fused-reduce"]))
        for key in ("shared", "local", "loops", "waits"):
            assert fused[key] == plain[key], (key, plain, fused)
        assert fused["programs_per_sm"] >= plain["programs_per_sm"] >= 5, (plain, fused)
        assert fused["local"] == 0 and fused["loops"] == 1
        ops = fused["sass_ops"]
        assert ops.get("ATOMG", 0) == 1 and ops.get("CCTL", 0) >= 1, ops
        assert "ATOMG" not in plain["sass_ops"]
        assert any("STRONG.GPU" in k for k in fused["sass_loads"]), fused["sass_loads"]
    # the flat split's kernel with it: capped (DecodeConfig.flat_registers) to the 4 programs
    # an SM its one wave launches, unspilled, still one pipelined loop
    flat = json.loads(compiled_run("-m", "pagedkv.tools.sm90_report", "decode-flat",
                                   "--fused-reduce", "--json", "--sass"))
    assert flat["regs"] <= 128 and flat["programs_per_sm"] >= 4, flat
    assert flat["local"] == 0 and flat["loops"] == 1 and flat["waits"] == [2, 0], flat
    assert flat["sass_ops"].get("ATOMG", 0) == 1, flat["sass_ops"]


def test_report_refuses_an_interpreted_kernel():
    """This test session interprets kernels (conftest): compiling one is a clear error."""
    from pagedkv.attention.triton_decode import _decode_kernel
    from pagedkv.tools.sm90_report import report

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernels are compiled in this session")
    with pytest.raises(TypeError, match="interpreted"):
        report(_decode_kernel, {}, {}, set(), set(), 4, 3)


@pytest.mark.skipif(not triton.__version__.startswith("3.6."),
                    reason="the numbers checked are Triton 3.6's compiler's")
def test_fused_qkv_projection_compiles_for_sm90_unspilled(compiled_run):
    """The fused QKV projection (``pagedkv.kernels.qkv_rope_cache``) as the launcher issues it
    at 1-16 / 17-64 / 65-256 rows (block_m 16 / 32-64 / 64 with 4 / 2 / 1 splits), bf16 and FP8
    caches, with the input norm applied on the fly (the decode chain): it compiles for sm_90 without spills and its inner-dimension loop keeps copies in
    flight (the first async wait leaves more than zero groups pending)."""
    for cfg, extra in (("16,64,4,4,4", ()), ("32,64,4,4,2", ()), ("64,64,4,4,1", ()),
                       ("64,64,4,4,2", ("--fp8",)), ("16,64,4,4,4", ("--ln",)),
                       ("64,64,4,4,1", ("--ln",))):
        got = json.loads(compiled_run("-m", "pagedkv.tools.sm90_report", "qkv-rope", cfg,
                                      *extra, "--json"))
        assert got["local"] == 0 and got["loops"] == 1, (cfg, got)
        assert got["waits"] and got["waits"][0] > 0 and got["programs_per_sm"] >= 2, (cfg, got)


@pytest.mark.skipif(not triton.__version__.startswith("3.6."),
                    reason="the numbers checked are Triton 3.6's compiler's")
def test_fused_gate_up_and_residual_compile_for_sm90_unspilled(compiled_run):
    """The gate/up projection with SiLU in its epilogue (``pagedkv.kernels.gate_up_silu``) as
    the launcher issues it (block_m 16 with 2 splits, 64 with 1): no spills, a pipelined
    inner-dimension loop."""
    for cfg in ("16,32,64,4,4,2", "64,32,64,4,4,1"):
        got = json.loads(compiled_run("-m", "pagedkv.tools.sm90_report", "gate-up", cfg,
                                      "--json"))
        assert got["local"] == 0 and got["loops"] == 1, (cfg, got)
        assert got["waits"] and got["waits"][0] > 0 and got["programs_per_sm"] >= 2, (cfg, got)
