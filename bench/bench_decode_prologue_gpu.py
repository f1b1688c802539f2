#!/usr/bin/env python
"""GPU benchmark: a decode step's attention with its q/k norms, RoPE and K/V write as two
launches (``qk_norm_rope_cache``, then ``paged_decode_attention``: the default path) against
one (the decode kernels' fused prologue, ``QKPrologue``; ``DecoderForCausalLM.
fuse_decode_prologue``).

Qwen3-0.6B's attention (16 query / 8 KV heads of 128, q/k norms, bf16), lengths U[lo, hi] or
equal, batch sizes B; each call is timed as CUDA-graph replays over disjoint pages (cold L2,
``bench_decode_mixed.MixedSetup``), microseconds per layer. Before timing, the two paths'
outputs are compared (relative error of the fused against the two launches) and the new
positions' K/V the fused launch writes (over NaN) against the kernel's.

Run on the GPU machine from the repository root (no installs):
    python3 bench/bench_decode_prologue_gpu.py --out $OUT/decode_prologue.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_attention_gpu import BS, D, DTYPE, H, HKV, SCALE, rel_err, time_graph  # noqa: E402
from bench_decode_mixed import MixedSetup  # noqa: E402
from pagedkv.attention.triton_decode import QKPrologue, paged_decode_attention  # noqa: E402
from pagedkv.kernels.qk_norm_rope_cache import qk_norm_rope_cache  # noqa: E402


class PrologueSetup(MixedSetup):
    """``MixedSetup`` plus, per rotation, a raw QKV projection, RoPE tables and the slots of
    the new positions (each request's last position in its rotation's table)."""

    def __init__(self, batch: int, lo: int, hi: int, seed: int = 0):
        super().__init__(batch, lo, hi, seed)
        gen = torch.Generator(device="cuda").manual_seed(seed + 1)
        pos = (self.lens - 1).long().cuda()
        self.pros = []
        for table in self.tables:
            slots = table.long()[torch.arange(batch, device="cuda"), pos // BS] * BS + pos % BS
            qkv = torch.randn((batch, (H + 2 * HKV) * D), generator=gen, device="cuda",
                              dtype=DTYPE)
            ang = torch.rand((batch, D // 2), generator=gen, device="cuda") * 6.0
            w = lambda: 1.0 + 0.3 * torch.randn(D, generator=gen, device="cuda", dtype=DTYPE)  # noqa: E731
            self.pros.append(QKPrologue(qkv, H, HKV, D, w(), w(), 1e-6, ang.cos(), ang.sin(),
                                        slots))

    def two_launches(self, i):
        p, q = self.pros[i], self.qs[i]
        step = self.call(i)  # the default decode launch of the query buffer qs[i]

        def run():
            qk_norm_rope_cache(p.qkv, H, HKV, D, p.q_norm_weight, p.k_norm_weight, p.eps, p.cos,
                               p.sin, p.slot_mapping, self.cache[0], self.cache[1], q_out=q,
                               check=False)
            step()
        return run

    def fused(self, i):
        p = self.pros[i]
        # the query view of the QKV rows instead of the query buffer; the same launch otherwise
        self.qs[i] = p.query()
        run = self.call(i, prologue=p)
        return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4,16,32,64,128,256")
    p.add_argument("--lo", type=int, default=100)
    p.add_argument("--hi", type=int, default=2048)
    p.add_argument("--out", default="decode_prologue.json")
    args = p.parse_args()
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        s = PrologueSetup(b, args.lo, args.hi)
        plain_q = list(s.qs)  # the query buffers qk_norm_rope_cache writes
        two = [s.two_launches(i) for i in range(s.rot)]
        # check: both paths on rotation 0, the outputs and the new positions' K/V
        slots = s.pros[0].slot_mapping
        new_kv = lambda: s.cache[:, slots // BS, slots % BS].float()  # noqa: E731
        two[0]()
        torch.cuda.synchronize()
        want_out, want_kv = s.outs[0].clone(), new_kv()
        s.cache[:, slots // BS, slots % BS] = float("nan")  # the fused launch must write them
        fused = [s.fused(i) for i in range(s.rot)]
        s.outs[0].fill_(float("nan"))
        fused[0]()
        torch.cuda.synchronize()
        err = rel_err(s.outs[0], want_out.float())
        kv_diff = float((new_kv() - want_kv).abs().max())
        s.qs = plain_q
        t_two = time_graph(two, min_ms=10.0, trials=5)
        s.qs = [p.query() for p in s.pros]
        t_fused = time_graph(fused, min_ms=10.0, trials=5)
        res = {"batch": b, "sum_len": int(s.lens.sum()), "two_launches_us": t_two,
               "fused_us": t_fused, "rel_err": err, "new_kv_max_diff": kv_diff}
        print(f"B{b:4d} sum_len {res['sum_len']:7d}: qk_norm_rope_cache + decode {t_two:7.1f} us"
              f" | fused prologue {t_fused:7.1f} us ({t_fused - t_two:+.1f}); rel err {err:.1e},"
              f" new K/V max diff {kv_diff:.1e}", flush=True)
        rows.append(res)
        del s
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"lo": args.lo, "hi": args.hi, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
