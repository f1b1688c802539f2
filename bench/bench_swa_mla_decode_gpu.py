#!/usr/bin/env python
"""GPU benchmark: decode bandwidth of sliding-window paged decode and MLA latent decode, against
the bytes each kernel actually reads.

(a) Sliding-window decode (``paged_decode_attention(..., sliding_window=W)``), bf16, block 16:
    * Gemma-3-1B local layers: 4 query / 1 KV head, head_dim 256, W 512;
    * Mistral-7B-like: 32 query / 8 KV heads, head_dim 128, W 4096;
    at several batch sizes and context lengths L > W. Request ``r`` has
    ``seq_len = L - (7 r) % 16`` (the window's first block is cut at different offsets). As
    the sliding-window manager leaves them, the block-table columns wholly before the window
    are the null block (block 0), and block 0 and every slot before the window are NaN: a
    kernel that read one would give NaN. Bytes read are counted from the block tables: per
    request, the window's slots ``[max(0, seq_len - W), seq_len)`` of the non-null blocks,
    ``2 (K, V) x Hkv x D x 2 bytes`` each (the kernel's masked loads skip the rest of the
    window's first block; ``block_bytes`` = the whole blocks touched, also reported).
(b) MLA decode over the latent cache (``mla_decode_attention``, its default launch for the
    head count), DeepSeek-V3 size: latent ``kv_lora_rank 512 + rope 64 = 576`` per token,
    bf16, 16 and 128 query heads, block 16. Bytes read = ``sum(seq_lens) x 576 x 2`` (each
    latent row once; each of a request's ``programs_per_req`` programs (head tiles x value
    chunks) loads every row of its ranges, from L2 where they run together:
    ``loaded_bytes`` reports that count).

Timing: ``bench_attention_gpu.time_graph`` (one CUDA graph of R calls over disjoint pages of one
big cache, R chosen so that the pages touched exceed 0.5 GB: cold L2; us per call = replay time
/ R, median of trials), the fraction of 4.27 TB/s (``COPY_TBPS``). Each kernel's output is
checked against its torch twin (``paged_decode_attention_ref`` / ``mla_decode_attention_ref``,
fp32) on a sample of requests first: relative error must stay under 2e-2.

``--sweep`` (MLA only): every launch variant of ``MLA_DECODE_VARIANTS`` (heads a program, value
chunks, tile, warps, stages, register cap; each with its split policy: ``gqa`` = the paged
decode kernel's, ``packed`` / ``wide`` / ``triple`` = about one wave of 2 / 1 / 3 programs an
SM) at its policy's split count (marked ``*``) and at forced counts 1, 2, 4 ... 64 (ranges of
>= 64 positions, at most ``SWEEP_MAX_PROGRAMS`` programs), for 16 and 128 heads at
B1/L8192, B16/L8192, B64 and B128 at L2048 and L8192; each run checked against the twin
first. Printed per case, fastest first, then one line a case: the best run, the best at a
policy's own count, the default launch's and the first version's (``h16-v1-t32-w4-s2/gqa``);
last the compiled variants' registers, spills, shared memory and MMA kind.
``--sweep-heads 128`` / ``--sweep-variants NAME,...`` narrow it (to split one run in two).

``--tiny``: small shapes in fp32, one eager pass timed on the host: the script's whole path on a
CPU (kernels through the Triton interpreter, set here when no GPU is present) for the smoke
tests (tests/attention/test_bench_swa_mla_decode.py; ``--tiny --sweep``:
tests/attention/test_mla_triton_decode.py); its numbers mean nothing.

Run on the GPU machine from the repository root:
    python bench/bench_swa_mla_decode_gpu.py --out bench/results/swa_mla_decode_gpu.json
    python bench/bench_swa_mla_decode_gpu.py --sweep --out bench/results/mla_decode_sweep.json
A table is printed last; JSON with every number goes to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)
if not torch.cuda.is_available():  # CPU (--tiny): the kernels run through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from bench_attention_gpu import COLD_BYTES, COPY_TBPS, log, rel_err, time_graph  # noqa: E402
from pagedkv.attention._triton_common import num_sms  # noqa: E402
from pagedkv.attention.mla_triton_decode import (  # noqa: E402
    MLA_DECODE_VARIANTS,
    SPLIT_PACKED,
    SPLIT_TRIPLE,
    SPLIT_WIDE,
    MLADecodeConfig,
    _mla_decode_kernel,
    default_mla_decode_config,
    mla_decode_attention,
    mla_decode_attention_ref,
    mla_launch,
)
from pagedkv.attention.triton_decode import (  # noqa: E402
    MAX_SPLITS,
    DecodeConfig,
    choose_num_splits,
    choose_split,
    default_decode_config,
    one_range_for,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from pagedkv.kernels._common import cdiv  # noqa: E402

# a tiny working set replays many calls per graph to leave L2 cold (each call is a few us)
MAX_ROT = 256
TOL = 2e-2
JITTER = 7  # seq_len of request r: L - (JITTER * r) % block_size


@dataclass(frozen=True)
class SwaShape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    window: int
    cases: tuple  # (batch, ctx)


@dataclass(frozen=True)
class MlaShape:
    name: str
    heads: int
    rank: int
    rope: int
    cases: tuple


SWA_SHAPES = (
    SwaShape("gemma3-1b-local", 4, 1, 256, 512,
             tuple((b, L) for b in (1, 16, 64, 256) for L in (2048, 8192, 32768))),
    SwaShape("mistral-swa", 32, 8, 128, 4096,
             tuple((b, L) for b in (1, 16, 64) for L in (8192, 32768)) + ((128, 8192),)),
)
MLA_SHAPES = tuple(
    MlaShape(f"dsv3-mla-h{h}", h, 512, 64,
             tuple((b, L) for b in (1, 16, 64, 128) for L in (2048, 8192)))
    for h in (16, 128))
TINY_SWA = (SwaShape("tiny-swa", 4, 1, 32, 24, ((2, 64), (3, 40))),
            SwaShape("tiny-swa-gqa", 8, 2, 16, 20, ((2, 48),)))
TINY_MLA = (MlaShape("tiny-mla-h16", 16, 32, 16, ((2, 40),)),
            MlaShape("tiny-mla-h20", 20, 32, 16, ((2, 24),)))


def seq_lens_of(batch: int, ctx: int, block_size: int) -> list[int]:
    return [ctx - (JITTER * r) % block_size for r in range(batch)]


def window_read(table: torch.Tensor, seq_lens: list[int], window: int | None,
                block_size: int) -> dict:
    """What a decode query reads, counted from the block table (host copy): per request the
    slots of positions ``[max(0, seq_len - window), seq_len)`` (all positions without a
    window), the distinct non-null blocks holding them, and the table entries outside the
    window that are the null block."""
    tab = table.cpu().tolist()
    tokens = blocks = null_outside = 0
    seen: set[int] = set()
    for r, n in enumerate(seq_lens):
        lo = max(0, n - window) if window else 0
        row = tab[r]
        for col in range(lo // block_size, cdiv(n, block_size)):
            blk = row[col]
            if blk == 0:
                raise ValueError(f"request {r}: window column {col} is the null block")
            first, last = max(lo, col * block_size), min(n, (col + 1) * block_size)
            tokens += last - first
            if blk not in seen:
                seen.add(blk)
                blocks += 1
        null_outside += sum(1 for col in range(lo // block_size) if row[col] == 0)
    return {"tokens": tokens, "blocks": blocks, "null_entries_outside": null_outside}


class Rotations:
    """R rotations of (query, block table, output) over disjoint pages of one cache: the
    columns each request reads get distinct blocks, every other column is the null block 0."""

    def __init__(self, batch: int, seq_lens: list[int], window: int | None, block_size: int,
                 row_bytes: int, device: str, cold_bytes: int, seed: int):
        self.batch, self.seq_lens, self.bs = batch, seq_lens, block_size
        width = cdiv(max(seq_lens), block_size)
        cols = []  # per request, the table columns the query reads
        for n in seq_lens:
            lo = max(0, n - window) if window else 0
            cols.append(range(lo // block_size, cdiv(n, block_size)))
        per_rot = sum(len(c) for c in cols)
        self.read_bytes_per_rot = per_rot * block_size * row_bytes
        self.rot = max(2, min(MAX_ROT, math.ceil(cold_bytes / self.read_bytes_per_rot)))
        self.num_blocks = 1 + self.rot * per_rot
        gen = torch.Generator().manual_seed(seed)
        perm = (torch.randperm(self.num_blocks - 1, generator=gen) + 1).to(torch.int32)
        self.tables, at = [], 0
        for _ in range(self.rot):
            t = torch.zeros((batch, width), dtype=torch.int32)
            for r, c in enumerate(cols):
                t[r, c.start:c.stop] = perm[at:at + len(c)]
                at += len(c)
            self.tables.append(t.to(device))
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)

    def poison_outside(self, cache_tokens: torch.Tensor, window: int | None) -> None:
        """NaN into block 0 and into every slot of a read block before its request's window
        (``cache_tokens``: the cache viewed ``[num_blocks, block_size, ...]``)."""
        cache_tokens[0] = float("nan")
        if not window:
            return
        for t in self.tables:
            tab = t.cpu()
            for r, n in enumerate(self.seq_lens):
                lo = max(0, n - window)
                if lo % self.bs:
                    cache_tokens[int(tab[r, lo // self.bs]), : lo % self.bs] = float("nan")


def time_calls(calls, cuda: bool) -> float:
    """us per call: CUDA-graph replays on a GPU (``time_graph``), one eager pass on the host
    otherwise (``--tiny`` on a CPU: meaningless numbers, the path is what is tested)."""
    if cuda:
        return time_graph(calls)
    t = time.perf_counter()
    for fn in calls:
        fn()
    return (time.perf_counter() - t) * 1e6 / len(calls)


def sample_args(rot: Rotations, i: int, n: int):
    """block table, query_start_loc and seq_lens of the first ``n`` requests of rotation i."""
    return rot.tables[i][:n], rot.qsl[: n + 1], rot.seq[:n]


def bench_swa_case(shape: SwaShape, batch: int, ctx: int, dtype, device: str, block_size: int,
                   cold_bytes: int, sample: int = 4) -> dict:
    t0 = time.time()
    cuda = device == "cuda"
    H, HKV, D, W = shape.heads, shape.kv_heads, shape.head_dim, shape.window
    elem = torch.finfo(dtype).bits // 8
    row_bytes = 2 * HKV * D * elem  # K and V of one token
    lens = seq_lens_of(batch, ctx, block_size)
    rot = Rotations(batch, lens, W, block_size, row_bytes, device, cold_bytes, seed=batch + ctx)
    gen = torch.Generator(device=device).manual_seed(0)
    cache = torch.randn((2, rot.num_blocks, block_size, HKV, D), generator=gen, device=device,
                        dtype=dtype)
    rot.poison_outside(cache.permute(1, 2, 0, 3, 4), W)  # [num_blocks, block_size, 2, ...]
    qs = [torch.randn((batch, H, D), generator=gen, device=device, dtype=dtype)
          for _ in range(rot.rot)]
    outs = [torch.full_like(q, float("nan")) for q in qs]
    scale = D ** -0.5
    cfg = default_decode_config(torch.device(device))
    balanced = one_range_for(lens, batch, HKV, num_sms(torch.device(device)), cfg)

    def call(i):
        return lambda: paged_decode_attention(
            qs[i], cache, rot.tables[i], rot.qsl, rot.seq, batch, scale, outs[i],
            max_seq_len=max(lens), balanced=balanced, sliding_window=W)

    read = window_read(rot.tables[0], lens, W, block_size)
    row = {"shape": shape.name, "heads": H, "kv_heads": HKV, "head_dim": D, "window": W,
           "block_size": block_size, "batch": batch, "ctx": ctx, "seq_lens_min": min(lens),
           "rotations": rot.rot, "window_tokens": read["tokens"], "blocks_read": read["blocks"],
           "null_entries_outside": read["null_entries_outside"],
           "bytes": read["tokens"] * row_bytes,
           "block_bytes": read["blocks"] * block_size * row_bytes,
           "full_context_bytes": sum(lens) * row_bytes,
           "splits_auto": choose_num_splits(batch, HKV, min(max(lens), W),
                                            num_sms(torch.device(device)), cfg, balanced)}
    call(0)()
    n = min(sample, batch)
    ref = torch.full((n, H, D), float("nan"), device=device, dtype=torch.float32)
    paged_decode_attention_ref(qs[0][:n].float(), cache, *sample_args(rot, 0, n), n, scale, ref,
                               sliding_window=W)
    row["rel_err"] = rel_err(outs[0][:n], ref)
    row["us"] = time_calls([call(i) for i in range(rot.rot)], cuda)
    row["tbps"] = row["bytes"] / (row["us"] * 1e-6) / 1e12
    row["frac"] = row["tbps"] / COPY_TBPS
    row["frac_blocks"] = row["block_bytes"] / (row["us"] * 1e-6) / 1e12 / COPY_TBPS
    log(f"swa {shape.name} B{batch}/L{ctx}: {row['us']:.1f} us, {row['frac']:.0%} of "
        f"{COPY_TBPS} TB/s ({row['bytes'] / 1e6:.1f} MB read), err {row['rel_err']:.1e}, "
        f"splits {row['splits_auto']}, rot {rot.rot}  [{time.time() - t0:.0f}s]")
    return row


class MlaSetup:
    """One MLA case: R rotations of (absorbed query, block table, output) over disjoint pages
    of one NaN-poisoned latent cache (block 0), lengths ``seq_lens_of``; calls of any launch
    config and split count, their check against the fp32 twin and their timing."""

    def __init__(self, shape: MlaShape, batch: int, ctx: int, dtype, device: str,
                 block_size: int, cold_bytes: int, sample: int = 4):
        self.shape, self.batch, self.device = shape, batch, device
        H, L, R = shape.heads, shape.rank, shape.rope
        self.row_bytes = (L + R) * (torch.finfo(dtype).bits // 8)
        self.lens = seq_lens_of(batch, ctx, block_size)
        self.rot = Rotations(batch, self.lens, None, block_size, self.row_bytes, device,
                             cold_bytes, seed=batch + ctx)
        gen = torch.Generator(device=device).manual_seed(0)
        self.cache = torch.randn((self.rot.num_blocks, block_size, L + R), generator=gen,
                                 device=device, dtype=dtype)
        self.rot.poison_outside(self.cache, None)
        self.qs = [torch.randn((batch, H, L + R), generator=gen, device=device, dtype=dtype)
                   for _ in range(self.rot.rot)]
        self.outs = [torch.full((batch, H, L), float("nan"), device=device, dtype=dtype)
                     for _ in range(self.rot.rot)]
        self.scale = (128 + R) ** -0.5  # DeepSeek-V3: qk_nope_head_dim 128 + qk_rope_head_dim
        self.read = window_read(self.rot.tables[0], self.lens, None, block_size)
        self.bytes = self.read["tokens"] * self.row_bytes
        n = self.n_ref = min(sample, batch)
        self.ref = torch.full((n, H, L), float("nan"), device=device, dtype=torch.float32)
        mla_decode_attention_ref(self.qs[0][:n].float(), self.cache,
                                 *sample_args(self.rot, 0, n), n, self.scale, self.ref,
                                 kv_lora_rank=L)

    def config(self, config: MLADecodeConfig | None) -> MLADecodeConfig:
        return config or default_mla_decode_config(torch.device(self.device), self.shape.heads,
                                                   self.batch)

    def auto_splits(self, config: MLADecodeConfig | None) -> int:
        cfg = self.config(config)
        launch = mla_launch(cfg, self.shape.heads, self.shape.rank, self.shape.rope)
        return choose_split(self.batch, launch.programs_per_req, max(self.lens),
                            num_sms(torch.device(self.device)), cfg.split)[0]

    def call(self, i: int, config: MLADecodeConfig | None = None, num_splits: int | None = None):
        return lambda: mla_decode_attention(
            self.qs[i], self.cache, self.rot.tables[i], self.rot.qsl, self.rot.seq, self.batch,
            self.scale, self.outs[i], kv_lora_rank=self.shape.rank, max_seq_len=max(self.lens),
            num_splits=num_splits, config=config)

    def check(self, config: MLADecodeConfig | None = None, num_splits: int | None = None) -> float:
        """Relative error of rotation 0's output (NaN-filled first) against the twin."""
        self.outs[0].fill_(float("nan"))
        self.call(0, config, num_splits)()
        return rel_err(self.outs[0][: self.n_ref], self.ref)

    def time(self, config: MLADecodeConfig | None = None, num_splits: int | None = None,
             **kw) -> float:
        calls = [self.call(i, config, num_splits) for i in range(self.rot.rot)]
        return time_graph(calls, **kw) if self.device == "cuda" else time_calls(calls, False)

    def frac(self, us: float) -> float:
        return self.bytes / (us * 1e-6) / 1e12 / COPY_TBPS


