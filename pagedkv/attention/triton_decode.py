"""Paged decode attention (Triton): one query token per request, over the paged KV cache.

Layout (``backend.py`` conventions): ``q``/``out [T, H, D]``; ``kv_cache [2, num_blocks,
block_size, Hkv, D]``; request ``r``'s query row is ``query_start_loc[r]`` and it attends to its
``seq_lens[r]`` positions, position ``n`` at slot ``block_table[r, n // B] * B + n % B``.
Only requests with exactly one query token (``query_start_loc[r+1] - query_start_loc[r] == 1``)
are served; every other row of ``out`` is left untouched, so a mixed batch can hand its longer
requests to the prefill kernel. A decode request must have ``seq_lens[r] >= 1``.

Kernel (``_decode_kernel``), grid ``(num_reqs, Hkv, num_splits)``:
  * GQA-packed: program ``(r, h, s)`` serves the ``G = H // Hkv`` query heads that share KV head
    ``h`` as the rows of one ``[G_PAD, D]`` tile (``G_PAD >= 16`` for ``tl.dot``), so every K/V
    byte is read once per request.
  * It walks tiles of ``TILE_N`` positions: per position the block-table entry is gathered
    (``n // B``, any block size from 1 up, power of two or not; positions ``>= seq_len`` or
    columns past the table width are masked and never read), then ``S = Q K^T`` and
    ``acc += P V`` with ``tl.dot``, online softmax in base 2, all accumulation in fp32.
  * Split-KV: the context's tiles are dealt into ``num_splits`` contiguous ranges. The split
    count launched and the fewest positions per range are host values (``choose_split``: from
    batch x KV heads vs the device's multiprocessors, see ``DecodeConfig``); inside, a request
    uses only ``min(num_splits, ceil(tiles / min_split_tiles))`` ranges, so short contexts in a
    split launch do not pay for splitting. A request that ends up in one range writes its
    normalized output directly; otherwise each range stores its partial ``(max, sum, acc)`` in
    fp32 and ``_decode_reduce_kernel`` (grid ``(num_reqs, H / reduce_heads)``: each program
    merges ``DecodeConfig.reduce_heads`` query heads) merges them, loading
    ``DecodeConfig.merge_chunk`` (16) ranges per iteration at once (one compiled variant for
    every split count). Launches of one wave merge inside the split kernel instead (the last
    range of a request to arrive merges, after an atomic ticket:
    ``DecodeConfig.fused_reduce_programs_per_sm``; 32 ranges at once where few programs run:
    ``wide_merge_chunk``); past one wave that was measured slower (BENCHMARKS.md).

Attention sinks (``sinks [H]``, GPT-OSS): each query head's learned logit joins the softmax
denominator as ``exp(sink)`` once, where a request's output is normalized (the split kernel's
direct write or the reduce kernel; ``_sink_denominator``, which the prefill kernel shares).

Log-sum-exp output (``lse``, cascade attention): each served row's natural-log log-sum-exp
of its scores, ``ln 2 (m + log2 l)`` from the same running max and denominator the output is
normalized by (``_lse``), written where the output is (the direct write or the reduce kernel).

FP8 caches (``float8_e4m3fn``, ``KV_FP8``): the loaded K / V codes are cast to the query
dtype (exact: every e4m3 value is a bf16 / fp16 / fp32 value) and the products run in it; a
bf16 query is cast to fp16 instead (``Q_FP16``: e4m3 -> fp16 is one hardware convert per two
values, e4m3 -> bf16 several, and the per-position converts bound the FP8 kernel; fp16 keeps
3 more mantissa bits than bf16, and a query beyond fp16's range, 65504, is not a real one);
``k_scale`` joins the softmax scale on the host and ``v_scale`` multiplies the accumulated
output (the split partials too, so the reduce kernel is unchanged): the attention of
``k * k_scale`` and ``v * v_scale`` (``pagedkv.kernels.fp8_kv``).

CUDA graphs: the grid depends on host ints only (``num_reqs``, heads, the split count); lengths
are read on the device; ``num_reqs``, the split count and the split minimum are runtime
arguments, not specialized (one compiled variant of each kernel for every split choice: a
batch-size change in a running server compiles nothing new); the partial buffers are sized by
the launched split count (allocated per call from torch's caching allocator, which a graph
capture turns into fixed graph-pool memory). No host syncs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import triton
import triton.language as tl

from pagedkv.attention._triton_common import (
    LOG2E,
    attn_shape,
    check_attention_inputs,
    dot_precision,
    interpreted,
    num_sms,
)
from pagedkv.attention.torch_ref import paged_attention_ref
from pagedkv.errors import ConfigError
from pagedkv.kernels._common import arrive, cdiv, check_launch_config, next_pow2, use_triton
from pagedkv.kernels.fp8_kv import check_kv_scale, is_fp8_kv
from pagedkv.kernels.pdl import pdl_launch_args, pdl_prologue
from pagedkv.kernels.qk_norm_rope_cache import norm_rope_tile

MAX_SPLITS = 64
MAX_GRID_Z = 65535  # CUDA's limit on a grid's y and z extents


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel and its split-KV policy.

    ``tile_n``: KV positions per loop iteration (power of two >= 16); ``num_warps`` /
    ``num_stages``: as Triton's. Defaults from the H200 sweep (bench/bench_attention_gpu.py
    --sweep, bf16, 16/8 heads, head_dim 128): tile 32 x 4 warps x 5 stages was best or within 3%
    at every equal-length shape but B256/L8192 (tile 64 x 5 stages 3% faster there, 12% slower
    at B64/L2048).

    Split policy (``choose_split``), by the number of programs ``P = num_reqs x KV heads``
    against the device's ``S`` multiprocessors; a request is split into at most ``splits``
    contiguous ranges of at least ``min_split_tokens`` positions (shorter requests use fewer
    ranges, down to one: no partials, no reduce):

    * ``P < 2 S`` (few requests): ``splits = ceil(small_waves x S / P)`` (capped by
      ``max_splits``), ranges of at least ``small_min_split_tokens``; where ``P <=
      few_max_programs_per_sm x S`` and ``few_waves`` is set, ``ceil(few_waves x S / P)``
      instead (below);
    * ``2 S <= P < 4 S``: ``mid_splits`` ranges of at least ``mid_min_split_tokens``;
    * ``P >= 4 S``: ``large_splits`` ranges of at least ``large_min_split_tokens``.

    Balanced batches (the caller passes ``balanced=True``: the lengths' mean is at least
    ``balanced_fraction`` of their maximum and the one-range launch's excess over an even
    share is at most ``balanced_max_excess`` positions, :func:`lengths_balanced`): when
    ``balanced_min_programs_per_sm x S <= P <= wave_programs_per_sm x S`` (2 and 5) every
    request is one range. The ``P`` programs then
    fit one wave of concurrent programs (the default launch takes 96 registers x 128 threads and
    38 KB of shared memory per program: 5 per H200 SM) and, doing equal work, end together;
    every extra program instead turns a slot over mid-launch. Measured on the H200
    (bench/bench_decode_waves.py, equal lengths L2048): one range 95-97% of copy bandwidth at
    B48-B80 (16/8 heads) against 85-91% for the regime's split, 92-94% against 84-85% for
    lengths U[1536, 2048] and U[1792, 2048] at B64, a tie at U[1024, 2048] (mean 0.75 of the
    maximum), and splitting ahead by 8-13% at U[100, 2048]; past one wave (B88, B96) one
    range drops to 71-75%.

    ``balanced_max_excess`` (twentieth session): the one-range launch of ``P`` programs on
    ``S`` SMs lasts about as long as its busiest SM, ``ceil(P / S)`` programs of up to the
    longest length, while the flat split spreads the same positions evenly (``P / S`` programs'
    worth of the mean length an SM) at a ~10 us fixed cost. The excess ``ceil(P / S) x max -
    Hkv x sum / S`` (positions an SM) must be at most ``balanced_max_excess`` (None: the
    fraction alone decides). H200 (``bench_decode_mixed.py --variants frac_only,nobal``,
    lengths U[lo, hi] for lo/hi from 1280/2048 to 8000/8500, B40-B64 of 8 KV heads): one range
    against the flat split was ahead by 3.5-5% only at excess 543 and 746 (U[1792, 2048] at B48
    and B64), within 1% at 829 and 1,016, mixed from 1,200 to 2,000, and behind by 1-26% from
    ~2,100 up: the quantization of ``P / S`` (B40 is 2.4 programs an SM: one range 1.07-1.26x the flat
    split's time even on U[7680, 8192]) and long nearly equal lengths (W2's U[6000, 8500] at
    B64: 451.0 / 425.4 us) both count. Fit over those rows: one range ~14.3 ns a position of
    the busiest SM + 6.5 us, the flat split ~14.7 ns a position of the mean SM + 16.7 us, so
    the break-even excess is ~700; 1,024 keeps the wins and the ties. In positions, for the
    default bf16 launch: an FP8 cache moves half the bytes a position. W2 end to end
    (``bench_w1.py --workload w2``, against ``--decode-config balanced_max_excess=none``):
    3,743 / 3,674 and 3,769 / 3,667 output tok/s; W1 26,338 / 26,402 (within its spread).

    Measured on the H200 on batches of mixed lengths U[100, 2048] (bench/bench_decode_mixed.py,
    graph replays, cold L2): against the former policy (split counts for equal lengths, ranges
    of >= 32 positions) 3-18% faster at every batch size from 8 to 256; the regimes' values
    are the sweep's best or within 1% of it. ``min_split_tokens`` (when set) overrides every
    regime's minimum (sweeps, tests).

    ``use_order``: launch the programs request by request in the caller's ``order`` when
    one is given (the engine passes the requests longest first, :func:`longest_first_order`):
    the launch then ends on its shortest programs instead of on the last ranges of long
    requests. H200, mixed lengths U[100, 2048] (``bench/bench_decode_mixed.py --variants
    lpt``, us, ordered / request order): B32 46.6 / 51.6, B64 84.8 / 85.1, B128 148.4 /
    147.7, B153 171.1 / 170.1, B200 214.4 / 216.6, B256 272.2 / 277.1. On by default since
    the sixteenth session (with ``lpt_one_range``, which needs it; W1 below); the runner stages
    ``StepInputs.decode_order`` each step for a backend whose config has it on
    (``use_order=False``, ``bench_w1.py --no-decode-order``: it does not).

    ``flat_split``: split the batch's work evenly instead of each request separately
    (:func:`flat_programs`): the decode requests' tiles are laid end to end and cut into one
    equal share per program, ``flat_programs_per_sm x S`` programs over all KV heads, each
    share at least ``flat_min_split_tokens`` positions. A program walks its share request by
    request; a request it holds whole is written directly, the pieces of the others are merged
    by a reduce launch over every request (which also zeroes CUDA-graph padding rows). Every
    program then does the same work and the launch is one wave whatever the lengths; the grid
    depends on the device and the model only (one CUDA graph per batch size, no balanced
    variant of its own). It replaces the launches that would split: a launch of one range per
    request (balanced, longest first, or short contexts) stays as it is, and a forced
    ``num_splits`` takes the per-request launch. ``flat_max_registers``: a register cap per
    thread (Triton's ``maxnreg``; None: the compiler's choice, 128 at the default tile: 4
    programs an SM, the default wave; capped at 96, 5 fit with no spill, ``python -m
    pagedkv.tools.sm90_report decode-flat --maxnreg 96``). ``flat_min_programs_per_sm``: the
    flat split replaces only launches whose per-request grid has at least this many programs
    per multiprocessor before splitting (:func:`flat_launch`; 1.0: from 17 requests of 8 KV
    heads on an H200): small batches keep the per-request split, whose short ranges the
    flat shares (>= ``flat_min_split_tokens``) cannot match. H200, equal lengths, default
    flat / per-request, us: B1/L512 18.6 / 7.4, B1/L2048 18.8 / 11.1, B1/L8192 23.9 / 18.3,
    B8/L8192 73.5 / 79.9 (the one small batch the flat split won). With the floor (seventeenth
    session, default / per-request): B1-B16 within 0.5 us at L512 and L8192 and on lengths
    U[100, 2048]; B17 143.7 / 149.4 at L8192, 27.4 / 28.2 mixed, 22.6 / 18.5 at L512 (short
    equal lengths: the one loss), B32 26.6 / 28.1 at L512, 50.3 / 51.9 mixed.

    H200, mixed lengths U[100, 2048] (``bench/bench_decode_mixed.py --variants flat,flat_p4``,
    us; per-request launch / 5 an SM capped at 96 registers / 4 an SM uncapped, the default):
    B32 51.7 / 51.5 / 50.1, B64 85.1 / 84.2 / 84.7, B128 147.4 / 146.4 / 142.7, B153 169.6 /
    168.0 / 164.3, B256 276.6 / 276.5 / 269.2. Equal lengths L2048 (5 an SM): B64 141.1
    against the balanced one-wave launch's 129.7, B256 512.8 against 518.7; B1/L8192 21.8
    against 18.3 (these equal-length launches now keep their single range or per-request
    split: the balanced one-wave launch is not replaced, and ``bench_decode_mixed`` has not
    re-run them). W1 with every decode launch flat, alternating processes: 5 an SM 25,851 /
    25,236 against 25,315 / 25,663 off (one lease); 4 an SM **26,214 / 26,005 against 25,532
    / 25,557** (another lease). Equal work per program did not remove the mixed batches'
    excess: most of it is a fixed cost of ~10-19 us a call (the split partials and the reduce
    launch: the balanced one-wave launch without them is within 4 us of its bytes' time).
    On by default since the sixteenth session (W1 below).

    ``lpt_one_range`` (needs ``use_order``): one range per request, launched longest first,
    also past one wave, when the lengths allow it (:func:`lpt_fits`): the batch's positions
    per program slot of one wave (``sum x Hkv / (wave_programs_per_sm x S)``) are at least
    ``lpt_load_fraction`` of the longest request's, and where the programs fit one wave the
    busiest SM's excess is within ``balanced_max_excess`` (as for balanced batches; twentieth
    session). Longest-first dispatch then fills the
    slots about evenly (each slot takes the next longest request as it frees), and the launch
    writes no partials and needs no reduce. H200, lengths U[100, 2048], one range longest
    first against the default split (``bench_decode_mixed.py --variants lpt1``, us): B128
    139.8 / 147.0 (the bound's ratio 0.82), B153 154.4 / 169.6 (0.93: 98% of copy bandwidth),
    B256 256.5 / 277.2 (1.58: 100%). The decision is a host one from the step's lengths
    (:func:`one_range_for`), a CUDA-graph variant like ``balanced``.

    The defaults (sixteenth session): ``use_order``, ``flat_split`` and ``lpt_one_range`` on
    (nineteenth: ``fused_reduce_programs_per_sm`` 5, below; twentieth: ``balanced_max_excess``
    1,024, above).
    W1 on the H200, two rounds in one lease, output tok/s: per-request launches in request
    order 25,501 / 25,531; flat split 26,277 / 26,229; longest-first one range 25,930 /
    26,200; both 26,373 / 26,395. FP8 caches keep the per-request launch
    (:data:`FP8_DECODE_CONFIG`); the CPU interpreter runs the defaults on a wave of 8 programs
    (:data:`INTERPRET_DECODE_CONFIG`).

    ``reduce_heads``: query heads one program of the reduce kernel merges (a power of two; the
    merge is a latency-bound round trip per program, so fewer, wider programs finish sooner).
    H200, mixed lengths U[100, 2048] (``bench/bench_decode_mixed.py``, split kernel + reduce,
    us), 4 heads against 1: B64 94.7 / 96.1, B128 155.4 / 160.5, B200 229.0 / 234.1, B256
    290.4 / 298.6; W1 25,072 against 24,014 output tok/s (one lease, one run each).

    ``fused_reduce``: every split launch merges its own ranges, without the reduce launch:
    each range that stores partials counts itself in a per-(request, KV head) counter and the
    last to arrive merges them (:func:`_merge_if_last`; the counters live in the workspace and
    are left at zero). The per-request split then needs no reduce launch, and the flat split
    neither (the program that stores a request's last piece merges it; padded rows are zeroed
    by the flat kernel). ``fused_reduce_programs_per_sm``: with ``fused_reduce`` off, the
    per-request split launches of at most this many programs an SM (``num_reqs x Hkv x
    splits``; 5.0: one wave at the kernel's footprint, 5 an SM, which the merge keeps) merge
    their own ranges; FP8 caches 0 (not measured). In one wave every range runs at once and
    the last to arrive merges right after the others; past one wave the merge waits on the
    later waves' programs and lengthens the launch's tail. H200 (``bench/bench_decode_mixed.py``,
    16/8 heads, 32 splits, graph replays, us, reduce launch / fused): B1 (256 programs) L512
    7.8 / 7.4, L2048 11.2 / 10.8, L8192 18.5 / 17.6 (18.6 / 17.7 in another lease), U[100,
    2048] 11.1 / 10.8; B2 (512) 9.1 / 9.1, 13.8 / 13.8, 26.7 / 26.3, 12.4 / 12.2; B3 (768)
    9.9 / 10.1, 17.1 / 18.6, 43.4 / 45.9; B4 (1024) 10.4 / 10.4, 19.8 / 21.3, 48.2 / 47.5.
    Every launch fused (``fused_reduce``): B8 and up lost or tied (B8/L512 14.3 / 15.2, mixed
    B16 23.4 / 23.6), W1 within its spread (26,255 / 26,265 fused against 25,905 / 26,276,
    alternating processes): hence the one-wave bound in the defaults, not ``fused_reduce``.

    ``few_waves`` (twenty-first session): the fewest requests (``P <= few_max_programs_per_sm x
    S``: up to 8 requests of 8 KV heads on an H200) split into about ``few_waves`` programs an
    SM, one wave, instead of ``small_waves``' 8 (capped at ``max_splits`` 32, which is ~1 and ~2
    programs an SM at B1 and B2: those keep 32 ranges). H200, 16 / 8 heads, 20 cases (B3, B4,
    B6, B8 x lengths L8192, L2048, L512, U[100, 2048], U[1000, 8000]), us, ``small_waves`` 8
    / few_waves 4 (``bench_decode_mixed.py --variants sw4,sw8``): B3 (22 ranges, 528 programs
    against 32 ranges, 768: a second wave of 108) 43.1 / 33.6, 17.1 / 14.8, 10.0 / 9.4, 14.3 /
    13.0, 33.1 / 27.6; B4 (17 ranges) 48.2 / 46.4, 19.8 / 18.4, 10.4 / 10.4, 16.0 / 14.7, 36.7 /
    34.5; B6 (11) 63.9 / 55.5, 25.1 / 20.7, 12.7 / 10.9, 16.5 / 16.0, 49.3 / 42.9; B8 (9)
    79.6 / 77.3, 28.8 / 26.9, 14.3 / 12.7, 20.1 / 18.9, 54.9 / 52.4: 0-22% faster, none slower.
    At B12 and B16 the same ~4 an SM won on equal lengths (L8192 112.4 / 107.6, 138.6 / 133.4)
    but lost 2-9% on the mixed U[100, 2048] and U[1000, 8000] (B16 23.4 / 25.4, 74.2 / 80.7),
    where more ranges even out the unequal requests: they keep ``small_waves``. At B2, 25 or
    17 ranges lost to 32 on 3 of 5 length sets. FP8 caches and the MLA policies keep
    ``small_waves`` alone (``few_waves=None``: not measured).

    Tried and not kept: the block-table entries of the next tile loaded one iteration ahead
    (as the prefill kernel does) pipelines the K/V copies 4 tiles ahead at 5 stages but takes
    70 KB of shared memory (3 programs an SM): B64/L2048 one range 174.9 us against 129.5, W2
    2,950 against 3,514 output tok/s; at 3 stages (4 programs an SM) 1-7% faster on mixed
    lengths, not measured on the balanced one-wave launches (whose rule counts 5 an SM).

    ``table_ahead`` (thirty-first session; the default since the thirty-sixth): the decode
    kernels (per-request and flat) load each tile's block-table entries one iteration ahead
    (:func:`_tile_blocks`, as the prefill loop does) and launch with ``table_ahead_stages``;
    Triton then keeps the K / V copies of ``table_ahead_stages - 2`` more tiles in flight
    while one is computed (sm_90, per-request kernel: 37 KB of shared memory and 5 programs
    an SM at 3 stages, as the plain loop at 5; 54 / 71 / 87 / 103 KB at 4-7; the flat kernel
    at 3: 37 KB, 4 an SM, its plain wave). H100, B1-B16 at L512 / L2048 / L8192 / U[1000,
    8000] (``bench_decode_mixed.py --variants ta3,...``): more copies in flight are slower
    (B1/L8192 24.6 us at 7 stages against 20.2), so the small batches are not bound by a
    program's copy latency; at 3 stages 0.9-5.8% faster in 20 of 20 cells, B1-B256 0.2-6.3%
    faster in 16 of 18 (B128/L8192 3.6% slower). End to end: W2 on the H200 3,914 / 3,910
    against 3,890-3,896 (thirty-second session, one lease); W1 on an H100 20,279 against
    20,522 (one pair, thirty-second), then **21,341 / 21,321 against 21,170 / 21,180** (two
    alternating pairs, thirty-sixth). FP8 caches keep the plain loop (not measured).

    ``merge_chunk`` / ``wide_merge_chunk`` (thirty-second session; measured and set in the
    thirty-sixth): the partial ranges a merge (the reduce kernels and the split kernels' own,
    fused merge) loads in one round trip; a request merging ``n`` ranges waits on ``ceil(n /
    chunk)`` dependent loads. A fused per-request launch of at most
    ``wide_merge_programs_per_sm`` programs an SM merges ``wide_merge_chunk`` at once (B1:
    its 32 ranges in one trip), every other merge ``merge_chunk``. The fused split kernel
    (sm_90, table ahead) takes 80 / 93 / 158 registers at 8 / 16 / 32: 6 / 5 / 3 programs an
    SM, so 32 only where 3 an SM hold the launch. H100 (``bench_decode_mixed.py --variants
    mc16,mc32``, us, 8 / 16 / 32): B1/L8192 19.6 / 18.6 / 17.7, B1/L2048 11.2 / 10.3 / 9.3,
    B1 U[100, 2048] 11.1 / 10.2 / 9.1; B2/L8192 (512 programs, 3.9 an SM) 32.2 / 31.0 / 34.0,
    B4/L8192 54.9 / 54.1 / 59.2, B2-B4 at L2048 and mixed 0.4-1.1 us faster at 16; B16-B256
    (the flat split, its reduce, one range a request) within 0.2%; W1 21,367 / 21,316 at 8 /
    16 (one pair, the flat reduce's merge; within W1's spread). FP8 caches keep 8 (not
    measured).
    """

    tile_n: int = 32
    num_warps: int = 4
    num_stages: int = 5
    max_splits: int = 32
    small_waves: float = 8.0
    few_waves: float | None = 4.0
    few_max_programs_per_sm: float = 0.5
    small_min_split_tokens: int = 32
    mid_splits: int = 8
    mid_min_split_tokens: int = 256
    large_splits: int = 4
    large_min_split_tokens: int = 512
    min_split_tokens: int | None = None
    balanced_min_programs_per_sm: float = 2.0
    wave_programs_per_sm: float = 5.0
    balanced_fraction: float = 0.8
    balanced_max_excess: int | None = 1024
    reduce_heads: int = 4
    use_order: bool = True
    flat_split: bool = True
    flat_programs_per_sm: float = 4.0
    flat_min_split_tokens: int = 256
    flat_max_registers: int | None = None
    flat_min_programs_per_sm: float = 1.0
    lpt_one_range: bool = True
    lpt_load_fraction: float = 0.75
    fused_reduce: bool = False
    fused_reduce_programs_per_sm: float = 5.0
    table_ahead: bool = True
    table_ahead_stages: int = 3
    merge_chunk: int = 16
    wide_merge_chunk: int | None = 32
    wide_merge_programs_per_sm: float = 3.0

    def __post_init__(self):
        check_launch_config(self, ("tile_n",), warps=False)
        if not 1 <= self.max_splits <= MAX_SPLITS:
            raise ConfigError(f"DecodeConfig: need 1 <= max_splits <= {MAX_SPLITS}")
        mins = (self.small_min_split_tokens, self.mid_min_split_tokens, self.large_min_split_tokens)
        if min(mins) < 1 or (self.min_split_tokens is not None and self.min_split_tokens < 1):
            raise ConfigError("DecodeConfig: split minimums must be >= 1")
        if min(self.mid_splits, self.large_splits) < 1 or self.small_waves <= 0:
            raise ConfigError("DecodeConfig: split counts and small_waves must be positive")
        if (self.few_waves is not None and not self.few_waves > 0) \
                or not self.few_max_programs_per_sm >= 0:
            raise ConfigError("DecodeConfig: need few_waves > 0 (or None) and "
                              "few_max_programs_per_sm >= 0")
        if self.num_warps < 1 or self.num_stages < 1 or self.table_ahead_stages < 1:
            raise ConfigError("DecodeConfig: num_warps, num_stages and table_ahead_stages must "
                              "be positive")
        if self.flat_programs_per_sm <= 0 or self.flat_min_split_tokens < 1 \
                or (self.flat_max_registers is not None and self.flat_max_registers < 24) \
                or not self.flat_min_programs_per_sm >= 0:
            raise ConfigError("DecodeConfig: need flat_programs_per_sm > 0, "
                              "flat_min_split_tokens >= 1, flat_max_registers >= 24 or None "
                              "and flat_min_programs_per_sm >= 0")
        if self.lpt_one_range and not self.use_order:
            raise ConfigError("DecodeConfig.lpt_one_range launches the requests longest first: "
                              "it needs use_order=True")
        if not self.lpt_load_fraction > 0:
            raise ConfigError("DecodeConfig.lpt_load_fraction must be > 0")
        f = self.fused_reduce_programs_per_sm
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not f >= 0:
            raise ConfigError("DecodeConfig.fused_reduce_programs_per_sm must be a number >= 0, "
                              f"got {f!r}")
        for name in ("merge_chunk", "wide_merge_chunk"):
            c = getattr(self, name)
            if c is None and name == "wide_merge_chunk":
                continue
            if isinstance(c, bool) or not isinstance(c, int) or not 2 <= c <= MAX_SPLITS \
                    or c & (c - 1):
                raise ConfigError(f"DecodeConfig.{name} must be a power of two in [2, "
                                  f"{MAX_SPLITS}], got {c!r}")
        w = self.wide_merge_programs_per_sm
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0:
            raise ConfigError("DecodeConfig.wide_merge_programs_per_sm must be a number >= 0, "
                              f"got {w!r}")
        r = self.reduce_heads
        if isinstance(r, bool) or not isinstance(r, int) or r < 1 or r & (r - 1):
            raise ConfigError(f"DecodeConfig.reduce_heads must be a power of two >= 1, got {r!r}")
        if not 0 <= self.balanced_min_programs_per_sm <= self.wave_programs_per_sm \
                or not 0.0 < self.balanced_fraction <= 1.0:
            raise ConfigError("DecodeConfig: need 0 <= balanced_min_programs_per_sm <= "
                              "wave_programs_per_sm and 0 < balanced_fraction <= 1")
        e = self.balanced_max_excess
        if e is not None and (isinstance(e, bool) or not isinstance(e, int) or e < 0):
            raise ConfigError("DecodeConfig.balanced_max_excess must be an int >= 0 or None, "
                              f"got {e!r}")

    def fuses_reduce(self, programs: int, sms: int) -> bool:
        """Whether a per-request split launch of ``programs`` programs on ``sms``
        multiprocessors merges its own ranges (``fused_reduce``, or at most
        ``fused_reduce_programs_per_sm`` programs an SM)."""
        return self.fused_reduce or programs <= self.fused_reduce_programs_per_sm * sms

    def merge_chunk_for(self, programs: int, sms: int, fused: bool) -> int:
        """The ranges a merge loads in one round trip (``SPLIT_CHUNK``): ``wide_merge_chunk``
        for a fused per-request launch (``fused``) of at most ``wide_merge_programs_per_sm``
        programs an SM, else ``merge_chunk``."""
        if fused and self.wide_merge_chunk is not None \
                and programs <= self.wide_merge_programs_per_sm * sms:
            return self.wide_merge_chunk
        return self.merge_chunk

    def unfused(self) -> "DecodeConfig":
        """This config with every split merged by a reduce launch."""
        return dataclasses.replace(self, fused_reduce=False, fused_reduce_programs_per_sm=0.0)

    def kernel_stages(self) -> int:
        """The decode kernels' ``num_stages``: ``table_ahead_stages`` with ``table_ahead``,
        else ``num_stages``."""
        return self.table_ahead_stages if self.table_ahead else self.num_stages

    def flat_registers(self, prologue: bool = False) -> int | None:
        """The flat kernel's register cap (``maxnreg``): ``flat_max_registers`` when set; with
        ``fused_reduce`` (whose merge raises the kernel to 162 registers, 3 programs an SM on
        sm_90) or the fused q/k prologue (``prologue``, ``QKPrologue``: 168) the most that
        still fits ``flat_programs_per_sm`` programs of ``num_warps`` warps in the 65,536
        registers of an SM (128 at the defaults: unspilled, 4 an SM, both); else none."""
        if self.flat_max_registers is not None or not (self.fused_reduce or prologue):
            return self.flat_max_registers
        per_thread = 65536 // (math.ceil(self.flat_programs_per_sm) * self.num_warps * 32)
        return max(24, min(255, per_thread // 8 * 8))


# The interpreter runs the GPU's default policies (longest-first order and one range, the flat
# split) on small shapes: a flat wave of 8 programs over the KV heads and shares of >= 16 positions.
INTERPRET_DECODE_CONFIG = DecodeConfig(tile_n=16, num_warps=1, num_stages=1, min_split_tokens=16,
                                       flat_programs_per_sm=8 / 132, flat_min_split_tokens=16,
                                       flat_min_programs_per_sm=0.0)

# An FP8 cache moves half the bytes per position, so the default tile of 32 positions leaves
# the kernel bound by its per-tile work, not by memory: on the H200 (bench/bench_fp8_decode_gpu.py,
# 16/8 heads, head_dim 128) tile 32 x 4 warps x 5 stages took 20.6 / 87.0 / 180.8 / 712.6 /
# 641.8 / 2374.8 us at B1/L8192, B16/L4096, B64/L2048, B64/L8192, B256/L2048, B256/L8192, slower
# than the bf16 cache (19.5 / 77.9 / 129.9 / 497.4 / 528.5 / 1997.3); tile 128 x 4 warps x 2
# stages was the best or within 6% of the best of 24 variants at every shape.
# The launch policies measured with it are the per-request split and request order: the flat
# split, the longest-first one range, the fused reduce, the balanced rule's excess bound
# (whose alternative there would be the per-request split, not the flat one) and the fewest
# requests' ``few_waves`` were measured on bf16 caches only.
FP8_DECODE_CONFIG = DecodeConfig(tile_n=128, num_warps=4, num_stages=2, use_order=False,
                                 flat_split=False, lpt_one_range=False,
                                 fused_reduce_programs_per_sm=0.0, balanced_max_excess=None,
                                 few_waves=None, table_ahead=False, merge_chunk=8,
                                 wide_merge_chunk=None)


def default_decode_config(device: torch.device, kv_dtype: torch.dtype | None = None) -> DecodeConfig:
    """The decode launch parameters for ``device`` and a cache of ``kv_dtype`` (FP8 caches
    have their own, :data:`FP8_DECODE_CONFIG`)."""
    if device.type != "cuda":
        return INTERPRET_DECODE_CONFIG
    return FP8_DECODE_CONFIG if kv_dtype is not None and is_fp8_kv(kv_dtype) else DecodeConfig()


def one_range_if_balanced(num_reqs: int, num_kv_heads: int, sms: int, config: DecodeConfig) -> bool:
    """Whether a balanced batch of ``num_reqs`` requests runs one range per request (the
    programs fit one wave, :class:`DecodeConfig`)."""
    programs = num_reqs * num_kv_heads
    return (programs > 0 and config.balanced_min_programs_per_sm * sms <= programs
            <= config.wave_programs_per_sm * sms)


def one_range_possible(num_reqs: int, num_kv_heads: int, sms: int, config: DecodeConfig) -> bool:
    """Whether a launch over ``num_reqs`` requests runs one range per request for some
    lengths (the launches that ``balanced`` changes, a CUDA graph's variants): the balanced
    one-wave rule (:func:`one_range_if_balanced`), or with ``lpt_one_range`` at least
    ``balanced_min_programs_per_sm`` programs an SM."""
    if one_range_if_balanced(num_reqs, num_kv_heads, sms, config):
        return True
    return config.lpt_one_range and num_reqs * num_kv_heads >= max(
        1.0, config.balanced_min_programs_per_sm * sms)


def lpt_fits(seq_lens, num_kv_heads: int, sms: int, config: DecodeConfig) -> bool:
    """The longest-first one-range bound (``DecodeConfig.lpt_one_range``): the positions per
    program slot of one wave, ``sum(seq_lens) x num_kv_heads / (wave_programs_per_sm x sms)``,
    are at least ``lpt_load_fraction`` of the longest length; where the programs fit one wave
    (at most ``wave_programs_per_sm x sms``) the busiest SM's excess is bounded as well
    (:func:`busiest_sm_excess_fits`). Zero lengths (padding) are left out; no lengths: False.

    The one-wave bound (twentieth session): H200, 16 / 8 heads, us, this bound's one range /
    the flat split (``bench_decode_mixed.py --variants flat_only``): U[7680, 8192] B72 580.8 /
    542.2, B76 591.4 / 570.0, B80 605.8 / 600.3; U[6000, 8500] B76 559.8 / 518.7, B80 572.0 /
    545.6; U[1792, 2048] B72 145.8 / 142.8, B76 149.8 / 150.0, B80 154.5 / 158.2: with the
    excess bound each row takes the faster launch (B76 at L2048 a tie)."""
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    lens = lens[lens > 0]
    if lens.size == 0:
        return False
    slots = config.wave_programs_per_sm * sms
    if lens.size * num_kv_heads <= slots and not busiest_sm_excess_fits(lens, num_kv_heads,
                                                                         sms, config):
        return False
    return int(lens.sum()) * num_kv_heads >= config.lpt_load_fraction * slots * int(lens.max())


def busiest_sm_excess_fits(lens, num_kv_heads: int, sms: int, config: DecodeConfig) -> bool:
    """Whether a one-wave, one-range launch over the positive lengths ``lens`` (an int64
    array) keeps its busiest SM within ``config.balanced_max_excess`` positions of an even
    share: ``ceil(P / sms) x max - num_kv_heads x sum / sms <= balanced_max_excess`` for ``P
    = len(lens) x num_kv_heads`` programs (exact in integers). True where the bound is None;
    False without SMs."""
    if sms < 1:
        return False
    if config.balanced_max_excess is None:
        return True
    busiest = cdiv(int(lens.size) * num_kv_heads, sms)  # programs on the busiest SM
    return (sms * busiest * int(lens.max()) - num_kv_heads * int(lens.sum())
            <= sms * config.balanced_max_excess)


def one_range_for(seq_lens, num_reqs: int, num_kv_heads: int, sms: int,
                  config: DecodeConfig) -> bool:
    """The host decision ``balanced`` of a decode launch over ``num_reqs`` requests (a graph's
    padded size) whose decode lengths are ``seq_lens`` (host ints): one range per request,
    by the balanced one-wave rule (:func:`one_range_if_balanced` and
    :func:`lengths_balanced`) or the longest-first bound (``lpt_one_range``,
    :func:`lpt_fits`)."""
    if one_range_if_balanced(num_reqs, num_kv_heads, sms, config) \
            and lengths_balanced(seq_lens, config, num_kv_heads, sms):
        return True
    return (config.lpt_one_range and one_range_possible(num_reqs, num_kv_heads, sms, config)
            and lpt_fits(seq_lens, num_kv_heads, sms, config))


def lengths_balanced(seq_lens, config: DecodeConfig, num_kv_heads: int, sms: int) -> bool:
    """Whether the context lengths ``seq_lens`` (host ints, one per decode request) are
    balanced for a one-range launch on ``sms`` multiprocessors: their mean is at least
    ``config.balanced_fraction`` of their maximum, and (``config.balanced_max_excess`` set)
    the busiest SM's positions beyond an even share are at most that bound
    (:func:`busiest_sm_excess_fits`). Zero lengths (CUDA-graph padding requests) are left out;
    no lengths or no SMs: False."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    lens = lens[lens > 0]
    if lens.size == 0 or not busiest_sm_excess_fits(lens, num_kv_heads, sms, config):
        return False
    top = int(lens.max())
    return int(lens.sum()) >= config.balanced_fraction * lens.size * top


def choose_split(num_reqs: int, num_kv_heads: int, max_seq_len: int | None,
                 sms: int, config: DecodeConfig, balanced: bool = False) -> tuple[int, int]:
    """``(split count, min positions per split)`` of a launch, from host values only (see
    :class:`DecodeConfig`); the split count is further capped so that ``max_seq_len`` (when
    known) fills every split with the minimum, and lies in ``[1, config.max_splits]``.
    ``balanced``: one range per request where :func:`one_range_possible` (the caller's
    :func:`one_range_for` of the batch's lengths)."""
    programs = max(1, num_reqs * num_kv_heads)
    if balanced and one_range_possible(num_reqs, num_kv_heads, sms, config):
        return 1, config.min_split_tokens or config.mid_min_split_tokens
    if programs < 2 * sms:
        waves = config.small_waves
        if config.few_waves is not None and programs <= config.few_max_programs_per_sm * sms:
            waves = config.few_waves
        splits, min_tokens = cdiv(int(waves * sms), programs), config.small_min_split_tokens
    elif programs < 4 * sms:
        splits, min_tokens = config.mid_splits, config.mid_min_split_tokens
    else:
        splits, min_tokens = config.large_splits, config.large_min_split_tokens
    if config.min_split_tokens is not None:
        min_tokens = config.min_split_tokens
    if max_seq_len is not None:
        splits = min(splits, cdiv(max(int(max_seq_len), 1), min_tokens))
    return max(1, min(config.max_splits, splits)), min_tokens


def flat_launch(num_reqs: int, num_kv_heads: int, sms: int, config: DecodeConfig,
                splits: int) -> bool:
    """Whether a decode launch of ``num_reqs`` requests that :func:`choose_split` gives
    ``splits`` ranges a request takes the flat split (``DecodeConfig.flat_split``): it would
    split, and its per-request launch has at least ``flat_min_programs_per_sm x sms`` programs
    before splitting (host values only: a CUDA graph's padded size decides it)."""
    return (config.flat_split and splits > 1
            and num_reqs * num_kv_heads >= config.flat_min_programs_per_sm * sms)


def flat_programs(num_kv_heads: int, sms: int, config: DecodeConfig) -> int:
    """Programs per KV head of the flat split (``DecodeConfig.flat_split``): one wave of
    ``flat_programs_per_sm`` programs on each of ``sms`` multiprocessors, at least 1."""
    return max(1, int(config.flat_programs_per_sm * sms) // max(1, num_kv_heads))


def flat_pieces(seq_lens, num_kv_heads: int, sms: int, config: DecodeConfig,
                sliding_window: int | None = None) -> list[list[tuple[int, int, int]]]:
    """Host twin of the flat split's partition (``DecodeConfig.flat_split``), for tests and
    inspection: per program ``p`` (of :func:`flat_programs`) its pieces ``(request, first
    tile, end tile)`` in request order, tiles of ``tile_n`` positions counted from each
    request's window start; ``seq_lens`` holds the decode requests' lengths (0 for others)."""
    tile = config.tile_n
    lens = [int(x) for x in seq_lens]
    tiles = [0 if n <= 0 else -(-n // tile) - (max(n - sliding_window, 0) if sliding_window else 0) // tile
             for n in lens]
    total = sum(tiles)
    progs = flat_programs(num_kv_heads, sms, config)
    share = max(cdiv(total, progs), cdiv(config.flat_min_split_tokens, tile))
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(progs)]
    cu = 0
    for r, nt in enumerate(tiles):
        t = 0
        while t < nt:
            p = (cu + t) // share
            end = min(nt, (p + 1) * share - cu)
            pieces[p].append((r, t, end))
            t = end
        cu += nt
    return pieces


def longest_first_order(seq_lens) -> np.ndarray:
    """Request indices by decreasing context length, ties in index order (int32): the
    ``order`` of :func:`paged_decode_attention` that launches the longest requests' programs
    first. ``seq_lens``: host ints, one per request."""
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    return np.argsort(-lens, kind="stable").astype(np.int32)


def check_order(fn: str, order, num_reqs: int, device: torch.device) -> None:
    """``order`` is None or an int32 1-D tensor of at least ``num_reqs`` entries on
    ``device`` (its entries must be a permutation of ``range(num_reqs)``: a device tensor's
    values are not read here)."""
    if order is None:
        return
    if not isinstance(order, torch.Tensor) or order.dtype != torch.int32 or order.dim() != 1 \
            or order.shape[0] < num_reqs or order.device != device:
        raise ConfigError(f"{fn}: order must be an int32 1-D tensor of >= num_reqs ({num_reqs}) "
                          f"entries on {device}, got "
                          f"{getattr(order, 'dtype', type(order))} {tuple(getattr(order, 'shape', ()))}"
                          f" on {getattr(order, 'device', None)}")


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int | None,
                      sms: int, config: DecodeConfig, balanced: bool = False) -> int:
    """The split count of :func:`choose_split`."""
    return choose_split(num_reqs, num_kv_heads, max_seq_len, sms, config, balanced)[0]


@triton.jit
def _window_start(seq_len, window):
    """The first position a decode query at ``seq_len - 1`` sees: ``seq_len - window`` with a
    sliding window (``window > 0``), else 0."""
    return tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)


@triton.jit
def _split_range(seq_len, lo, s, num_splits, min_split_tiles, TILE_N: tl.constexpr):
    """Tiles ``[t0, t1)`` of split ``s`` over the tiles holding positions ``[lo, seq_len)``,
    the tiles per split and that tile count."""
    t_lo = lo // TILE_N
    n_tiles = tl.cdiv(seq_len, TILE_N) - t_lo
    used = tl.maximum(tl.minimum(tl.cdiv(n_tiles, min_split_tiles), num_splits), 1)
    per = tl.maximum(tl.cdiv(n_tiles, used), 1)
    t0 = t_lo + s * per
    t1 = tl.minimum(t0 + per, t_lo + n_tiles)
    return t0, t1, per, n_tiles


@triton.jit
def _soft_cap(scores_log2, SOFTCAP: tl.constexpr):
    """``c tanh(s / c)`` of base-2 scores (``s`` in natural units is ``scores_log2 / log2 e``);
    the identity when ``SOFTCAP`` is 0. tanh through exp: finite for every input."""
    if SOFTCAP > 0:
        x = scores_log2 * (1.0 / (1.4426950408889634 * SOFTCAP))
        t = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
        return t * (SOFTCAP * 1.4426950408889634)
    return scores_log2


@triton.jit
def _sink_denominator(l_i, m_i, sinks_ptr, head, mask, HAS_SINKS: tl.constexpr):
    """The softmax denominator ``l_i`` (of base-2 scores with running max ``m_i``) plus each
    head's attention sink ``exp(sink)`` (``sinks_ptr[head]``, natural-log units, as GPT-OSS
    learns them): ``l + 2^(sink log2(e) - m)``; ``l_i`` itself without sinks. The sink joins
    the denominator only (no value row). An overflow to inf (a sink ~88 above every score)
    gives the right limit, an output of 0."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=mask, other=0.0).to(tl.float32)
        return l_i + tl.exp2(sink * 1.4426950408889634 - m_i)
    return l_i


@triton.jit
def _lse(m_i, l_i):
    """The natural-log log-sum-exp of a row's scores from its base-2 running max ``m_i`` and
    denominator ``l_i`` (``ln 2 (m + log2 l)``): the log of what the output was divided by
    (cascade attention merges partial outputs with it)."""
    return (m_i + tl.log2(l_i)) * 0.6931471805599453


@triton.jit
def _tile_blocks(bt_row, bt_width, start, limit, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The block-table entries of key tile ``[start, start + BLOCK_N)``, one per key (0 for
    keys at or past ``limit`` and columns past the table width: never read). The prefill
    loops (and the decode loop with ``DecodeConfig.table_ahead``) load them one tile ahead
    (the next tile's while this one is computed), so each tile's K / V copies depend on no
    load of their own iteration and Triton's pipeliner can issue them ``num_stages - 1``
    tiles ahead (a table load in the same iteration held the prefill's to one tile ahead:
    H200, 8 x 2048 causal, BENCHMARKS.md)."""
    n = start + tl.arange(0, BLOCK_N)
    col = n // BLOCK_SIZE
    return tl.load(bt_row + col, mask=(n < limit) & (col < bt_width), other=0)


@triton.jit
def _decode_tile(acc, l_i, m_i, q, t, seq_len, lo, k_ptr, v_ptr, bt_row, bt_width, blk, c_sb,
                 c_st, head_off, d, scale_log2, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PREC: tl.constexpr,
                 SOFTCAP: tl.constexpr):
    """Positions ``[t * TILE_N, (t + 1) * TILE_N)`` of the online softmax; positions before
    ``lo`` (outside the sliding window) are neither read nor attended. K / V are cast to
    ``q``'s dtype after the load (a no-op unless the cache is FP8). ``blk``: the tile's
    block-table entries loaded ahead (:func:`_tile_blocks`), or None: loaded here."""
    n = t * TILE_N + tl.arange(0, TILE_N)
    col = n // BLOCK_SIZE
    valid = (n < seq_len) & (n >= lo) & (col < bt_width)
    if blk is None:
        blk = tl.load(bt_row + col, mask=valid, other=0)
    blk = blk.to(tl.int64)
    tok = blk * c_sb + (n % BLOCK_SIZE).to(tl.int64) * c_st + head_off
    if HEAD_DIM == D_PAD:
        kv_mask = valid[:, None]
    else:
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + tok[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    v = tl.load(v_ptr + tok[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    scores = _soft_cap(tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2, SOFTCAP)
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _decode_tile_ahead(acc, l_i, m_i, q, t, seq_len, lo, k_ptr, v_ptr, bt_row, bt_width, blk,
                       c_sb, c_st, head_off, d, scale_log2, HEAD_DIM: tl.constexpr,
                       D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                       DOT_PREC: tl.constexpr, SOFTCAP: tl.constexpr):
    """:func:`_decode_tile` of tile ``t`` on its entries ``blk`` (loaded an iteration ago),
    with tile ``t + 1``'s entries loaded first: ``(acc, l, m, next entries)``."""
    nxt = _tile_blocks(bt_row, bt_width, (t + 1) * TILE_N, seq_len, BLOCK_SIZE, TILE_N)
    acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, t, seq_len, lo, k_ptr, v_ptr, bt_row,
                                 bt_width, blk, c_sb, c_st, head_off, d, scale_log2, HEAD_DIM,
                                 D_PAD, BLOCK_SIZE, TILE_N, DOT_PREC, SOFTCAP)
    return acc, l_i, m_i, nxt


@triton.jit
def _prologue(qkv_ptr, qkv_s0, q_row, head, g, kvh, writes, cos_ptr, cos_s0, cos_s1, sin_ptr,
              sin_s0, sin_s1, qw_ptr, kw_ptr, eps, slot_ptr, num_slot_rows, num_slots, k_ptr,
              v_ptr, c_sb, c_st, head_off, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
              GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
              HAS_NORM: tl.constexpr):
    """The fused prologue (:class:`QKPrologue`): the query heads ``head`` of row ``q_row`` of
    the raw QKV projection (``qkv_ptr``: ``H`` query, ``Hkv`` key, ``Hkv`` value heads a row)
    with their RMS norm and RoPE, as ``qk_norm_rope_cache`` computes them
    (:func:`norm_rope_tile`, fp32), returned as the fp32 ``[GROUP_PAD, HEAD_DIM]`` query tile
    (a power-of-two head size: the halves join in place). Where ``writes`` (this program's
    tiles hold the new token's position), KV head ``kvh``'s key (norm, RoPE) and value go to
    the cache at the row's slot (``slot_ptr``, ``num_slot_rows`` rows; skipped outside
    ``[0, num_slots)``), and the
    program waits at a barrier so that its own tile loads see them."""
    HALF: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, HALF)[None, :]
    row = qkv_ptr + q_row.to(tl.int64) * qkv_s0
    c = tl.load(cos_ptr + q_row.to(tl.int64) * cos_s0 + h * cos_s1).to(tl.float32)
    s = tl.load(sin_ptr + q_row.to(tl.int64) * sin_s0 + h * sin_s1).to(tl.float32)
    mq = (g < GROUP)[:, None] & (h < HALF)
    q1, q2 = norm_rope_tile(row + head[:, None] * HEAD_DIM + h, qw_ptr, h, mq, c, s, eps,
                            HAS_NORM, HEAD_DIM, HALF)
    if writes:
        slot = tl.load(slot_ptr + q_row, mask=q_row < num_slot_rows, other=-1).to(tl.int64)
        if (slot >= 0) & (slot < num_slots):
            blk = slot // BLOCK_SIZE
            dst = blk * c_sb + (slot - blk * BLOCK_SIZE) * c_st + head_off
            k1, k2 = norm_rope_tile(row + (NUM_HEADS + kvh) * HEAD_DIM + h, kw_ptr, h, h < HALF,
                                    c, s, eps, HAS_NORM, HEAD_DIM, HALF)
            tl.store(k_ptr + dst + h, k1.to(k_ptr.dtype.element_ty))
            tl.store(k_ptr + dst + HALF + h, k2.to(k_ptr.dtype.element_ty))
            e = tl.arange(0, HEAD_DIM)[None, :]
            xv = tl.load(row + (NUM_HEADS + NUM_HEADS // GROUP + kvh) * HEAD_DIM + e)
            tl.store(v_ptr + dst + e, xv.to(v_ptr.dtype.element_ty))
        tl.debug_barrier()  # the stores above before any of this program's tile loads
    return tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (GROUP_PAD, HEAD_DIM))


@triton.jit
def _decode_range(q_ptr, q_s0, q_s1, q_row, head, d, gd_mask, t0, t1, seq_len, lo,
                  k_ptr, v_ptr, bt_row, bt_width, c_sb, c_st, head_off, scale_log2, v_scale,
                  GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PREC: tl.constexpr,
                  SOFTCAP: tl.constexpr, RANGE_LOOP: tl.constexpr, KV_FP8: tl.constexpr,
                  Q_FP16: tl.constexpr, TABLE_AHEAD: tl.constexpr = False, q_in=0.0,
                  Q_GIVEN: tl.constexpr = False):
    """The online softmax of one request's query heads ``head`` (query row ``q_row``) over
    tiles ``[t0, t1)`` of its context: ``(acc, l, m)`` in fp32, base 2, ``acc`` unnormalized
    (times ``v_scale`` for an FP8 cache). ``Q_GIVEN``: the query tile is ``q_in`` (the fused
    prologue's, :func:`_prologue`), not loaded."""
    if Q_GIVEN:
        q = q_in
    else:
        q = tl.load(q_ptr + q_row.to(tl.int64) * q_s0 + head[:, None] * q_s1 + d[None, :],
                    mask=gd_mask, other=0.0)
    if not KV_FP8:  # an FP8 cache's K / V are cast to the query dtype instead
        q = q.to(k_ptr.dtype.element_ty)
    elif Q_FP16:  # bf16 query, FP8 cache: the products in fp16 (e4m3 -> fp16 is one convert)
        q = q.to(tl.float16)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    if TABLE_AHEAD:  # the next tile's block-table entries loaded while this one is computed
        blk = _tile_blocks(bt_row, bt_width, t0 * TILE_N, seq_len, BLOCK_SIZE, TILE_N)
        if RANGE_LOOP:
            for t in range(t0, t1):
                acc, l_i, m_i, blk = _decode_tile_ahead(
                    acc, l_i, m_i, q, t, seq_len, lo, k_ptr, v_ptr, bt_row, bt_width, blk, c_sb,
                    c_st, head_off, d, scale_log2, HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, DOT_PREC,
                    SOFTCAP)
        else:  # the interpreter cannot iterate range() over runtime scalars
            t = t0
            while t < t1:
                acc, l_i, m_i, blk = _decode_tile_ahead(
                    acc, l_i, m_i, q, t, seq_len, lo, k_ptr, v_ptr, bt_row, bt_width, blk, c_sb,
                    c_st, head_off, d, scale_log2, HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, DOT_PREC,
                    SOFTCAP)
                t += 1
    elif RANGE_LOOP:  # compiled: a for-range loop, software-pipelined by Triton
        for t in range(t0, t1):
            acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, t, seq_len, lo, k_ptr, v_ptr, bt_row,
                                         bt_width, None, c_sb, c_st, head_off, d, scale_log2,
                                         HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, DOT_PREC, SOFTCAP)
    else:  # the interpreter cannot iterate range() over runtime scalars
        t = t0
        while t < t1:
            acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, t, seq_len, lo, k_ptr, v_ptr, bt_row,
                                         bt_width, None, c_sb, c_st, head_off, d, scale_log2,
                                         HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, DOT_PREC, SOFTCAP)
            t += 1
    if KV_FP8:
        acc = acc * v_scale
    return acc, l_i, m_i


@triton.jit
def _decode_write(acc, l_i, m_i, direct, part, out_ptr, o_s0, o_s1, q_row, head, g, d, gd_mask,
                  m_ptr, l_ptr, acc_ptr, sinks_ptr, lse_ptr, lse_s0, GROUP: tl.constexpr,
                  D_PAD: tl.constexpr, HAS_SINKS: tl.constexpr, WRITE_LSE: tl.constexpr):
    """A range's result: ``direct`` (the range is the request's whole context) normalizes and
    writes the output row (and its log-sum-exp); otherwise the partial ``(m, l, acc)`` goes to
    partial rows ``part`` (one per head) for a reduce kernel."""
    if direct:
        l_i = _sink_denominator(l_i, m_i, sinks_ptr, head, g < GROUP, HAS_SINKS)
        out_rows = out_ptr + q_row.to(tl.int64) * o_s0 + head[:, None] * o_s1 + d[None, :]
        tl.store(out_rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=gd_mask)
        if WRITE_LSE:
            tl.store(lse_ptr + q_row.to(tl.int64) * lse_s0 + head, _lse(m_i, l_i), mask=g < GROUP)
    else:
        tl.store(m_ptr + part, m_i, mask=g < GROUP)
        tl.store(l_ptr + part, l_i, mask=g < GROUP)
        tl.store(acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=gd_mask)


@triton.jit
def _merge_partials(m_run, l_run, acc, m, l, a, ok):
    """One chunk of a reduce: partials ``m, l [BLOCK_H, C]``, ``a [BLOCK_H, C, D]`` (those
    with ``ok`` false left out by value) merged into the running ``(m_run, l_run, acc)``,
    base 2."""
    m = tl.where(ok, m, float("-inf"))
    m_new = tl.maximum(m_run, tl.max(m, 1))
    alpha = tl.exp2(m_run - m_new)
    w = tl.exp2(m - m_new[:, None])  # 0 for the partials left out
    l_run = l_run * alpha + tl.sum(tl.where(ok, w * l, 0.0), 1)
    acc = acc * alpha[:, None] + tl.sum(tl.where(ok[:, :, None], w[:, :, None] * a, 0.0), 1)
    return m_new, l_run, acc


@triton.jit
def _merge_ranges(m, l, a, base, c, h_ok, d, d_ok, num_splits, used, m_ptr, l_ptr, acc_ptr,
                  BLOCK_H: tl.constexpr, D_PAD: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
                  CACHE: tl.constexpr):
    """The merged ``(m, l, acc)`` of the first ``used`` split ranges of heads with partial rows
    ``base [BLOCK_H]`` (ranges ``base + s``); ``m, l, a``: the first ``SPLIT_CHUNK`` ranges,
    already loaded (``c = arange(SPLIT_CHUNK)``). Ranges ``[sp, sp + SPLIT_CHUNK)`` per
    iteration (one variant for every split count), merged online in base 2; a masked head's
    row is all -inf and never stored. ``CACHE``: the later chunks' load cache modifier."""
    m_run = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_PAD], tl.float32)
    sp = tl.full([], 0, tl.int32)
    while sp < used:
        if sp > 0:  # ranges past the first chunk (more than SPLIT_CHUNK splits)
            idx = base[:, None] + (sp + c)[None, :]
            in_buf = h_ok[:, None] & ((sp + c) < num_splits)[None, :]
            m = tl.load(m_ptr + idx, mask=in_buf, other=float("-inf"), cache_modifier=CACHE)
            l = tl.load(l_ptr + idx, mask=in_buf, other=0.0, cache_modifier=CACHE)
            a = tl.load(acc_ptr + idx[:, :, None] * D_PAD + d[None, None, :],
                        mask=in_buf[:, :, None] & d_ok[None, None, :], other=0.0,
                        cache_modifier=CACHE)
        m_run, l_run, acc = _merge_partials(m_run, l_run, acc, m, l, a,
                                            ((sp + c) < used)[None, :])
        sp += SPLIT_CHUNK
    return m_run, l_run, acc


