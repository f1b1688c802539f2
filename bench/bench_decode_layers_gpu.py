#!/usr/bin/env python
"""GPU benchmark: does a decode step's attention lose time to its layers' cache size?

Why: in W1's profile (fourteenth session) the engine's decode attention took 4.41 ms at step
400 (153 requests, 146k context tokens, 28 layers: ~157 us a layer), while
``bench_decode_mixed.py`` times a launch of similar mixed lengths at ~100% of 4.27 TB/s for its
bytes (B153, U[100, 2048]: 153.9 us for 164k tokens). That bench reads one cache of about a
gigabyte, launch after launch; the engine reads a different cache in every layer, each about
4 GiB (the pool: ~116 GiB over 28 layers), so each layer starts on pages whose translations
(2 MiB pages) the previous layers evicted. This bench separates the two:

* ``one_cache``: ``L`` launches over one cache and one block table (the K/V bytes of each launch,
  hundreds of MB, still leave the L2 cold; the page translations stay warm);
* ``per_layer``: ``L`` caches of ``--pool-gib`` each, launch ``l`` over cache ``l`` (as a decode
  step's layers do), each with its own block table of the same placement.

Placements of a request's blocks in a cache of ``N`` blocks: ``contig`` (each request's blocks
consecutive), ``dense`` (the working set's ids ``1..n`` in a random order: the engine's pool
hands out low ids first) and ``scatter`` (random ids over the whole cache). All launches of a
configuration are captured in one CUDA graph (the engine's decode graph launches one per
layer); us per launch, median of replays; the first layer's output is checked against the
torch reference. The lengths: ``U[lo, hi]`` for ``--batches`` (W1 mixed), or ``--equal L``.

    python3 bench/bench_decode_layers_gpu.py --layers 16 --pool-gib 4 --out $OUT/decode_layers.json
    python3 bench/bench_decode_layers_gpu.py --device cpu --dry-run   # the setup and checks
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_attention_gpu import BS, COPY_TBPS, D, DTYPE, H, HKV, SCALE, time_graph  # noqa: E402
from bench_decode_mixed import decode_rel_err  # noqa: E402
from pagedkv.attention._triton_common import num_sms  # noqa: E402
from pagedkv.attention.triton_decode import DecodeConfig, one_range_for, paged_decode_attention  # noqa: E402

PLACEMENTS = ("contig", "dense", "scatter")
BLOCK_BYTES = 2 * BS * HKV * D * 2  # K and V of one block, bf16 (the pool's size unit)


def block_tables(lens: torch.Tensor, num_blocks: int, placement: str,
                 gen: torch.Generator) -> torch.Tensor:
    """``[batch, width]`` int32 block ids (0, the null block, past a request's blocks) of
    ``placement`` in a cache of ``num_blocks`` blocks (module docstring)."""
    need = [-(-int(n) // BS) for n in lens.tolist()]
    total = sum(need)
    if total > num_blocks - 1:
        raise SystemExit(f"the batch needs {total} blocks, the cache holds {num_blocks - 1}: "
                         "raise --pool-gib")
    if placement == "contig":
        ids = torch.arange(1, total + 1, dtype=torch.int32)
    elif placement == "dense":
        ids = torch.randperm(total, generator=gen).to(torch.int32) + 1
    elif placement == "scatter":
        ids = torch.randperm(num_blocks - 1, generator=gen)[:total].to(torch.int32) + 1
    else:
        raise SystemExit(f"unknown placement {placement!r}; use one of {PLACEMENTS}")
    table = torch.zeros(len(need), max(need), dtype=torch.int32)
    start = 0
    for i, k in enumerate(need):
        table[i, :k] = ids[start:start + k]
        start += k
    return table


class LayerSetup:
    """``layers`` caches (``distinct``) or one shared by every layer, their block tables, and
    per layer a query and an output."""

    def __init__(self, lens: torch.Tensor, layers: int, num_blocks: int, placement: str,
                 distinct: bool, device: torch.device, seed: int = 0, dtype=DTYPE):
        gen = torch.Generator().manual_seed(seed)  # block tables
        dgen = torch.Generator(device=device).manual_seed(seed)  # values, made on the device
        self.lens, self.batch = lens, lens.numel()
        n_caches = layers if distinct else 1
        self.caches, self.tables = [], []
        for _ in range(n_caches):
            cache = torch.empty((2, num_blocks, BS, HKV, D), dtype=dtype, device=device)
            table = block_tables(lens, num_blocks, placement, gen).to(device)
            used = table[table > 0].long()
            cache[:, used] = torch.randn((2, used.numel(), BS, HKV, D), generator=dgen,
                                         device=device, dtype=dtype)
            self.caches.append(cache)
            self.tables.append(table)
        self.layers = layers
        self.qs = [torch.randn((self.batch, H, D), generator=dgen, device=device, dtype=dtype)
                   for _ in range(layers)]
        self.outs = [torch.empty_like(q) for q in self.qs]
        self.qsl = torch.arange(self.batch + 1, dtype=torch.int32, device=device)
        self.seq = lens.to(device)
        sms = num_sms(device)
        self.balanced = one_range_for(lens.numpy(), self.batch, HKV, sms, DecodeConfig())
        self.ws: dict = {}  # one workspace for every layer, as a step's plan shares its own

    def call(self, layer: int):
        c = layer % len(self.caches)
        return lambda: paged_decode_attention(
            self.qs[layer], self.caches[c], self.tables[c], self.qsl, self.seq, self.batch,
            SCALE, self.outs[layer], balanced=self.balanced, workspace=self.ws)

    def check(self) -> float:
        self.outs[0].fill_(float("nan"))
        self.call(0)()
        return decode_rel_err(self.qs[0], self.caches[0], self.tables[0], self.lens, self.outs[0])

    def time(self) -> float:
        return time_graph([self.call(i) for i in range(self.layers)], min_ms=20.0, trials=5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="64,153,256")
    p.add_argument("--lo", type=int, default=100)
    p.add_argument("--hi", type=int, default=2048)
    p.add_argument("--equal", type=int, default=None, help="every request this long instead")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--pool-gib", type=float, default=4.0,
                   help="one layer's cache (K and V), GiB (W1's pool: ~116 over 28 layers)")
    p.add_argument("--placements", default=",".join(PLACEMENTS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true",
                   help="no timing: build every configuration, launch and check it once")
    p.add_argument("--out", default="decode_layers.json")
    args = p.parse_args()
    device = torch.device(args.device)
    num_blocks = max(2, int(args.pool_gib * 2 ** 30) // BLOCK_BYTES)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        g = torch.Generator().manual_seed(b)
        lens = (torch.full((b,), args.equal, dtype=torch.int32) if args.equal else
                torch.randint(args.lo, args.hi + 1, (b,), generator=g, dtype=torch.int32))
        kv_bytes = int(lens.sum()) * HKV * D * 2 * 2
        for placement in args.placements.split(","):
            res = {"batch": b, "sum_len": int(lens.sum()), "placement": placement,
                   "num_blocks": num_blocks, "layers": args.layers}
            for mode, distinct in (("one_cache", False), ("per_layer", True)):
                # bf16 on the GPU; float32 in the interpreter (its bf16 arithmetic is broken)
                s = LayerSetup(lens, args.layers, num_blocks, placement, distinct, device,
                               dtype=DTYPE if device.type == "cuda" else torch.float32)
                err = s.check()
                us = None if args.dry_run else s.time()
                res[mode] = {"us": us, "rel_err": err,
                             "frac": None if us is None else kv_bytes / (us * 1e-6) / (COPY_TBPS * 1e12)}
                del s
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(res)
            fmt = lambda m: (f"{res[m]['us']:.1f} us ({res[m]['frac']:.0%})"  # noqa: E731
                             if res[m]["us"] is not None else "not timed")
            print(f"B{b:4d} {placement:8s} one cache: {fmt('one_cache')}, {args.layers} caches of "
                  f"{args.pool_gib} GiB: {fmt('per_layer')}; err "
                  f"{res['one_cache']['rel_err']:.1e} / {res['per_layer']['rel_err']:.1e}",
                  flush=True)
    with open(args.out, "w") as f:
        json.dump({"pool_gib": args.pool_gib, "layers": args.layers, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
