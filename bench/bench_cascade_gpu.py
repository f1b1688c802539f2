#!/usr/bin/env python
"""GPU benchmark: one decode step's attention on W3's shape, plain paged attention vs cascade
(shared-prefix) attention, with the bytes each reads.

W3 (``pagedkv bench --workload w3``): 256 requests on one 2,048-token system prompt + U[50, 200]
unique tokens, 256 output tokens each. Here one decode step at ``--generated`` g tokens into
the output (default 1, 128, 255): request ``r`` holds ``2048 + u_r + g`` positions, the first
128 blocks (block 16) shared by all (the same physical blocks, as prefix caching leaves them),
its own ``u_r + g`` positions in its own shuffled blocks; Qwen3-0.6B's attention, 16 query /
8 KV heads x 128, bf16. The null block 0 and every unused slot are NaN.

* plain: ``TritonAttentionBackend(cascade=None)``: the decode kernel reads each request's
  whole context: ``sum(seq_len) x 8 x 128 x 2 (K, V) x 2 bytes`` (~2.4 GB at g 128);
* cascade: ``TritonAttentionBackend()`` (default ``CascadeConfig``; the plan takes cascade):
  the prefix kernel reads the 2,048 shared positions once for the whole batch (8 MB), the
  decode kernel each request's own ``u_r + g`` positions, the merge the float32 partials
  (reported apart: ``merge_bytes`` = 2 outputs + 2 log-sum-exps written and read, the merged
  bf16 output written).

Timing: each timed call makes the step's plan (as the runner does once per step and group)
and runs ``--layers`` layers over distinct KV caches of the same layout (distinct pages: each
layer's reads are cold in L2, as in a model), all in one CUDA graph
(``bench_attention_gpu.time_graph``); us per layer = call time / layers. The pieces of a
cascade layer (prefix, suffix, merge) are timed alone too, on parts made outside the graph.
Before timing, the cascade output is checked against the plain one and against the torch
twin (``paged_attention_ref``, fp32) on a sample of requests (relative error < 2e-2).
``--sweep-prefix``: the prefix launch alone under several tile configs and key-split counts
(``CascadeConfig.prefix_config`` / ``max_prefix_splits`` to tune), each checked merged.

``--tiny``: small shapes in fp32 through the Triton interpreter on a CPU (one eager pass timed
on the host): the script's whole path for tests/attention/test_bench_cascade.py; its numbers
mean nothing.

Run on the GPU machine from the repository root:
    python bench/bench_cascade_gpu.py --out bench/results/cascade_gpu.json
A table is printed last; JSON with every number goes to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)
if not torch.cuda.is_available():  # CPU (--tiny): the kernels run through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from bench_attention_gpu import COPY_TBPS, log, rel_err  # noqa: E402
from bench_swa_mla_decode_gpu import time_calls  # noqa: E402
from pagedkv.attention import allocate_kv_caches, build_attention_metadata  # noqa: E402
from pagedkv.attention.backend import AttentionLayout  # noqa: E402
from pagedkv.attention.merge_states import merge_attention_states  # noqa: E402
from pagedkv.attention.torch_ref import paged_attention_ref  # noqa: E402
from pagedkv.attention.triton_backend import CascadeConfig, TritonAttentionBackend  # noqa: E402
from pagedkv.attention.triton_decode import DecodeConfig, paged_decode_attention  # noqa: E402
from pagedkv.attention.triton_prefill import PrefillConfig, paged_prefill_attention  # noqa: E402
from pagedkv.kernels._common import cdiv  # noqa: E402

TOL = 2e-2


@dataclass(frozen=True)
class Shape:
    name: str
    num_reqs: int
    shared: int  # shared prefix positions (a multiple of the block size)
    unique: tuple  # U[lo, hi] own prompt positions
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    generated: tuple  # decode steps into the output measured


W3 = Shape("w3-qwen3-0.6b", 256, 2048, (50, 200), 16, 8, 128, 16, (1, 128, 255))
TINY = Shape("tiny", 6, 32, (3, 10), 4, 2, 16, 16, (1, 5))


class Step:
    """One decode step of ``shape`` at ``generated`` output tokens: ``layers`` KV caches of
    the same layout (same tables, distinct data), the queries, the metadata (the runner's
    ``common_prefix_len`` = the shared positions, every context past them)."""

    def __init__(self, shape: Shape, generated: int, layers: int, dtype, device, seed=0):
        rng = random.Random(seed)
        bs = shape.block_size
        own = [rng.randint(*shape.unique) + generated for _ in range(shape.num_reqs)]
        self.seq_lens = [shape.shared + u for u in own]  # the query is the last position
        shared_blocks = shape.shared // bs
        own_blocks = [cdiv(u, bs) for u in own]
        num_blocks = 1 + shared_blocks + sum(own_blocks)
        perm = list(range(1, num_blocks))
        rng.shuffle(perm)
        width = shared_blocks + max(own_blocks)
        table = torch.zeros(shape.num_reqs, width, dtype=torch.int32)
        shared_ids = torch.tensor(perm[:shared_blocks], dtype=torch.int32)
        at = shared_blocks
        for r, nb in enumerate(own_blocks):
            table[r, :shared_blocks] = shared_ids
            table[r, shared_blocks:shared_blocks + nb] = torch.tensor(perm[at:at + nb],
                                                                      dtype=torch.int32)
            at += nb
        gen = torch.Generator(device=device).manual_seed(seed)
        self.caches = allocate_kv_caches(layers, num_blocks, bs, shape.kv_heads, shape.head_dim,
                                         dtype=dtype, device=device, fill=float("nan"))
        used = torch.zeros(num_blocks, bs, dtype=torch.bool)
        for r, n in enumerate(self.seq_lens):
            pos = torch.arange(n)
            used[table[r, pos // bs].long(), pos % bs] = True
        used = used.to(device)
        for cache in self.caches:
            vals = torch.randn(cache.shape, generator=gen, device=device, dtype=torch.float32)
            cache.copy_(torch.where(used[None, :, :, None, None], vals.to(dtype), cache))
        self.q = torch.randn(shape.num_reqs, shape.heads, shape.head_dim, generator=gen,
                             device=device, dtype=torch.float32).to(dtype)
        self.meta = build_attention_metadata([1] * shape.num_reqs, self.seq_lens, table,
                                             torch.full((shape.num_reqs,), -1, dtype=torch.int64),
                                             device=device, common_prefix_len=shape.shared)
        self.layout = AttentionLayout.of(self.q, self.caches[0])
        self.scale = shape.head_dim ** -0.5
        row = shape.kv_heads * shape.head_dim * 2 * dtype.itemsize  # K and V of one position
        total = sum(self.seq_lens)
        self.plain_bytes = total * row
        self.cascade_kv_bytes = (shape.shared + total - shape.num_reqs * shape.shared) * row
        T, H, D = self.q.shape
        self.merge_bytes = (2 * 2 * T * H * D * 4 + 2 * 2 * T * H * 4
                            + T * H * D * dtype.itemsize)

    def layer_calls(self, backend: TritonAttentionBackend):
        """One callable: the step's plan, then every layer's forward (k = v = None: the step's
        K/V are in the caches already)."""
        outs = [None] * len(self.caches)

        def call():
            plan = backend.plan(self.meta, self.layout)
            for i, cache in enumerate(self.caches):
                outs[i] = backend.forward(i, self.q, None, None, cache, plan, self.scale)
        return call, outs


def time_fn(fn, cuda: bool) -> float:
    """us per call of ``fn`` (``time_calls``: graph replays on a GPU, else one eager pass)."""
    return time_calls([fn], cuda)


def reference_error(step: Step, out: torch.Tensor, sample: int) -> float:
    n = min(sample, len(step.seq_lens))
    qsl = torch.arange(n + 1, dtype=torch.int32)
    meta = SimpleNamespace(query_start_loc_cpu=qsl, num_reqs=n,
                           seq_lens_cpu=torch.tensor(step.seq_lens[:n], dtype=torch.int32),
                           block_table_tensor=step.meta.block_table_tensor[:n])
    ref = paged_attention_ref(step.q[:n].float(), step.caches[0].float(), meta, step.scale)
    return rel_err(out[:n], ref)


def bench_case(shape: Shape, generated: int, layers: int, dtype, device: str, cuda: bool,
               sweep: bool = False, force: bool = False, sweep_suffix_too: bool = False) -> dict:
    """One step's plain and cascade layers (``force``: cascade thresholds off, for the tiny
    shapes; else the default ``CascadeConfig``, which W3's step passes)."""
    step = Step(shape, generated, layers, dtype, device, seed=generated)
    plain_b = TritonAttentionBackend(cascade=None)
    cascade_b = TritonAttentionBackend(cascade=CascadeConfig(
        min_prefix_tokens=1, min_reqs=1, min_saved_us=0.0) if force else CascadeConfig())
    plan = cascade_b.plan(step.meta, step.layout)
    res = {"shape": shape.name, "generated": generated, "num_reqs": shape.num_reqs,
           "shared": shape.shared, "layers": layers, "mean_seq_len":
           sum(step.seq_lens) / len(step.seq_lens), "cascade_taken": plan.cascade,
           "plain_bytes": step.plain_bytes, "cascade_kv_bytes": step.cascade_kv_bytes,
           "merge_bytes": step.merge_bytes}
    plain_call, plain_outs = step.layer_calls(plain_b)
    casc_call, casc_outs = step.layer_calls(cascade_b)
    plain_call()
    casc_call()
    if cuda:
        torch.cuda.synchronize()
    res["rel_err_vs_plain"] = rel_err(casc_outs[0], plain_outs[0])
    res["rel_err_vs_ref"] = reference_error(step, casc_outs[0], 8)
    res["plain_rel_err_vs_ref"] = reference_error(step, plain_outs[0], 8)
    res["plain_us"] = time_fn(plain_call, cuda) / layers
    res["cascade_us"] = time_fn(casc_call, cuda) / layers
    # the prefix launch in the main stream's order (CascadeConfig.concurrent_prefix off)
    serial_b = TritonAttentionBackend(cascade=replace(cascade_b.cascade, concurrent_prefix=False))
    serial_call, serial_outs = step.layer_calls(serial_b)
    serial_call()
    if cuda:
        torch.cuda.synchronize()
    res["serial_equal"] = bool(torch.equal(serial_outs[0], casc_outs[0]))
    res["cascade_serial_us"] = time_fn(serial_call, cuda) / layers
    # the pieces of one cascade layer, on parts made outside the graph
    parts = plan.cascade_parts(step.q, step.caches[0])
    meta, q, cache, scale = step.meta, step.q, step.caches[0], step.scale
    n = shape.num_reqs
    out = torch.empty_like(q)
    res["prefix_splits"] = parts.splits
    res["prefix_config"] = asdict(parts.prefix_config)
    res["prefix_us"] = time_fn(lambda: paged_prefill_attention(
        q, cache, parts.prefix_table, parts.prefix_qsl, parts.prefix_len, 1, scale,
        parts.prefix_out, num_tokens=n, causal=False, lse=parts.prefix_lse, check=False,
        config=parts.prefix_config, kv_splits=parts.splits), cuda)
    res["suffix_us"] = time_fn(lambda: paged_decode_attention(
        q, cache, parts.suffix_table, meta.query_start_loc, parts.suffix_seq_lens, n, scale,
        parts.suffix_out, max_seq_len=max(step.seq_lens) - shape.shared, check=False,
        lse=parts.suffix_lse), cuda)
    res["merge_us"] = time_fn(lambda: merge_attention_states(
        out, parts.prefix_out, parts.prefix_lse, parts.suffix_out, parts.suffix_lse, n,
        end=parts.end, check=False), cuda)
    for k in ("plain", "cascade"):
        nbytes = step.plain_bytes if k == "plain" else step.cascade_kv_bytes
        res[f"{k}_tbps"] = nbytes / res[f"{k}_us"] / 1e6
        res[f"{k}_frac_copy"] = res[f"{k}_tbps"] / COPY_TBPS
    res["speedup"] = res["plain_us"] / res["cascade_us"]
    res["ok"] = (plan.cascade and res["rel_err_vs_plain"] < TOL and res["rel_err_vs_ref"] < TOL
                 and res["serial_equal"])
    if sweep:
        res["prefix_sweep"] = sweep_prefix(step, parts, cuda, tiny=force)
    if sweep_suffix_too:
        res["suffix_sweep"] = sweep_suffix(step, parts, cuda, tiny=force)
    return res