def bench_mla_case(shape: MlaShape, batch: int, ctx: int, dtype, device: str, block_size: int,
                   cold_bytes: int, sample: int = 4) -> dict:
    t0 = time.time()
    st = MlaSetup(shape, batch, ctx, dtype, device, block_size, cold_bytes, sample)
    cfg = st.config(None)
    launch = mla_launch(cfg, shape.heads, shape.rank, shape.rope)
    read = st.read
    row = {"shape": shape.name, "heads": shape.heads, "kv_lora_rank": shape.rank,
           "rope": shape.rope, "block_size": block_size, "batch": batch, "ctx": ctx,
           "seq_lens_min": min(st.lens), "rotations": st.rot.rot, "tokens": read["tokens"],
           "blocks_read": read["blocks"], "bytes": st.bytes,
           "block_bytes": read["blocks"] * block_size * st.row_bytes,
           "config": cfg.name, "head_tiles": launch.head_tiles,
           "programs_per_req": launch.programs_per_req,
           # each program of a request loads every latent byte of its ranges once
           "loaded_bytes": st.bytes * launch.programs_per_req,
           "splits_auto": st.auto_splits(None)}
    row["rel_err"] = st.check()
    row["us"] = st.time()
    row["tbps"] = row["bytes"] / (row["us"] * 1e-6) / 1e12
    row["frac"] = row["tbps"] / COPY_TBPS
    log(f"mla {shape.name} B{batch}/L{ctx}: {row['us']:.1f} us, {row['frac']:.0%} of "
        f"{COPY_TBPS} TB/s ({row['bytes'] / 1e6:.1f} MB latent), err {row['rel_err']:.1e}, "
        f"{cfg.name}, splits {row['splits_auto']}, rot {st.rot.rot}  [{time.time() - t0:.0f}s]")
    return row


