"""The prefill kernel's K/V copies are software-pipelined two tiles ahead, and the decode loop's
with ``DecodeConfig.table_ahead`` ``stages - 2`` tiles ahead (no GPU needed).

Triton's pipeliner gives each load a latency of ``(num_stages - 1) / (indirection + 1)``
iterations. With the block-table load inside the key tile (the K/V addresses depending on a
load of the same iteration) the K/V copies got one tile: every iteration began by waiting for
all outstanding copies (``ttg.async_wait {num = 0}``) and paid the memory latency. The kernel
now loads the next tile's table entries one iteration ahead (``_tile_blocks``), and at the
default 3 stages the loop waits with ``num = 2``: the copies of the next tile (K and V: two
groups) stay in flight while this one is computed. H200 (BENCHMARKS.md, ninth session): 8 x
2048 causal 512 -> 487 us, the cascade prefix 20.7 -> 19.4 us.

This compiles the kernel for sm_90 on the CPU (``pagedkv.tools.sm90_report``: Triton's
bundled ptxas, no device) in a subprocess without ``TRITON_INTERPRET`` (the test session
interprets kernels) and reads the TTGIR. It checks the compiler of the Triton version the H200 runs (3.6); other versions may
schedule differently and are skipped."""

import json
import os
import subprocess
import sys

import pytest
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(
    not triton.__version__.startswith("3.6."),
    reason="the pipelining checked here is Triton 3.6's (the version on the H200)")

def _compile(mode: str, kernel: str = "prefill", *extra: str) -> dict:
    """``pagedkv.tools.sm90_report`` of ``kernel`` (default: the default ``PrefillConfig``;
    ``extra``: more arguments) in a fresh process: it clears ``TRITON_INTERPRET``."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [kernel, *extra, "--json", "--sass"] + (["--prefix"] if mode == "prefix" else [])
    res = subprocess.run([sys.executable, "-m", "pagedkv.tools.sm90_report", *args],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["causal", "prefix"])
def test_prefill_kv_copies_two_tiles_ahead(mode):
    """Both loops (unmasked tiles, then the masked diagonal / sequence end) wait for all but
    the next tile's two copy groups; the shared memory (query tile + 3 K/V buffers) leaves
    room for two programs on an H200 multiprocessor (228 KB, 1 KB reserved per program); the
    products are Hopper's warpgroup MMAs (HGMMA) fed by asynchronous copies (LDGSTS)."""
    got = _compile(mode)
    assert got["num_stages"] == 3 and got["loops"] == 2
    # per loop: the in-loop wait, then the drain after it
    assert got["waits"] == [2, 0, 2, 0], got
    assert 2 * (got["shared"] + 1024) <= 228 * 1024, got
    assert got["programs_per_sm"] == 2 and got["local"] == 0, got
    ops = got["sass_ops"]
    assert ops.get("HGMMA", 0) > 0 and ops.get("LDGSTS", 0) > 0 and ops.get("HMMA", 0) == 0, ops


@pytest.mark.parametrize("stages,waits,shared_kb,per_sm",
                         [(3, [2, 0], 37, 5), (7, [10, 0], 101, 2)])
def test_decode_table_ahead_copies_ahead(stages, waits, shared_kb, per_sm):
    """The decode loop with ``DecodeConfig.table_ahead`` (the same :func:`_tile_blocks`): its
    in-loop wait leaves ``2 x (stages - 2)`` copy groups (K and V of ``stages - 2`` tiles) in
    flight, where the default loop (table entries loaded in the tile) waits down to 3 at 5
    stages; shared memory and programs an SM as BENCHMARKS.md's thirty-first session lists."""
    got = _compile("causal", "decode", f"32,4,{stages}", "--table-ahead")
    assert got["num_stages"] == stages and got["loops"] == 1, got
    assert got["waits"] == waits, got
    assert got["shared"] // 1024 == shared_kb and got["programs_per_sm"] == per_sm, got
    assert got["local"] == 0 and got["sass_ops"].get("LDGSTS", 0) > 0, got
    plain = _compile("causal", "decode", "--no-table-ahead")
    assert plain["num_stages"] == 5 and plain["waits"] == [1, 3, 3, 0], plain


def test_decode_default_loads_the_table_ahead():
    """The default decode loop (``DecodeConfig.table_ahead`` on since the thirty-sixth
    session) is the table-ahead loop at 3 stages: one tile's K and V copies in flight, 37 KB,
    5 programs an SM (what the balanced one-wave rule counts)."""
    got = _compile("causal", "decode")
    assert got["num_stages"] == 3 and got["waits"] == [2, 0], got
    assert got["shared"] // 1024 == 37 and got["programs_per_sm"] == 5 and got["local"] == 0, got


def test_decode_flat_table_ahead_copies_ahead():
    """The flat kernel with ``table_ahead`` at its default 3 stages: one tile's K and V in
    flight during the loop (wait 2), the plain flat loop's 38 KB, 128 registers, 4 programs an
    SM (its default wave)."""
    got = _compile("causal", "decode-flat", "--table-ahead")
    assert got["num_stages"] == 3 and got["waits"] == [2, 0], got
    assert got["shared"] // 1024 == 37 and got["programs_per_sm"] == 4 and got["local"] == 0, got


@pytest.mark.parametrize("chunk,ahead,regs,per_sm", [
    (8, True, 80, 6), (16, True, 93, 5), (32, True, 158, 3),
    (8, False, 96, 5), (16, False, 96, 5), (32, False, 158, 3)])
def test_decode_fused_merge_chunk_footprint(chunk, ahead, regs, per_sm):
    """The per-request split kernel with its own merge (the default for one-wave launches) at
    ``DecodeConfig.merge_chunk`` 8 / 16 / 32, with the block table a tile ahead (the default)
    and without: up to 16 ranges a round trip keep at least the 5 programs an SM the one-wave
    bound counts, 32 take 158 registers and 3 an SM."""
    got = _compile("causal", "decode", "--fused-reduce", "--merge-chunk", str(chunk),
                   "--table-ahead" if ahead else "--no-table-ahead")
    assert got["regs"] == regs and got["programs_per_sm"] == per_sm and got["local"] == 0, got
    # the main loop's pipelining unchanged by the merge
    assert got["waits"] == ([2, 0] if ahead else [1, 3, 3, 0]), got