# (block_m, block_n, num_warps, num_stages, pack_heads) x key splits tried by --sweep-prefix
PREFIX_TILES = ((64, 64, 4, 3, 1), (64, 64, 4, 4, 1), (64, 64, 4, 2, 1), (64, 32, 4, 4, 1),
                (128, 64, 8, 3, 1), (64, 64, 8, 3, 2), (128, 64, 8, 2, 2))
PREFIX_SPLITS = (1, 2, 4, 8)
TINY_TILES = ((16, 16, 1, 1, 1), (16, 16, 1, 1, 2))


def sweep_prefix(step: Step, parts, cuda: bool, tiny: bool = False) -> list[dict]:
    """The prefix piece alone under each tile config and split count (fastest first), each
    merged result checked against the default's."""
    q, cache, scale = step.q, step.caches[0], step.scale
    n = q.shape[0]
    tiles = TINY_TILES if tiny else PREFIX_TILES
    rows = []
    for bm, bn, w, st, pack in tiles:
        cfg = PrefillConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st, pack_heads=pack)
        for splits in PREFIX_SPLITS:
            lead = (splits,) if splits > 1 else ()
            out = torch.empty(*lead, *q.shape, dtype=torch.float32, device=q.device)
            lse = torch.empty(*lead, *q.shape[:2], dtype=torch.float32, device=q.device)

            def run(cfg=cfg, splits=splits, out=out, lse=lse):
                paged_prefill_attention(q, cache, parts.prefix_table, parts.prefix_qsl,
                                        parts.prefix_len, 1, scale, out, num_tokens=n,
                                        causal=False, lse=lse, check=False, config=cfg,
                                        kv_splits=splits)
            try:
                run()
                merged = torch.empty_like(parts.suffix_out)
                merge_attention_states(merged, out, lse, parts.suffix_out, parts.suffix_lse, n)
                ref = torch.empty_like(parts.suffix_out)
                merge_attention_states(ref, parts.prefix_out, parts.prefix_lse, parts.suffix_out,
                                       parts.suffix_lse, n)
                err = rel_err(merged, ref)
                us = time_fn(run, cuda)
                rows.append({"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st,
                             "pack_heads": pack, "splits": splits, "us": us, "rel_err": err})
            except Exception as e:  # a config that does not compile / fit
                rows.append({"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st,
                             "pack_heads": pack, "splits": splits,
                             "error": f"{type(e).__name__}: {e}"})
    return sorted(rows, key=lambda r: r.get("us", float("inf")))