@triton.jit
def _store_merged(m_run, l_run, acc, out_ptr, o_s0, o_s1, q_row, hh, h_ok, d, d_ok, sinks_ptr,
                  lse_ptr, lse_s0, HAS_SINKS: tl.constexpr, WRITE_LSE: tl.constexpr):
    """A reduce's normalized output rows (heads ``hh``) and log-sum-exps."""
    l_run = _sink_denominator(l_run, m_run, sinks_ptr, hh, h_ok, HAS_SINKS)
    tl.store(out_ptr + q_row.to(tl.int64) * o_s0 + hh[:, None].to(tl.int64) * o_s1 + d[None, :],
             (acc / l_run[:, None]).to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        tl.store(lse_ptr + q_row.to(tl.int64) * lse_s0 + hh, _lse(m_run, l_run), mask=h_ok)


@triton.jit
def _merge_if_last(r, kvh, s, n_tiles, per, num_splits, q_row, cnt_ptr, out_ptr, o_s0, o_s1,
                   m_ptr, l_ptr, acc_ptr, sinks_ptr, lse_ptr, lse_s0, NUM_HEADS: tl.constexpr,
                   GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                   D_PAD: tl.constexpr, SPLIT_CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr,
                   WRITE_LSE: tl.constexpr):
    """The split kernel's own reduce (``DecodeConfig.fused_reduce``): after a range stored its
    partials, it counts itself in the counter of (request ``r``, KV head ``kvh``); the range
    that arrives last merges every range's partials of the KV head's query heads (as the
    reduce kernel does, :func:`_merge_ranges`) and writes the output rows (``arrive``, from
    ``pagedkv.kernels._common``: the counter, left at 0; the L2-only loads, ``.cg``, see the
    other ranges' partials)."""
    used = tl.cdiv(n_tiles, per)
    if arrive(cnt_ptr + r.to(tl.int64) * (NUM_HEADS // GROUP) + kvh, used):
        hh = kvh * GROUP + tl.arange(0, GROUP_P2)
        h_ok = tl.arange(0, GROUP_P2) < GROUP
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        c = tl.arange(0, SPLIT_CHUNK)
        base = (r.to(tl.int64) * NUM_HEADS + hh) * num_splits
        idx = base[:, None] + c[None, :]
        in_buf = h_ok[:, None] & (c < num_splits)[None, :]
        m = tl.load(m_ptr + idx, mask=in_buf, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(l_ptr + idx, mask=in_buf, other=0.0, cache_modifier=".cg")
        a = tl.load(acc_ptr + idx[:, :, None] * D_PAD + d[None, None, :],
                    mask=in_buf[:, :, None] & d_ok[None, None, :], other=0.0,
                    cache_modifier=".cg")
        m_run, l_run, acc = _merge_ranges(m, l, a, base, c, h_ok, d, d_ok, num_splits, used,
                                          m_ptr, l_ptr, acc_ptr, GROUP_P2, D_PAD, SPLIT_CHUNK,
                                          ".cg")
        _store_merged(m_run, l_run, acc, out_ptr, o_s0, o_s1, q_row, hh, h_ok, d, d_ok,
                      sinks_ptr, lse_ptr, lse_s0, HAS_SINKS, WRITE_LSE)


@triton.jit(do_not_specialize=["num_reqs", "num_splits", "min_split_tiles", "zero_rows",
                               "window", "num_slot_rows"])
def _decode_kernel(
    q_ptr, q_s0, q_s1,
    k_ptr, v_ptr, c_sb, c_st, c_sh,
    bt_ptr, bt_s0, bt_width,
    qsl_ptr, seq_ptr, num_reqs, num_splits, min_split_tiles, zero_rows, window,
    out_ptr, o_s0, o_s1,
    m_ptr, l_ptr, acc_ptr,
    sinks_ptr,
    scale_log2,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RANGE_LOOP: tl.constexpr,
    lse_ptr=None,
    lse_s0=0,
    WRITE_LSE: tl.constexpr = False,
    v_scale=1.0,
    KV_FP8: tl.constexpr = False,
    Q_FP16: tl.constexpr = False,
    PDL: tl.constexpr = 0,
    order_ptr=None,
    ORDERED: tl.constexpr = False,
    cnt_ptr=None,
    FUSED_REDUCE: tl.constexpr = False,
    GROUP_P2: tl.constexpr = 1,
    SPLIT_CHUNK: tl.constexpr = 8,
    TABLE_AHEAD: tl.constexpr = False,
    cos_ptr=None, cos_s0=0, cos_s1=0, sin_ptr=None, sin_s0=0, sin_s1=0,
    qw_ptr=None, kw_ptr=None, qk_eps=0.0, slot_ptr=None, num_slot_rows=0, num_slots=0,
    QK_PROLOGUE: tl.constexpr = False,
    QK_NORM: tl.constexpr = False,
):
    pdl_prologue(PDL)
    if ORDERED:  # grid (splits, KV heads, requests): a request's programs dispatch together,
        # the requests in the order of order_ptr (longest first: the shortest programs last)
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        r = tl.load(order_ptr + tl.program_id(2))
    else:
        r = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    head = kvh * GROUP + g
    gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q_row = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_row
    # issued with the query offsets, not after the branch on them: the block-table loads
    # of the range wait on it (one dependent round trip less before the first K / V byte);
    # seq_lens holds >= num_reqs entries, so every program's row is in bounds
    seq_len = tl.load(seq_ptr + r)
    if q_len != 1:
        if (zero_rows != 0) & (q_len == 0) & (s == 0):
            # a padded request (no query rows) zeroes row r when no request owns it
            if r >= tl.load(qsl_ptr + num_reqs):
                tl.store(out_ptr + r.to(tl.int64) * o_s0 + head[:, None] * o_s1 + d[None, :],
                         tl.zeros([GROUP_PAD, D_PAD], tl.float32).to(out_ptr.dtype.element_ty),
                         mask=gd_mask)
        return
    lo = _window_start(seq_len, window)
    t0, t1, per, n_tiles = _split_range(seq_len, lo, s, num_splits, min_split_tiles, TILE_N)
    if t0 >= t1:
        return
    q_in = 0.0
    if QK_PROLOGUE:
        q_in = _prologue(q_ptr, q_s0, q_row, head, g, kvh, t1 * TILE_N >= seq_len, cos_ptr,
                         cos_s0, cos_s1, sin_ptr, sin_s0, sin_s1, qw_ptr, kw_ptr, qk_eps,
                         slot_ptr, num_slot_rows, num_slots, k_ptr, v_ptr, c_sb, c_st,
                         kvh.to(tl.int64) * c_sh, NUM_HEADS, GROUP, GROUP_PAD, HEAD_DIM,
                         BLOCK_SIZE, QK_NORM)
    acc, l_i, m_i = _decode_range(
        q_ptr, q_s0, q_s1, q_row, head, d, gd_mask, t0, t1, seq_len, lo,
        k_ptr, v_ptr, bt_ptr + r.to(tl.int64) * bt_s0, bt_width, c_sb, c_st,
        kvh.to(tl.int64) * c_sh, scale_log2, v_scale, GROUP_PAD, HEAD_DIM, D_PAD, BLOCK_SIZE,
        TILE_N, DOT_PREC, SOFTCAP, RANGE_LOOP, KV_FP8, Q_FP16, TABLE_AHEAD, q_in, QK_PROLOGUE)
    _decode_write(acc, l_i, m_i, per >= n_tiles, (r.to(tl.int64) * NUM_HEADS + head) * num_splits + s,
                  out_ptr, o_s0, o_s1, q_row, head, g, d, gd_mask, m_ptr, l_ptr, acc_ptr,
                  sinks_ptr, lse_ptr, lse_s0, GROUP, D_PAD, HAS_SINKS, WRITE_LSE)
    if FUSED_REDUCE:
        if per < n_tiles:  # a partial: the request's last range to finish merges them all
            _merge_if_last(r, kvh, s, n_tiles, per, num_splits, q_row, cnt_ptr, out_ptr, o_s0,
                           o_s1, m_ptr, l_ptr, acc_ptr, sinks_ptr, lse_ptr, lse_s0, NUM_HEADS,
                           GROUP, GROUP_P2, HEAD_DIM, D_PAD, SPLIT_CHUNK, HAS_SINKS, WRITE_LSE)


@triton.jit(do_not_specialize=["num_reqs", "num_splits", "min_split_tiles", "window"])
def _decode_reduce_kernel(
    qsl_ptr, seq_ptr, num_reqs, num_splits, min_split_tiles, window,
    out_ptr, o_s0, o_s1,
    m_ptr, l_ptr, acc_ptr,
    sinks_ptr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    lse_ptr=None,
    lse_s0=0,
    WRITE_LSE: tl.constexpr = False,
    BLOCK_H: tl.constexpr = 1,
    PDL: tl.constexpr = 0,
):
    """Program ``(r, b)`` merges the split ranges of query heads ``[b BLOCK_H, (b + 1)
    BLOCK_H)`` of request ``r`` (heads past ``NUM_HEADS`` masked). The request's rows, its
    length and its first ``SPLIT_CHUNK`` ranges of partials are loaded at once, before anything
    is known about them (every address depends on ``r`` and the heads only; ranges the request
    did not use are masked out of the merge by value, so stale partials never reach the
    output): one round trip to memory for up to ``SPLIT_CHUNK`` ranges, where loading the
    lengths first and the partials after them took two more. Several heads a program: fewer
    programs, each as long (the merge is latency, not bytes)."""
    pdl_prologue(PDL)
    r = tl.program_id(0)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < NUM_HEADS
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    c = tl.arange(0, SPLIT_CHUNK)
    base = (r.to(tl.int64) * NUM_HEADS + hh) * num_splits  # [BLOCK_H]
    q_row = tl.load(qsl_ptr + r)
    q_end = tl.load(qsl_ptr + r + 1)
    seq_len = tl.load(seq_ptr + r)
    idx = base[:, None] + c[None, :]  # [BLOCK_H, SPLIT_CHUNK]
    in_buf = h_ok[:, None] & (c < num_splits)[None, :]
    m = tl.load(m_ptr + idx, mask=in_buf, other=float("-inf"))
    l = tl.load(l_ptr + idx, mask=in_buf, other=0.0)
    a = tl.load(acc_ptr + idx[:, :, None] * D_PAD + d[None, None, :],
                mask=in_buf[:, :, None] & d_ok[None, None, :], other=0.0)
    if q_end - q_row != 1:
        return
    t0, t1, per, n_tiles = _split_range(seq_len, _window_start(seq_len, window), 0, num_splits,
                                        min_split_tiles, TILE_N)
    if per >= n_tiles:
        return  # written directly by the split kernel
    m_run, l_run, acc = _merge_ranges(m, l, a, base, c, h_ok, d, d_ok, num_splits,
                                      tl.cdiv(n_tiles, per), m_ptr, l_ptr, acc_ptr, BLOCK_H,
                                      D_PAD, SPLIT_CHUNK, "")
    _store_merged(m_run, l_run, acc, out_ptr, o_s0, o_s1, q_row, hh, h_ok, d, d_ok, sinks_ptr,
                  lse_ptr, lse_s0, HAS_SINKS, WRITE_LSE)


@triton.jit
def _decode_tiles(qsl_ptr, seq_ptr, rr, num_reqs, window, TILE_N: tl.constexpr):
    """The tiles of ``TILE_N`` positions that requests ``rr`` (a scalar or a vector) read: those
    holding positions ``[window start, seq_len)`` for a single-token request ``rr < num_reqs``,
    0 for every other request (longer queries, CUDA-graph padding, ``rr >= num_reqs``)."""
    ok = rr < num_reqs
    q0 = tl.load(qsl_ptr + rr, mask=ok, other=0)
    q1 = tl.load(qsl_ptr + rr + 1, mask=ok, other=0)
    dec = ok & (q1 - q0 == 1)
    sl = tl.load(seq_ptr + rr, mask=dec, other=0)
    return tl.where(dec, tl.cdiv(sl, TILE_N) - _window_start(sl, window) // TILE_N, 0)


@triton.jit
def _flat_scan(qsl_ptr, seq_ptr, num_reqs, window, a, r_lim, TILE_N: tl.constexpr,
               REQ_CHUNK: tl.constexpr):
    """The decode requests' tiles laid end to end in request order (the flat split): the total
    tile count, the number of requests that end at or before flat tile ``a`` and their tiles
    (so request ``n_before`` holds tile ``a`` when ``a < total``), and the tiles of the
    requests before ``r_lim``. ``REQ_CHUNK`` requests per iteration."""
    c = tl.arange(0, REQ_CHUNK)
    total = tl.zeros([], tl.int32)
    n_before = tl.zeros([], tl.int32)
    t_before = tl.zeros([], tl.int32)
    t_lim = tl.zeros([], tl.int32)
    base = tl.zeros([], tl.int32)
    while base < num_reqs:
        rr = base + c
        nt = _decode_tiles(qsl_ptr, seq_ptr, rr, num_reqs, window, TILE_N)
        before = total + tl.cumsum(nt, 0) <= a  # the request ends at or before tile a
        n_before += tl.sum(before.to(tl.int32), 0)
        t_before += tl.sum(tl.where(before, nt, 0), 0)
        t_lim += tl.sum(tl.where(rr < r_lim, nt, 0), 0)
        total += tl.sum(nt, 0)
        base += REQ_CHUNK
    return total, n_before, t_before, t_lim


@triton.jit
def _flat_share(total, num_programs, min_tiles):
    """Tiles per program of the flat split: an equal share, at least ``min_tiles``."""
    return tl.maximum(tl.cdiv(total, num_programs), min_tiles)


@triton.jit
def _merge_pieces(row0, count, hh, h_ok, d, d_ok, m_ptr, l_ptr, acc_ptr,
                  NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, D_PAD: tl.constexpr,
                  SPLIT_CHUNK: tl.constexpr, CACHE: tl.constexpr):
    """The merged ``(m, l, acc)`` of a request's ``count`` flat-split pieces, at partial rows
    ``row0 .. row0 + count - 1`` (``p + r`` for programs ``p_lo ..``) of heads ``hh``,
    ``SPLIT_CHUNK`` pieces an iteration. ``CACHE``: the loads' cache modifier."""
    c = tl.arange(0, SPLIT_CHUNK)
    m_run = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_PAD], tl.float32)
    sp = tl.zeros([], tl.int32)
    while sp < count:
        ok = ((sp + c) < count)[None, :]
        idx = (row0 + sp + c).to(tl.int64)[None, :] * NUM_HEADS + hh[:, None]
        live = h_ok[:, None] & ok
        m = tl.load(m_ptr + idx, mask=live, other=float("-inf"), cache_modifier=CACHE)
        l = tl.load(l_ptr + idx, mask=live, other=0.0, cache_modifier=CACHE)
        a = tl.load(acc_ptr + idx[:, :, None] * D_PAD + d[None, None, :],
                    mask=live[:, :, None] & d_ok[None, None, :], other=0.0,
                    cache_modifier=CACHE)
        m_run, l_run, acc = _merge_partials(m_run, l_run, acc, m, l, a, ok)
        sp += SPLIT_CHUNK
    return m_run, l_run, acc


@triton.jit(do_not_specialize=["num_reqs", "min_tiles", "window", "zero_rows", "num_slot_rows"])
def _decode_flat_kernel(
    q_ptr, q_s0, q_s1,
    k_ptr, v_ptr, c_sb, c_st, c_sh,
    bt_ptr, bt_s0, bt_width,
    qsl_ptr, seq_ptr, num_reqs, min_tiles, window,
    out_ptr, o_s0, o_s1,
    m_ptr, l_ptr, acc_ptr,
    sinks_ptr,
    scale_log2,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RANGE_LOOP: tl.constexpr,
    REQ_CHUNK: tl.constexpr,
    lse_ptr=None,
    lse_s0=0,
    WRITE_LSE: tl.constexpr = False,
    v_scale=1.0,
    KV_FP8: tl.constexpr = False,
    Q_FP16: tl.constexpr = False,
    PDL: tl.constexpr = 0,
    cnt_ptr=None,
    zero_rows=0,
    FUSED_REDUCE: tl.constexpr = False,
    GROUP_P2: tl.constexpr = 1,
    SPLIT_CHUNK: tl.constexpr = 8,
    TABLE_AHEAD: tl.constexpr = False,
    cos_ptr=None, cos_s0=0, cos_s1=0, sin_ptr=None, sin_s0=0, sin_s1=0,
    qw_ptr=None, kw_ptr=None, qk_eps=0.0, slot_ptr=None, num_slot_rows=0, num_slots=0,
    QK_PROLOGUE: tl.constexpr = False,
    QK_NORM: tl.constexpr = False,
):
    """The flat split, grid ``(P, Hkv)``: the decode requests' tiles laid end to end, program
    ``(p, h)`` takes flat tiles ``[p W, (p + 1) W)`` of KV head ``h`` (``W``:
    :func:`_flat_share`), request by request. A request it holds whole is written directly;
    each piece of a longer one goes to partial row ``p + r`` (unique: consecutive pieces
    advance ``p`` or ``r``) for ``_decode_flat_reduce_kernel``. With ``FUSED_REDUCE`` the
    program that stores a request's last piece merges its pieces itself (``arrive``; no
    reduce launch), and with ``zero_rows`` the programs zero the padded requests' rows
    (as the reduce kernel does otherwise)."""
    pdl_prologue(PDL)
    p = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    head = kvh * GROUP + g
    gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    if FUSED_REDUCE:
        if zero_rows != 0:  # a padded request (no query rows) zeroes row r no request owns
            n_rows = tl.load(qsl_ptr + num_reqs)
            rp = p
            while rp < num_reqs:
                if (tl.load(qsl_ptr + rp + 1) == tl.load(qsl_ptr + rp)) & (rp >= n_rows):
                    tl.store(out_ptr + rp.to(tl.int64) * o_s0 + head[:, None] * o_s1
                             + d[None, :], tl.zeros([GROUP_PAD, D_PAD], tl.float32)
                             .to(out_ptr.dtype.element_ty), mask=gd_mask)
                rp += tl.num_programs(0)
    total, _n, _t, _l = _flat_scan(qsl_ptr, seq_ptr, num_reqs, window, -1, 0, TILE_N, REQ_CHUNK)
    share = _flat_share(total, tl.num_programs(0), min_tiles)
    a = p * share
    if a >= total:
        return
    b = tl.minimum(a + share, total)
    _t2, r, cu, _l2 = _flat_scan(qsl_ptr, seq_ptr, num_reqs, window, a, 0, TILE_N, REQ_CHUNK)
    head_off = kvh.to(tl.int64) * c_sh
    while cu < b:  # request r's tiles are flat tiles [cu, cu + nt)
        nt = _decode_tiles(qsl_ptr, seq_ptr, r, num_reqs, window, TILE_N)
        if nt > 0:
            q_row = tl.load(qsl_ptr + r)
            seq_len = tl.load(seq_ptr + r)
            lo = _window_start(seq_len, window)
            s0 = tl.maximum(a - cu, 0)
            s1 = tl.minimum(b - cu, nt)
            q_in = 0.0
            if QK_PROLOGUE:
                q_in = _prologue(q_ptr, q_s0, q_row, head, g, kvh, s1 == nt, cos_ptr, cos_s0,
                                 cos_s1, sin_ptr, sin_s0, sin_s1, qw_ptr, kw_ptr, qk_eps,
                                 slot_ptr, num_slot_rows, num_slots, k_ptr, v_ptr, c_sb,
                                 c_st, head_off,
                                 NUM_HEADS, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, QK_NORM)
            acc, l_i, m_i = _decode_range(
                q_ptr, q_s0, q_s1, q_row, head, d, gd_mask, lo // TILE_N + s0,
                lo // TILE_N + s1, seq_len, lo, k_ptr, v_ptr, bt_ptr + r.to(tl.int64) * bt_s0,
                bt_width, c_sb, c_st, head_off, scale_log2, v_scale, GROUP_PAD, HEAD_DIM,
                D_PAD, BLOCK_SIZE, TILE_N, DOT_PREC, SOFTCAP, RANGE_LOOP, KV_FP8, Q_FP16,
                TABLE_AHEAD, q_in, QK_PROLOGUE)
            _decode_write(acc, l_i, m_i, (s0 == 0) & (s1 == nt),
                          (p + r).to(tl.int64) * NUM_HEADS + head, out_ptr, o_s0, o_s1, q_row,
                          head, g, d, gd_mask, m_ptr, l_ptr, acc_ptr, sinks_ptr, lse_ptr, lse_s0,
                          GROUP, D_PAD, HAS_SINKS, WRITE_LSE)
            if FUSED_REDUCE:
                if (s0 > 0) | (s1 < nt):  # a piece: the last to arrive merges the request
                    p_lo = cu // share
                    count = (cu + nt - 1) // share - p_lo + 1
                    if arrive(cnt_ptr + r.to(tl.int64) * (NUM_HEADS // GROUP) + kvh, count):
                        hh = kvh * GROUP + tl.arange(0, GROUP_P2)
                        h_ok = tl.arange(0, GROUP_P2) < GROUP
                        d_ok = d < HEAD_DIM
                        m_mg, l_mg, acc_mg = _merge_pieces(
                            p_lo + r, count, hh, h_ok, d, d_ok, m_ptr, l_ptr, acc_ptr,
                            NUM_HEADS, GROUP_P2, D_PAD, SPLIT_CHUNK, ".cg")
                        _store_merged(m_mg, l_mg, acc_mg, out_ptr, o_s0, o_s1, q_row, hh, h_ok,
                                      d, d_ok, sinks_ptr, lse_ptr, lse_s0, HAS_SINKS, WRITE_LSE)
        cu += nt
        r += 1


@triton.jit(do_not_specialize=["num_reqs", "num_programs", "min_tiles", "zero_rows", "window"])
def _decode_flat_reduce_kernel(
    qsl_ptr, seq_ptr, num_reqs, num_programs, min_tiles, zero_rows, window,
    out_ptr, o_s0, o_s1,
    m_ptr, l_ptr, acc_ptr,
    sinks_ptr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    REQ_CHUNK: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    lse_ptr=None,
    lse_s0=0,
    WRITE_LSE: tl.constexpr = False,
    BLOCK_H: tl.constexpr = 1,
    PDL: tl.constexpr = 0,
):
    """Program ``(r, b)`` merges the pieces of request ``r`` (query heads ``[b BLOCK_H,
    (b + 1) BLOCK_H)``) that ``_decode_flat_kernel``'s ``num_programs`` programs left: those of
    programs ``p_lo .. p_hi`` (the programs whose shares its flat tiles meet), at partial rows
    ``p + r``; a request held whole by one program was written directly. With ``zero_rows``, a
    padded request (no query rows) zeroes row ``r`` when no request owns it."""
    pdl_prologue(PDL)
    r = tl.program_id(0)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < NUM_HEADS
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_row = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_row
    if q_len != 1:
        if (zero_rows != 0) & (q_len == 0):
            if r >= tl.load(qsl_ptr + num_reqs):
                tl.store(out_ptr + r.to(tl.int64) * o_s0 + hh[:, None].to(tl.int64) * o_s1
                         + d[None, :], tl.zeros([BLOCK_H, D_PAD], tl.float32)
                         .to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
        return
    total, _n, _t, cu = _flat_scan(qsl_ptr, seq_ptr, num_reqs, window, -1, r, TILE_N, REQ_CHUNK)
    nt = _decode_tiles(qsl_ptr, seq_ptr, r, num_reqs, window, TILE_N)
    share = _flat_share(total, num_programs, min_tiles)
    p_lo = cu // share
    count = (cu + nt - 1) // share - p_lo + 1
    if (nt == 0) | (count <= 1):
        return  # written directly by the flat kernel
    m_run, l_run, acc = _merge_pieces(p_lo + r, count, hh, h_ok, d, d_ok, m_ptr, l_ptr,
                                      acc_ptr, NUM_HEADS, BLOCK_H, D_PAD, SPLIT_CHUNK, "")
    _store_merged(m_run, l_run, acc, out_ptr, o_s0, o_s1, q_row, hh, h_ok, d, d_ok, sinks_ptr,
                  lse_ptr, lse_s0, HAS_SINKS, WRITE_LSE)


@dataclass(frozen=True)
class QKPrologue:
    """What ``qk_norm_rope_cache`` takes besides the caches, handed to the decode kernels
    instead (``paged_decode_attention(prologue=...)``): each program reads its query heads from
    the raw QKV row, applies the q norm and RoPE itself, and the program whose tiles hold a
    request's new position writes that token's key (norm, RoPE) and value into the cache
    first. One launch less a layer on decode steps (the backend's
    ``forward_decode_prologue``; opt-in, ``DecoderForCausalLM.fuse_decode_prologue``).
    H100 (thirty-sixth session, ``bench/bench_decode_prologue_gpu.py``, Qwen3-0.6B's attention,
    lengths U[100, 2048], us a layer, two launches / fused): B1 11.4 / 10.7, B4 17.3 / 15.2,
    B16 29.0 / 27.6, B32 67.0 / 69.1, B64 114.2 / 115.2, B128 196.0 / 196.1, B256 371.0 /
    370.1; B1/L8192 20.4 / 20.5; W1 20,898 / 20,824 (one pair): the launch saved is paid back
    by the longer chain before the first product (the raw query, its norm and rotation) and,
    in the flat kernel, the register cap that keeps its wave (168 registers uncapped, 128
    capped without spills). Not a default.

    ``qkv [T, >= (H + 2 Hkv) D]``; ``slot_mapping``: the step's slots (rows past its length
    and slots outside the cache write nothing); ``cos`` / ``sin`` ``[T, D / 2]``; norm
    weights ``[D]`` or both None (no q/k norm). The kernels run it for power-of-two head sizes
    of at least 16 and caches in qkv's dtype (:meth:`fused`); otherwise
    :meth:`materialize` runs ``qk_norm_rope_cache`` ahead of the plain launch."""

    qkv: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_norm_weight: torch.Tensor | None
    k_norm_weight: torch.Tensor | None
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor

    def query(self) -> torch.Tensor:
        """The raw query heads, ``[T, H, D]``, a view of ``qkv``."""
        qkv = self.qkv
        return qkv.as_strided((qkv.shape[0], self.num_heads, self.head_dim),
                              (qkv.stride(0), self.head_dim, 1))

    def fused(self, kv_cache: torch.Tensor) -> bool:
        """Whether the decode kernels run this prologue themselves for ``kv_cache``."""
        d = self.head_dim
        return d >= 16 and d & (d - 1) == 0 and kv_cache.dtype == self.qkv.dtype

    def materialize(self, kv_cache: torch.Tensor, check: bool = True) -> torch.Tensor:
        """The unfused prologue: ``qk_norm_rope_cache`` (writes the step's K/V, returns q)."""
        from pagedkv.kernels.qk_norm_rope_cache import qk_norm_rope_cache

        return qk_norm_rope_cache(self.qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                  self.q_norm_weight, self.k_norm_weight, self.eps, self.cos,
                                  self.sin, self.slot_mapping, kv_cache[0], kv_cache[1],
                                  check=check)

    def check(self, fn: str, kv_cache: torch.Tensor) -> None:
        """Every argument, as ``qk_norm_rope_cache`` checks them (metadata only)."""
        from pagedkv.kernels.qk_norm_rope_cache import check_prologue

        check_prologue(fn, self.qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                       self.q_norm_weight, self.k_norm_weight, self.eps, self.cos, self.sin,
                       self.slot_mapping, kv_cache[0], kv_cache[1])

    def launch_args(self, kv_cache: torch.Tensor) -> dict:
        """The decode kernels' prologue arguments (``QK_PROLOGUE``)."""
        norm = self.q_norm_weight is not None
        qkv = self.qkv
        return dict(cos_ptr=self.cos, cos_s0=self.cos.stride(0), cos_s1=self.cos.stride(1),
                    sin_ptr=self.sin, sin_s0=self.sin.stride(0), sin_s1=self.sin.stride(1),
                    qw_ptr=self.q_norm_weight if norm else qkv,
                    kw_ptr=self.k_norm_weight if norm else qkv, qk_eps=float(self.eps),
                    slot_ptr=self.slot_mapping, num_slot_rows=self.slot_mapping.shape[0],
                    num_slots=kv_cache.shape[1] * kv_cache.shape[2], QK_PROLOGUE=True,
                    QK_NORM=norm)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    scale: float,
    out: torch.Tensor,
    *,
    max_seq_len: int | None = None,
    balanced: bool = False,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    zero_padded_rows: bool = False,
    check: bool = True,
    workspace: dict | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    order: torch.Tensor | None = None,
    prologue: QKPrologue | None = None,
) -> torch.Tensor:
    """Attention of each single-token request's query row over its paged context.

    Args:
        q, out: ``[T, H, D]`` (``out`` may alias nothing else; rows of other requests are left
            as they are). kv_cache: ``[2, num_blocks, block_size, Hkv, D]``, same dtype family
            (bf16 / fp16 / fp32; ``q`` is cast to the cache dtype for the products), or FP8
            (``float8_e4m3fn``: K / V cast to ``q``'s dtype, scaled by ``k_scale`` /
            ``v_scale``, host floats > 0 used by FP8 caches only).
        block_table: int32 ``[>= num_reqs, width]``; query_start_loc: int32
            ``[>= num_reqs + 1]``; seq_lens: int32 ``[>= num_reqs]`` (all on ``q``'s device).
        num_reqs: host int. scale: softmax scale.
        max_seq_len: host upper bound of the batch's ``seq_lens`` (optional; caps splitting).
        balanced: the decode requests' lengths are balanced (:func:`one_range_for` of their
            host lengths); one wave of one range per request where that is faster
            (:class:`DecodeConfig`). A host value: a CUDA graph bakes it in.
        num_splits: force the split count (1 .. 64); default ``choose_num_splits``.
        config: launch parameters; default per device.
        zero_padded_rows: a request ``r < num_reqs`` with no query rows (CUDA-graph padding)
            zeroes row ``r`` of ``out`` when ``r >= query_start_loc[num_reqs]`` (no request owns
            it): padding rows are zeroed inside the kernel, with no extra launch. Rows
            ``>= num_reqs`` are never touched.
        check: validate the arguments (False: the caller validated the same shapes already,
            e.g. the backend for every layer after the first of a step).
        workspace: a dict that keeps the split partial buffers between calls of one step
            (every layer reuses them; calls are stream-ordered).
        sliding_window: W: the query (at ``seq_len - 1``) sees positions ``>= seq_len - W``;
            only the tiles holding them are read and split (the rest may be the null block).
        logits_soft_cap: c: scores become ``c tanh(s / c)`` before the softmax.
        sinks: ``[H]`` attention sinks (GPT-OSS): per query head a logit (natural units, not
            scaled, not soft-capped) that joins the softmax's denominator only, as
            ``exp(sink)``; any float dtype, on ``q``'s device.
        lse: float32 ``[T, H]`` (:func:`check_lse`): receives each served row's natural-log
            log-sum-exp of its scores (sinks included), the log of its softmax denominator;
            other rows are left as they are (cascade attention merges with it).
        order: int32 ``[>= num_reqs]`` on ``q``'s device, a permutation of ``range(num_reqs)``
            (:func:`longest_first_order`): the split kernel's programs run request by request
            in this order (every split and KV head of ``order[0]`` first). Longest first puts
            the shortest programs at the launch's end. The result does not depend on it.
            Read only where ``config.use_order`` is on and ``num_reqs <= 65535`` (the grid's
            z limit); otherwise the launch is in row order.
        prologue: :class:`QKPrologue`: ``q`` is then its raw query view
            (:meth:`QKPrologue.query`) and the step's q/k norms, RoPE and K/V write happen in
            the decode kernels (or, where they cannot, in ``qk_norm_rope_cache`` first).
    Returns ``out``.
    """
    fn = "paged_decode_attention"
    if check:
        shape = check_attention_inputs(fn, q, kv_cache, block_table, query_start_loc, seq_lens,
                                       out, num_reqs)
        if num_splits is not None and (isinstance(num_splits, bool)
                                       or not isinstance(num_splits, int)
                                       or not 1 <= num_splits <= MAX_SPLITS):
            raise ConfigError(f"{fn}: num_splits must be an int in [1, {MAX_SPLITS}], got "
                              f"{num_splits!r}")
    else:
        shape = attn_shape(q, kv_cache)
    if num_reqs == 0:
        return out
    window = _check_window(fn, sliding_window)
    softcap = _check_softcap(fn, logits_soft_cap)
    if check:
        check_sinks(fn, sinks, q)
        check_lse(fn, lse, q)
        check_kv_scale(fn, "k_scale", k_scale)
        check_kv_scale(fn, "v_scale", v_scale)
        check_order(fn, order, num_reqs, q.device)
    if prologue is not None:
        if check:
            prologue.check(fn, kv_cache)
            if q.data_ptr() != prologue.qkv.data_ptr() or q.shape != (
                    prologue.qkv.shape[0], prologue.num_heads, prologue.head_dim) or q.stride() \
                    != (prologue.qkv.stride(0), prologue.head_dim, 1):
                raise ConfigError(f"{fn}: with a prologue, q must be its query view "
                                  "(QKPrologue.query())")
        if not (use_triton(_decode_kernel, q) and prologue.fused(kv_cache)):
            q = prologue.materialize(kv_cache, check=False)
            prologue = None
    if not use_triton(_decode_kernel, q):
        return paged_decode_attention_ref(q, kv_cache, block_table, query_start_loc, seq_lens,
                                          num_reqs, scale, out, zero_padded_rows=zero_padded_rows,
                                          sliding_window=sliding_window,
                                          logits_soft_cap=logits_soft_cap, sinks=sinks, lse=lse,
                                          k_scale=k_scale, v_scale=v_scale)
    fp8 = is_fp8_kv(kv_cache.dtype)
    cfg = config or default_decode_config(q.device, kv_cache.dtype)
    span = max_seq_len if not window or max_seq_len is None else min(max_seq_len, window)
    auto_splits, min_split_tokens = choose_split(num_reqs, shape.num_kv_heads, span,
                                                 num_sms(q.device), cfg, balanced)
    if num_splits is None:
        if flat_launch(num_reqs, shape.num_kv_heads, num_sms(q.device), cfg, auto_splits):
            return _flat_decode(q, kv_cache, block_table, query_start_loc, seq_lens, num_reqs,
                                scale, out, shape, cfg, zero_padded_rows, workspace, window,
                                softcap, sinks, lse, k_scale, v_scale, fp8, prologue)
        num_splits = auto_splits
    d_pad = max(16, next_pow2(shape.head_dim))
    min_split_tiles = max(1, cdiv(min_split_tokens, cfg.tile_n))
    if num_splits > 1:
        m_buf, l_buf, acc_buf = _partials(workspace, "decode_partials",
                                          num_reqs * shape.num_heads * num_splits, d_pad, q.device)
    else:
        m_buf = l_buf = acc_buf = out  # never touched: every request fits its one split
    ordered = order is not None and cfg.use_order and num_reqs <= MAX_GRID_Z
    grid = (num_splits, shape.num_kv_heads, num_reqs) if ordered \
        else (num_reqs, shape.num_kv_heads, num_splits)
    programs = num_reqs * shape.num_kv_heads * num_splits
    fused = num_splits > 1 and cfg.fuses_reduce(programs, num_sms(q.device))
    _decode_kernel[grid](
        qsl_ptr=query_start_loc, seq_ptr=seq_lens, num_reqs=num_reqs, num_splits=num_splits,
        min_split_tiles=min_split_tiles, zero_rows=int(bool(zero_padded_rows)), window=window,
        m_ptr=m_buf, l_ptr=l_buf, acc_ptr=acc_buf,
        RANGE_LOOP=not interpreted(_decode_kernel),
        order_ptr=order if ordered else None, ORDERED=ordered,
        cnt_ptr=_counters(workspace, num_reqs * shape.num_kv_heads, q.device) if fused else None,
        FUSED_REDUCE=fused, GROUP_P2=next_pow2(shape.group),
        SPLIT_CHUNK=cfg.merge_chunk_for(programs, num_sms(q.device), fused),
        **_attend_args(q, kv_cache, block_table, out, shape, cfg, scale, softcap, sinks, lse,
                       k_scale, v_scale, fp8, d_pad, prologue),
        **pdl_launch_args(_decode_kernel, q.device),
    )
    if num_splits > 1 and not fused:
        block_h = min(cfg.reduce_heads, next_pow2(shape.num_heads))
        _decode_reduce_kernel[(num_reqs, cdiv(shape.num_heads, block_h))](
            query_start_loc, seq_lens, num_reqs, num_splits, min_split_tiles, window,
            out, out.stride(0), out.stride(1),
            m_buf, l_buf, acc_buf,
            q if sinks is None else sinks,
            NUM_HEADS=shape.num_heads, HEAD_DIM=shape.head_dim, D_PAD=d_pad,
            TILE_N=cfg.tile_n, SPLIT_CHUNK=cfg.merge_chunk, HAS_SINKS=sinks is not None,
            lse_ptr=lse, lse_s0=0 if lse is None else lse.stride(0), WRITE_LSE=lse is not None,
            BLOCK_H=block_h, num_warps=4 if d_pad >= 128 else 1,
            **pdl_launch_args(_decode_reduce_kernel, q.device),
        )
    return out


def _partials(workspace, key: str, rows: int, d_pad: int, device: torch.device):
    """Float32 split partials ``(m [rows], l [rows], acc [rows, d_pad])``: ``workspace[key]``
    when it is large enough (every layer of a step reuses it), else new ones kept there."""
    bufs = None if workspace is None else workspace.get(key)
    if bufs is None or bufs[0].shape[0] < rows or bufs[2].shape[1] != d_pad \
            or bufs[0].device != device:
        bufs = (torch.empty(rows, dtype=torch.float32, device=device),
                torch.empty(rows, dtype=torch.float32, device=device),
                torch.empty(rows, d_pad, dtype=torch.float32, device=device))
        if workspace is not None:
            workspace[key] = bufs
    return bufs


def _counters(workspace, rows: int, device: torch.device) -> torch.Tensor:
    """The fused reduce's arrival counters (int32 ``[rows]``, one per request and KV head):
    zeros when made, and every launch leaves them at zero (the last range of each request and
    KV head resets its own), so ``workspace["decode_counters"]`` serves every later launch,
    CUDA-graph replays included."""
    cnt = None if workspace is None else workspace.get("decode_counters")
    if cnt is None or cnt.shape[0] < rows or cnt.device != device:
        cnt = torch.zeros(rows, dtype=torch.int32, device=device)
        if workspace is not None:
            workspace["decode_counters"] = cnt
    return cnt


def _attend_args(q, kv_cache, block_table, out, shape, cfg: DecodeConfig, scale, softcap, sinks,
                 lse, k_scale, v_scale, fp8, d_pad: int, prologue: QKPrologue | None = None
                 ) -> dict:
    """The arguments ``_decode_kernel`` and ``_decode_flat_kernel`` share, by name: the query,
    cache, table and output, the softmax scale (``k_scale`` folded in for an FP8 cache), the
    shape constants, the optional sinks / log-sum-exps and the fused prologue's."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    return dict(
        **({} if prologue is None else prologue.launch_args(kv_cache)),
        q_ptr=q, q_s0=q.stride(0), q_s1=q.stride(1),
        k_ptr=k_cache, v_ptr=v_cache, c_sb=k_cache.stride(0), c_st=k_cache.stride(1),
        c_sh=k_cache.stride(2),
        bt_ptr=block_table, bt_s0=block_table.stride(0), bt_width=block_table.shape[1],
        out_ptr=out, o_s0=out.stride(0), o_s1=out.stride(1),
        sinks_ptr=q if sinks is None else sinks,  # never read without sinks
        scale_log2=float(scale) * LOG2E * (float(k_scale) if fp8 else 1.0),
        SOFTCAP=softcap, HAS_SINKS=sinks is not None,
        NUM_HEADS=shape.num_heads, GROUP=shape.group, GROUP_PAD=max(16, next_pow2(shape.group)),
        HEAD_DIM=shape.head_dim, D_PAD=d_pad, BLOCK_SIZE=shape.block_size, TILE_N=cfg.tile_n,
        DOT_PREC=dot_precision(q.dtype if fp8 else kv_cache.dtype),
        lse_ptr=lse, lse_s0=0 if lse is None else lse.stride(0), WRITE_LSE=lse is not None,
        v_scale=float(v_scale), KV_FP8=fp8, Q_FP16=fp8 and q.dtype == torch.bfloat16,
        TABLE_AHEAD=cfg.table_ahead, num_warps=cfg.num_warps, num_stages=cfg.kernel_stages())


def _flat_decode(q, kv_cache, block_table, query_start_loc, seq_lens, num_reqs, scale, out,
                 shape, cfg: DecodeConfig, zero_padded_rows, workspace, window, softcap, sinks,
                 lse, k_scale, v_scale, fp8, prologue=None):
    """:func:`paged_decode_attention`'s flat-split launches (``DecodeConfig.flat_split``):
    ``_decode_flat_kernel`` over ``(flat_programs, Hkv)`` and ``_decode_flat_reduce_kernel``
    over every request."""
    progs = flat_programs(shape.num_kv_heads, num_sms(q.device), cfg)
    min_tiles = max(1, cdiv(cfg.flat_min_split_tokens, cfg.tile_n))
    d_pad = max(16, next_pow2(shape.head_dim))
    m_buf, l_buf, acc_buf = _partials(workspace, "decode_flat_partials",
                                      (progs + num_reqs) * shape.num_heads,  # row (p + r) a head
                                      d_pad, q.device)
    interp = interpreted(_decode_flat_kernel)
    req_chunk = 16 if interp else 256
    fused = cfg.fused_reduce
    _decode_flat_kernel[(progs, shape.num_kv_heads)](
        qsl_ptr=query_start_loc, seq_ptr=seq_lens, num_reqs=num_reqs, min_tiles=min_tiles,
        window=window, m_ptr=m_buf, l_ptr=l_buf, acc_ptr=acc_buf,
        RANGE_LOOP=not interp, REQ_CHUNK=req_chunk,
        cnt_ptr=_counters(workspace, num_reqs * shape.num_kv_heads, q.device) if fused else None,
        zero_rows=int(bool(zero_padded_rows)), FUSED_REDUCE=fused,
        GROUP_P2=next_pow2(shape.group), SPLIT_CHUNK=cfg.merge_chunk,
        **_attend_args(q, kv_cache, block_table, out, shape, cfg, scale, softcap, sinks, lse,
                       k_scale, v_scale, fp8, d_pad, prologue),
        **({} if interp or cfg.flat_registers(prologue is not None) is None
           else {"maxnreg": cfg.flat_registers(prologue is not None)}),
        **pdl_launch_args(_decode_flat_kernel, q.device),
    )
    if fused:
        return out
    block_h = min(cfg.reduce_heads, next_pow2(shape.num_heads))
    _decode_flat_reduce_kernel[(num_reqs, cdiv(shape.num_heads, block_h))](
        query_start_loc, seq_lens, num_reqs, progs, min_tiles, int(bool(zero_padded_rows)),
        window, out, out.stride(0), out.stride(1), m_buf, l_buf, acc_buf,
        q if sinks is None else sinks,
        NUM_HEADS=shape.num_heads, HEAD_DIM=shape.head_dim, D_PAD=d_pad, TILE_N=cfg.tile_n,
        REQ_CHUNK=req_chunk, SPLIT_CHUNK=cfg.merge_chunk, HAS_SINKS=sinks is not None,
        lse_ptr=lse, lse_s0=0 if lse is None else lse.stride(0), WRITE_LSE=lse is not None,
        BLOCK_H=block_h, num_warps=4 if d_pad >= 128 else 1,
        **pdl_launch_args(_decode_flat_reduce_kernel, q.device),
    )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    scale: float,
    out: torch.Tensor,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    zero_padded_rows: bool = False,
    check: bool = True,
    workspace: dict | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Plain torch twin of :func:`paged_decode_attention` (``paged_attention_ref`` on the
    single-token requests; reads lengths back to the host). The launch hints are ignored."""
    check_attention_inputs("paged_decode_attention_ref", q, kv_cache, block_table,
                           query_start_loc, seq_lens, out, num_reqs)
    if num_reqs == 0:
        return out
    qsl = query_start_loc[: num_reqs + 1].cpu()
    lens = seq_lens[:num_reqs].cpu()
    if zero_padded_rows:
        end = int(qsl[num_reqs])
        for r in range(min(num_reqs, out.shape[0])):
            if int(qsl[r + 1]) == int(qsl[r]) and r >= end:
                out[r] = 0
    rows = [int(qsl[r]) for r in range(num_reqs) if int(qsl[r + 1]) - int(qsl[r]) == 1]
    if not rows:
        return out
    decode = [r for r in range(num_reqs) if int(qsl[r + 1]) - int(qsl[r]) == 1]
    sub_qsl = torch.arange(len(decode) + 1, dtype=torch.int32)
    meta = SimpleNamespace(
        query_start_loc=sub_qsl, query_start_loc_cpu=sub_qsl, num_reqs=len(decode),
        seq_lens_cpu=lens[decode], block_table_tensor=block_table[decode],
    )
    idx = torch.tensor(rows, dtype=torch.int64, device=q.device)
    sub_lse = None if lse is None else torch.empty(len(rows), q.shape[1], dtype=torch.float32,
                                                   device=q.device)
    res = paged_attention_ref(q[idx], kv_cache, meta, scale, sliding_window=sliding_window,
                              logits_soft_cap=logits_soft_cap, sinks=sinks, lse=sub_lse,
                              k_scale=k_scale, v_scale=v_scale)
    out[idx] = res.to(out.dtype)
    if lse is not None:
        lse[idx] = sub_lse
    return out


def _check_window(fn: str, window) -> int:
    """The kernels' window argument: W >= 1, or 0 for none."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"{fn}: sliding_window must be an int >= 1 or None, got {window!r}")
    return window


def check_sinks(fn: str, sinks, q: torch.Tensor) -> None:
    """``sinks``: None or a float tensor ``[H]`` (one logit per query head) on ``q``'s device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() \
            or tuple(sinks.shape) != (q.shape[1],) or sinks.device != q.device:
        raise ConfigError(f"{fn}: sinks must be a float tensor [num_heads={q.shape[1]}] on "
                          f"{q.device}, got {getattr(sinks, 'dtype', type(sinks).__name__)} "
                          f"{tuple(getattr(sinks, 'shape', ()))} on {getattr(sinks, 'device', '-')}")
    if sinks.stride(0) != 1:
        raise ConfigError(f"{fn}: sinks must be contiguous")


def check_lse(fn: str, lse, q: torch.Tensor) -> None:
    """``lse``: None or a float32 tensor ``[T, H]`` (``q``'s rows and heads) on ``q``'s device,
    contiguous over heads."""
    if lse is None:
        return
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 \
            or tuple(lse.shape) != tuple(q.shape[:2]) or lse.device != q.device \
            or lse.stride(1) != 1:
        raise ConfigError(f"{fn}: lse must be a float32 tensor [num_tokens={q.shape[0]}, "
                          f"num_heads={q.shape[1]}] on {q.device}, contiguous over heads; got "
                          f"{getattr(lse, 'dtype', type(lse).__name__)} "
                          f"{tuple(getattr(lse, 'shape', ()))} on {getattr(lse, 'device', '-')}")


def _check_softcap(fn: str, cap) -> float:
    """The kernels' soft-cap argument: c > 0, or 0.0 for none."""
    if cap is None:
        return 0.0
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ConfigError(f"{fn}: logits_soft_cap must be a number > 0 or None, got {cap!r}")
    return float(cap)


__all__ = [
    "DecodeConfig",
    "INTERPRET_DECODE_CONFIG",
    "MAX_SPLITS",
    "QKPrologue",
    "choose_num_splits",
    "check_lse",
    "check_sinks",
    "choose_split",
    "default_decode_config",
    "FP8_DECODE_CONFIG",
    "flat_launch",
    "flat_pieces",
    "flat_programs",
    "busiest_sm_excess_fits",
    "lengths_balanced",
    "lpt_fits",
    "one_range_for",
    "one_range_possible",
    "one_range_if_balanced",
    "paged_decode_attention",
    "paged_decode_attention_ref",
]