# --sweep: every launch variant of the MLA kernel (MLA_DECODE_VARIANTS) at its split policy's
# count and at forced counts, on these cases for both head counts
SWEEP_CASES = ((1, 8192), (16, 8192), (64, 2048), (64, 8192), (128, 2048), (128, 8192))
TINY_SWEEP_CASES = ((2, 40),)
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64)
SWEEP_MAX_PROGRAMS = 12 * 132  # forced splits beyond ~4 waves of 3 programs an SM: not timed


def variant_label(cfg: MLADecodeConfig) -> str:
    """A variant's kernel name and split policy (the default GQA policy: ``gqa``)."""
    for name, policy in SPLIT_POLICY_NAMES:
        if cfg.split == policy:
            return f"{cfg.name}/{name}"
    return f"{cfg.name}/custom"


SPLIT_POLICY_NAMES = (("gqa", DecodeConfig()), ("packed", SPLIT_PACKED), ("wide", SPLIT_WIDE),
                      ("triple", SPLIT_TRIPLE))


def compiled_stats(kernel, known: set) -> dict | None:
    """Registers, spills, shared memory and MMA kinds of the kernel variant compiled since
    ``known`` (the cache keys seen before; updated), or None when nothing new was compiled
    (the variant was compiled before, for the other head count)."""
    try:
        stats = None
        for entry in kernel.device_caches.values():
            for key, ck in entry[0].items():
                if key in known:
                    continue
                known.add(key)
                ptx = ck.asm.get("ptx", "")
                stats = {"n_regs": getattr(ck, "n_regs", None),
                         "n_spills": getattr(ck, "n_spills", None),
                         "shared": getattr(ck.metadata, "shared", None),
                         "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync")}
        return stats
    except Exception as e:  # noqa: BLE001 - the interpreter has no compiled kernels
        return {"error": f"{type(e).__name__}: {e}"}