# (tile_n, num_warps, num_stages) x split counts tried by --sweep-suffix
SUFFIX_TILES = ((32, 4, 5), (64, 4, 4), (16, 4, 6), (32, 2, 5))
SUFFIX_SPLITS = (1, 2, 4, 8, 16)


def sweep_suffix(step: Step, parts, cuda: bool, tiny: bool = False) -> list[dict]:
    """The suffix decode launch alone under each tile config and forced split count (fastest
    first), each output checked against the default launch's."""
    q, cache, scale, meta = step.q, step.caches[0], step.scale, step.meta
    n = q.shape[0]
    max_len = max(step.seq_lens) - int(parts.prefix_len.item())
    rows = []
    ref = torch.empty_like(parts.suffix_out)
    ref_lse = torch.empty_like(parts.suffix_lse)
    paged_decode_attention(q, cache, parts.suffix_table, meta.query_start_loc,
                           parts.suffix_seq_lens, n, scale, ref, max_seq_len=max_len,
                           check=False, lse=ref_lse)
    for tile, w, st in (((16, 1, 1),) if tiny else SUFFIX_TILES):
        cfg = DecodeConfig(tile_n=tile, num_warps=w, num_stages=st)
        for splits in SUFFIX_SPLITS:
            out = torch.empty_like(parts.suffix_out)
            lse = torch.empty_like(parts.suffix_lse)

            def run(cfg=cfg, splits=splits, out=out, lse=lse):
                paged_decode_attention(q, cache, parts.suffix_table, meta.query_start_loc,
                                       parts.suffix_seq_lens, n, scale, out, max_seq_len=max_len,
                                       check=False, lse=lse, config=cfg, num_splits=splits)
            try:
                run()
                err = rel_err(out, ref)
                us = time_fn(run, cuda)
                rows.append({"tile_n": tile, "num_warps": w, "num_stages": st, "splits": splits,
                             "us": us, "rel_err": err})
            except Exception as e:  # a config that does not compile / fit
                rows.append({"tile_n": tile, "num_warps": w, "num_stages": st, "splits": splits,
                             "error": f"{type(e).__name__}: {e}"})
    return sorted(rows, key=lambda r: r.get("us", float("inf")))


