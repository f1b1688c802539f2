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
(b) MLA decode over the latent cache (``mla_decode_attention``), DeepSeek-V3 size: latent
    ``kv_lora_rank 512 + rope 64 = 576`` per token, bf16, 16 and 128 query heads, block 16.
    Bytes read = ``sum(seq_lens) x 576 x 2`` (each latent row once; a program serves 16 query
    heads, so 128 heads load each row 8 times, from L2 where the head tiles of one request run
    together: ``loaded_bytes`` reports that count).

Timing: ``bench_attention_gpu.time_graph`` (one CUDA graph of R calls over disjoint pages of one
big cache, R chosen so that the pages touched exceed 0.5 GB: cold L2; us per call = replay time
/ R, median of trials), the fraction of 4.27 TB/s (``COPY_TBPS``). Each kernel's output is
checked against its torch twin (``paged_decode_attention_ref`` / ``mla_decode_attention_ref``,
fp32) on a sample of requests first: relative error must stay under 2e-2.

``--tiny``: small shapes in fp32, one eager pass timed on the host: the script's whole path on a
CPU (kernels through the Triton interpreter, set here when no GPU is present) for the smoke test
tests/attention/test_bench_swa_mla_decode.py; its numbers mean nothing.

Run on the GPU machine from the repository root:
    python bench/bench_swa_mla_decode_gpu.py --out bench/results/swa_mla_decode_gpu.json
A table is printed last; JSON with every number goes to --out.
"""

from __future__ import annotations

import argparse
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
    default_mla_decode_config,
    mla_decode_attention,
    mla_decode_attention_ref,
)
from pagedkv.attention.triton_decode import (  # noqa: E402
    choose_num_splits,
    default_decode_config,
    lengths_balanced,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from pagedkv.kernels._common import cdiv, next_pow2  # noqa: E402

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
    balanced = lengths_balanced(lens, cfg)

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


def bench_mla_case(shape: MlaShape, batch: int, ctx: int, dtype, device: str, block_size: int,
                   cold_bytes: int, sample: int = 4) -> dict:
    t0 = time.time()
    cuda = device == "cuda"
    H, L, R = shape.heads, shape.rank, shape.rope
    elem = torch.finfo(dtype).bits // 8
    row_bytes = (L + R) * elem
    lens = seq_lens_of(batch, ctx, block_size)
    rot = Rotations(batch, lens, None, block_size, row_bytes, device, cold_bytes, seed=batch + ctx)
    gen = torch.Generator(device=device).manual_seed(0)
    cache = torch.randn((rot.num_blocks, block_size, L + R), generator=gen, device=device,
                        dtype=dtype)
    rot.poison_outside(cache, None)
    qs = [torch.randn((batch, H, L + R), generator=gen, device=device, dtype=dtype)
          for _ in range(rot.rot)]
    outs = [torch.full((batch, H, L), float("nan"), device=device, dtype=dtype)
            for _ in range(rot.rot)]
    scale = (128 + R) ** -0.5  # DeepSeek-V3: qk_nope_head_dim 128 + qk_rope_head_dim

    def call(i):
        return lambda: mla_decode_attention(qs[i], cache, rot.tables[i], rot.qsl, rot.seq, batch,
                                            scale, outs[i], kv_lora_rank=L, max_seq_len=max(lens))

    read = window_read(rot.tables[0], lens, None, block_size)
    cfg = default_mla_decode_config(torch.device(device))
    head_tiles = cdiv(H, min(cfg.block_h, max(16, next_pow2(H))))
    row = {"shape": shape.name, "heads": H, "kv_lora_rank": L, "rope": R,
           "block_size": block_size, "batch": batch, "ctx": ctx, "seq_lens_min": min(lens),
           "rotations": rot.rot, "tokens": read["tokens"], "blocks_read": read["blocks"],
           "bytes": read["tokens"] * row_bytes,
           "block_bytes": read["blocks"] * block_size * row_bytes,
           "head_tiles": head_tiles, "loaded_bytes": read["tokens"] * row_bytes * head_tiles,
           "splits_auto": choose_num_splits(batch, head_tiles, max(lens),
                                            num_sms(torch.device(device)), cfg.split)}
    call(0)()
    n = min(sample, batch)
    ref = torch.full((n, H, L), float("nan"), device=device, dtype=torch.float32)
    mla_decode_attention_ref(qs[0][:n].float(), cache, *sample_args(rot, 0, n), n, scale,
                             ref, kv_lora_rank=L)
    row["rel_err"] = rel_err(outs[0][:n], ref)
    row["us"] = time_calls([call(i) for i in range(rot.rot)], cuda)
    row["tbps"] = row["bytes"] / (row["us"] * 1e-6) / 1e12
    row["frac"] = row["tbps"] / COPY_TBPS
    log(f"mla {shape.name} B{batch}/L{ctx}: {row['us']:.1f} us, {row['frac']:.0%} of "
        f"{COPY_TBPS} TB/s ({row['bytes'] / 1e6:.1f} MB latent), err {row['rel_err']:.1e}, "
        f"splits {row['splits_auto']}, rot {rot.rot}  [{time.time() - t0:.0f}s]")
    return row


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
    if not args.skip_swa:
        results["swa"] = run_cases("swa", swa_shapes, bench_swa_case, **kw)
        save()
    if not args.skip_mla:
        results["mla"] = run_cases("mla", mla_shapes, bench_mla_case, **kw)
        save()
    results["elapsed_s"] = time.time() - t0
    bad = [f"{r['shape']} B{r['batch']}/L{r['ctx']}"
           for r in results.get("swa", []) + results.get("mla", [])
           if "error" in r or not r["rel_err"] < TOL]
    results["correctness_failures"] = bad
    save()
    print_table(results)
    print(f"JSON: {args.out}  ({results['elapsed_s']:.0f} s)")
    if bad:
        print("CORRECTNESS FAILURES: " + ", ".join(bad))
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