def sweep_mla_case(shape: MlaShape, batch: int, ctx: int, variants, dtype, device: str,
                   block_size: int, cold_bytes: int, compiled: dict, known: set) -> dict:
    """Every variant at its policy's split count and at forced counts (1, 2, 4 ... while the
    launch stays within ``SWEEP_MAX_PROGRAMS`` programs and ranges of >= 64 positions)."""
    t0 = time.time()
    cuda = device == "cuda"
    st = MlaSetup(shape, batch, ctx, dtype, device, block_size, cold_bytes)
    default = st.config(None)
    res = {"shape": shape.name, "heads": shape.heads, "batch": batch, "ctx": ctx,
           "bytes": st.bytes, "rotations": st.rot.rot, "default": variant_label(default),
           "runs": []}
    timing = dict(min_ms=10.0, trials=5) if cuda else {}
    for cfg in variants:
        label = variant_label(cfg)
        launch = mla_launch(cfg, shape.heads, shape.rank, shape.rope)
        auto = st.auto_splits(cfg)
        forced = [sp for sp in SWEEP_SPLITS if sp != auto and sp <= MAX_SPLITS
                  and batch * launch.programs_per_req * sp <= SWEEP_MAX_PROGRAMS
                  and (sp == 1 or ctx // sp >= 64)]
        for splits in [None] + forced:
            run = {"variant": label, "splits": auto if splits is None else splits,
                   "auto": splits is None, "programs": batch * launch.programs_per_req
                   * (auto if splits is None else splits)}
            try:
                # a forced count uses every range it asks for (minimum range: one tile)
                cfg_run = cfg if splits is None else dataclasses.replace(
                    cfg, split=dataclasses.replace(cfg.split, min_split_tokens=cfg.tile_n))
                run["rel_err"] = st.check(cfg_run, splits)
                stats = compiled_stats(_mla_decode_kernel, known) if cuda else None
                if stats is not None:
                    compiled.setdefault(cfg.name, stats)
                run["us"] = st.time(cfg_run, splits, **timing)
                run["frac"] = st.frac(run["us"])
            except Exception as e:  # noqa: BLE001 - report it, keep the other variants
                run["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
            res["runs"].append(run)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    ok = [r for r in res["runs"] if "us" in r and r["rel_err"] < TOL]
    if ok:
        best = min(ok, key=lambda r: r["us"])
        res["best"] = {k: best[k] for k in ("variant", "splits", "us", "frac")}
        auto_ok = [r for r in ok if r["auto"]]
        best_auto = min(auto_ok, key=lambda r: r["us"]) if auto_ok else None
        if best_auto:
            res["best_auto"] = {k: best_auto[k] for k in ("variant", "splits", "us", "frac")}
        for r in auto_ok:
            if r["variant"] == res["default"]:
                res["default_run"] = {k: r[k] for k in ("splits", "us", "frac")}
    res["failures"] = [f"{r['variant']} splits {r['splits']}" for r in res["runs"]
                       if "error" in r or not r["rel_err"] < TOL]
    log(f"sweep {shape.name} B{batch}/L{ctx}: {len(res['runs'])} runs, best "
        f"{res.get('best', {}).get('variant')} splits {res.get('best', {}).get('splits')} "
        f"{res.get('best', {}).get('us', float('nan')):.1f} us "
        f"({res.get('best', {}).get('frac', float('nan')):.0%}), failures "
        f"{len(res['failures'])}  [{time.time() - t0:.0f}s]")
    del st
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def print_sweep(results: dict) -> None:
    """Per case every run (fastest first), then one line a case: the best run, the best at a
    policy's own split count, the default's, and the first version's (``h16-v1-t32-w4-s2/gqa``)."""
    meta = results["meta"]
    print()
    print(f"MLA decode sweep on {meta['device']}, triton {meta['triton']}; {meta['dtype']}, "
          f"block {meta['block_size']}; us per call, fraction of {COPY_TBPS} TB/s for the latent "
          f"bytes read once (sum(seq_lens) x 576 x 2)")
    for case in results["sweep"]:
        print(f"\n== {case['shape']} B{case['batch']}/L{case['ctx']} "
              f"({case['bytes'] / 1e6:.1f} MB latent), default {case['default']}")
        print(f"   {'variant / split policy':<34} {'splits':>8} {'programs':>8} {'us':>9} "
              f"{'frac':>5} {'err':>8}")
        runs = sorted(case["runs"], key=lambda r: r.get("us", float("inf")))
        for r in runs:
            tag = f"{r['splits']}{'*' if r['auto'] else ''}"
            if "error" in r:
                print(f"   {r['variant']:<34} {tag:>8} {r['programs']:>8}  error: {r['error']}")
            else:
                print(f"   {r['variant']:<34} {tag:>8} {r['programs']:>8} {r['us']:9.1f} "
                      f"{r['frac']:5.0%} {r['rel_err']:8.1e}")
    print("\n(* = the variant's own split policy; other counts forced)")
    first = "h16-v1-t32-w4-s2/gqa"
    hdr = (f"{'shape':<14}| {'B':>4} | {'L':>5} | {'best (any splits)':<40} | "
           f"{'best at policy splits':<40} | {'default':<20} | {'first version':<20}")
    print()
    print(hdr)
    print("-" * len(hdr))

    def cell(r, name=True):
        if not r:
            return "-"
        head = f"{r['variant']} x{r['splits']} " if name else f"x{r['splits']} "
        return f"{head}{r['us']:.1f} us {r['frac']:.0%}"

    for case in results["sweep"]:
        old = next((r for r in case["runs"] if r["variant"] == first and r["auto"]
                    and "us" in r), None)
        print(f"{case['shape']:<14}| {case['batch']:>4} | {case['ctx']:>5} | "
              f"{cell(case.get('best')):<40} | {cell(case.get('best_auto')):<40} | "
              f"{cell(case.get('default_run'), False):<20} | {cell(old, False):<20}")
    comp = results.get("compiled", {})
    if comp:
        print("\ncompiled variants (registers a thread, spills, shared memory bytes, MMA kind):")
        for name, c in comp.items():
            print(f"   {name:<26} {c}")


def run_sweep(shapes, cases, variants, **kw) -> tuple[list[dict], dict]:
    rows, compiled, known = [], {}, set()
    for shape in shapes:
        for batch, ctx in cases:
            try:
                rows.append(sweep_mla_case(shape, batch, ctx, variants, compiled=compiled,
                                           known=known, **kw))
            except Exception:  # noqa: BLE001 - keep the other cases
                rows.append({"shape": shape.name, "heads": shape.heads, "batch": batch,
                             "ctx": ctx, "runs": [], "failures": ["setup"],
                             "error": traceback.format_exc()})
                log(rows[-1]["error"])
    return rows, compiled


def run_cases(kind: str, shapes, fn, **kw) -> list[dict]:
    rows = []
    for shape in shapes:
        for batch, ctx in shape.cases:
            try:
                rows.append(fn(shape, batch, ctx, **kw))
            except Exception:  # noqa: BLE001 - keep the other cases
                rows.append({"shape": shape.name, "batch": batch, "ctx": ctx,
                             "error": traceback.format_exc()})
                log(rows[-1]["error"])
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def print_table(results: dict) -> None:
    meta = results["meta"]
    print()
    print(f"decode on {meta['device']}, torch {meta['torch']}, triton {meta['triton']}; "
          f"{meta['dtype']}, block {meta['block_size']}; us per call, fraction of "
          f"{COPY_TBPS} TB/s for the bytes read")
    hdr = (f"{'kernel / shape':<20}| {'B':>4} | {'L':>6} | {'MB read':>9} | {'us':>9} | "
           f"{'TB/s':>5} | {'frac':>5} | {'splits':>6} | {'err':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in results.get("swa", []) + results.get("mla", []):
        if "error" in r:
            print(f"{r['shape']:<20}| {r['batch']:>4} | {r['ctx']:>6} | error: "
                  f"{r['error'].strip().splitlines()[-1]}")
            continue
        print(f"{r['shape']:<20}| {r['batch']:>4} | {r['ctx']:>6} | {r['bytes'] / 1e6:9.2f} | "
              f"{r['us']:9.1f} | {r['tbps']:5.2f} | {r['frac']:5.0%} | {r['splits_auto']:>6} | "
              f"{r['rel_err']:7.1e}")
    print("swa: bytes = window slots of non-null blocks x 2 x Hkv x D x 2 (full-context bytes in "
          "the JSON); mla: bytes = sum(seq_lens) x (512 + 64) x 2, each latent row once")


def write_json(path: str, results: dict) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=2, default=str)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/swa_mla_decode_gpu.json")
    ap.add_argument("--tiny", action="store_true",
                    help="small fp32 shapes, eager; runs on a CPU through the interpreter")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--skip-swa", action="store_true")
    ap.add_argument("--skip-mla", action="store_true")
    ap.add_argument("--sweep", action="store_true",
                    help="MLA only: time every launch variant (MLA_DECODE_VARIANTS) at its "
                         "split policy and at forced split counts, 16 and 128 heads")
    ap.add_argument("--sweep-heads", default=None,
                    help="with --sweep: comma-separated head counts (default: the MLA shapes')")
    ap.add_argument("--sweep-variants", default=None,
                    help="with --sweep: comma-separated variant names (MLADecodeConfig.name, "
                         "optionally /policy) to time; default all")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if not args.tiny and not cuda:
        raise SystemExit("needs a CUDA GPU with compiled Triton (or pass --tiny)")
    device = "cuda" if cuda else "cpu"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    swa_shapes, mla_shapes = (TINY_SWA, TINY_MLA) if args.tiny else (SWA_SHAPES, MLA_SHAPES)
    cold = 0 if args.tiny else COLD_BYTES  # tiny: two rotations
    meta = {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "interpreted": not cuda, "tiny": args.tiny, "dtype": str(dtype).removeprefix("torch."),
            "block_size": args.block_size, "copy_ceiling_tbps": COPY_TBPS,
            "cold_bytes": cold, "max_rotations": MAX_ROT,
            "swa_shapes": [asdict(s) for s in swa_shapes],
            "mla_shapes": [asdict(s) for s in mla_shapes]}
    results: dict = {"meta": meta}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save = lambda: write_json(args.out, results)  # noqa: E731 - after each part
    t0 = time.time()
    kw = dict(dtype=dtype, device=device, block_size=args.block_size, cold_bytes=cold)
    if args.sweep:
        return sweep_main(args, results, mla_shapes, save, t0, kw)
    if not args.skip_swa:
        results["swa"] = run_cases("swa", swa_shapes, bench_swa_case, **kw)
        save()
    if not args.skip_mla:
        results["mla"] = run_cases("mla", mla_shapes, bench_mla_case, **kw)
        save()
    bad = [f"{r['shape']} B{r['batch']}/L{r['ctx']}"
           for r in results.get("swa", []) + results.get("mla", [])
           if "error" in r or not r["rel_err"] < TOL]
    finish(args, results, bad, save, t0, print_table, "CORRECTNESS FAILURES")
    if bad:
        raise SystemExit(1)
    return results


def finish(args, results: dict, bad: list, save, t0: float, printer, failures: str) -> None:
    """Record the elapsed time and the failures, write the JSON, print the table."""
    results["elapsed_s"] = time.time() - t0
    results["correctness_failures"] = bad
    save()
    printer(results)
    print(f"JSON: {args.out}  ({results['elapsed_s']:.0f} s)")
    if bad:
        print(f"{failures}: " + ", ".join(bad))


def sweep_main(args, results: dict, mla_shapes, save, t0: float, kw: dict) -> dict:
    heads = ([int(h) for h in args.sweep_heads.split(",")] if args.sweep_heads
             else [s.heads for s in mla_shapes])
    base = mla_shapes[0]
    shapes = [MlaShape(f"{base.name.rsplit('-h', 1)[0]}-h{h}", h, base.rank, base.rope, ())
              for h in heads]
    variants = list(MLA_DECODE_VARIANTS)
    if args.sweep_variants:
        want = set(args.sweep_variants.split(","))
        variants = [c for c in variants if c.name in want or variant_label(c) in want]
        if not variants:
            raise SystemExit(f"--sweep-variants matches none of "
                             f"{[variant_label(c) for c in MLA_DECODE_VARIANTS]}")
    results["meta"]["sweep_variants"] = [variant_label(c) for c in variants]
    cases = TINY_SWEEP_CASES if args.tiny else SWEEP_CASES
    results["sweep"], results["compiled"] = run_sweep(shapes, cases, variants, **kw)
    bad = [f"{c['shape']} B{c['batch']}/L{c['ctx']}: {f}" for c in results["sweep"]
           for f in c["failures"]]
    finish(args, results, bad, save, t0, print_sweep,
           "FAILURES (errors or rel_err >= 2e-2; the other runs stand)")
    return results


if __name__ == "__main__":
    main()