def print_table(results: dict) -> None:
    head = (f"{'shape':16} {'gen':>4} {'mean L':>7} {'plain us':>9} {'GB':>6} {'frac':>5} "
            f"{'casc us':>8} {'serial':>7} {'GB':>6} {'prefix':>7} {'suffix':>7} {'merge':>6} {'x':>5} "
            f"{'err':>8}")
    print(head)
    print("-" * len(head))
    for r in results["cases"]:
        if "error" in r:
            print(f"{r['shape']:16} {r['generated']:>4} ERROR {r['error']}")
            continue
        print(f"{r['shape']:16} {r['generated']:>4} {r['mean_seq_len']:>7.0f} "
              f"{r['plain_us']:>9.1f} {r['plain_bytes'] / 1e9:>6.3f} {r['plain_frac_copy']:>5.2f} "
              f"{r['cascade_us']:>8.1f} {r['cascade_serial_us']:>7.1f} "
              f"{r['cascade_kv_bytes'] / 1e9:>6.3f} "
              f"{r['prefix_us']:>7.1f} {r['suffix_us']:>7.1f} {r['merge_us']:>6.1f} "
              f"{r['speedup']:>5.2f} {r['rel_err_vs_ref']:>8.1e}")
    print("us per layer (28 layers per Qwen3-0.6B step); frac: plain bytes / time / 4.27 TB/s; "
          "x: plain / cascade; serial: cascade with the prefix launch not concurrent")
    for r in results["cases"]:
        for row in r.get("suffix_sweep", [])[:6]:
            print(f"  suffix g{r['generated']}: tile {row['tile_n']} w{row['num_warps']} "
                  f"s{row['num_stages']} splits {row['splits']}: "
                  f"{row.get('us', float('nan')):.1f} us (err {row.get('rel_err', float('nan')):.1e})")
        for row in r.get("prefix_sweep", [])[:5]:
            print(f"  prefix g{r['generated']}: tiles {row['block_m']}x{row['block_n']} "
                  f"w{row['num_warps']} s{row['num_stages']} splits {row['splits']}: "
                  f"{row.get('us', float('nan')):.1f} us (err {row.get('rel_err', float('nan')):.1e})")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/cascade_gpu.json")
    ap.add_argument("--tiny", action="store_true",
                    help="small fp32 shapes, eager; runs on a CPU through the interpreter")
    ap.add_argument("--layers", type=int, default=None,
                    help="distinct KV caches per timed call (default 4; --tiny 1)")
    ap.add_argument("--generated", type=int, nargs="*", default=None)
    ap.add_argument("--sweep-prefix", action="store_true",
                    help="also time the prefix launch under several tiles and split counts")
    ap.add_argument("--sweep-suffix", action="store_true",
                    help="also time the suffix decode launch under several tiles and splits")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if not args.tiny and not cuda:
        raise SystemExit("needs a CUDA GPU with compiled Triton (or pass --tiny)")
    device = "cuda" if cuda else "cpu"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shape = TINY if args.tiny else W3
    layers = args.layers or (1 if args.tiny else 4)
    gens = tuple(args.generated) if args.generated else shape.generated
    results: dict = {"meta": {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "interpreted": not cuda, "tiny": args.tiny,
        "dtype": str(dtype).removeprefix("torch."), "shape": asdict(shape), "layers": layers,
        "copy_ceiling_tbps": COPY_TBPS}, "cases": []}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t0 = time.time()
    for g in gens:
        try:
            r = bench_case(shape, g, layers, dtype, device, cuda, sweep=args.sweep_prefix,
                           force=args.tiny, sweep_suffix_too=args.sweep_suffix)
        except Exception as e:  # keep the other cases
            r = {"shape": shape.name, "generated": g, "error": f"{type(e).__name__}: {e}"}
        log(json.dumps(r, default=str))
        results["cases"].append(r)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=str)
    results["elapsed_s"] = time.time() - t0
    bad = [f"{r['shape']} g{r['generated']}" for r in results["cases"] if not r.get("ok")]
    results["correctness_failures"] = bad
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print_table(results)
    print(f"JSON: {args.out}  ({results['elapsed_s']:.0f} s)")
    if bad:
        print("CORRECTNESS FAILURES: " + ", ".join(bad))
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
