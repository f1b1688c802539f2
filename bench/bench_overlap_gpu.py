#!/usr/bin/env python
"""GPU benchmark: does a decode step gain from two half-batches on two CUDA streams?

W1's decode steps are ~75% attention (bandwidth-bound, 95-98% of its K/V bytes' time) and
~25% GEMMs and small kernels that are latency-bound (a 5-8 us GEMM for 1-3 us of weight
bytes). Two independent half-batches captured on two streams of one CUDA graph let one half's
GEMMs run beside the other half's attention. This times exactly the engine's decode layer
(Qwen3-0.6B shape, random bf16 weights, the model's compiled regions: ``post_pre_qkv`` = o
projection + residual + RMSNorm + MLP + next RMSNorm + QKV GEMM; the fused q/k norm + RoPE + K/V
write kernel; ``paged_decode_attention`` with the default launch policy) over 28 layers for
a batch of W1-like context lengths, three ways, as CUDA-graph replays:

* ``one``: the whole batch, one stream (what a decode graph does today);
* ``halves``: two half-batches one after the other on one stream (the cost of halving);
* ``two``: the two halves on two streams (fork / join inside the graph).

Checks: ``two`` equals ``halves`` bit for bit (the same launches), and both are close to
``one`` (attention splits and GEMM tilings differ with the row count). Prints us per step.

Run on the GPU machine from the repository root (no installs):
    python3 bench/bench_overlap_gpu.py --out $OUT/overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_attention_gpu import replay_us  # noqa: E402

from pagedkv.attention._triton_common import num_sms  # noqa: E402
from pagedkv.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedkv.attention.triton_decode import (  # noqa: E402
    DecodeConfig,
    longest_first_order,
    one_range_for,
    paged_decode_attention,
)
from pagedkv.kernels.qk_norm_rope_cache import qk_norm_rope_cache  # noqa: E402
from pagedkv.models.config import shape_config  # noqa: E402
from pagedkv.models.decoder import DecoderForCausalLM  # noqa: E402

BS = 16


class Half:
    """One group of decode requests: lengths, their rows of the block table, order."""

    def __init__(self, lens: np.ndarray, table: torch.Tensor, num_kv_heads: int,
                 cfg: DecodeConfig, dev: str = "cuda"):
        self.n = len(lens)
        self.lens = lens
        self.table = table
        self.seq = torch.from_numpy(lens.astype(np.int32)).to(dev)
        self.qsl = torch.arange(self.n + 1, dtype=torch.int32, device=dev)
        pos = torch.from_numpy(lens.astype(np.int64) - 1)
        rows = torch.arange(self.n)
        cpu_table = self.table.cpu().long()
        self.slots = (cpu_table[rows, pos // BS] * BS + pos % BS).to(dev)
        self.positions = pos.to(dev)
        self.order = torch.from_numpy(longest_first_order(lens)).to(dev)
        sms = num_sms(torch.device(dev)) if dev == "cuda" else 132
        self.balanced = one_range_for(lens, self.n, num_kv_heads, sms, cfg)
        self.workspace: dict = {}


def decode_layers(model, cache, half: Half, hidden, qkv, cos, sin, outs):
    """The engine's fused decode path over every layer for one group (``forward``'s loop with
    the attention call spelled out): returns the final hidden rows."""
    layers = model.layers
    _, _, _, mid = model._regions
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        q = qk_norm_rope_cache(qkv, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                               attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos,
                               sin, half.slots, cache[0], cache[1], check=False)
        out = paged_decode_attention(q, cache, half.table, half.qsl, half.seq, half.n,
                                     attn.scale, outs, balanced=half.balanced, check=False,
                                     workspace=half.workspace, order=half.order)
        if i < last:
            hidden, qkv = mid(hidden, out, *layer.post_args(), *layers[i + 1].pre_qkv_args())
    return hidden


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="64,128,153,200,256")
    p.add_argument("--lo", type=int, default=100)
    p.add_argument("--hi", type=int, default=1800, help="U[lo, hi] context lengths (W1's step "
                   "400: 153 requests, 146k tokens, mean ~950)")
    p.add_argument("--out", default="overlap.json")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    mcfg = shape_config("qwen3-0.6b")
    model = DecoderForCausalLM(mcfg, backend=TritonAttentionBackend(), dtype=torch.bfloat16,
                               device=dev).init_random_weights()
    assert model.compile_regions(), "compiled regions failed"
    hkv, hd = mcfg.num_key_value_heads, mcfg.head_dim
    dcfg = DecodeConfig()
    rng = np.random.default_rng(0)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        lens = rng.integers(args.lo, args.hi + 1, size=b)
        h = b // 2
        width = int(-(-lens.max() // BS))
        num_blocks = 1 + b * width
        table = torch.randperm(num_blocks - 1, device=dev).to(torch.int32).add_(1).view(b, width)
        whole = Half(lens, table, hkv, dcfg)
        a_half = Half(lens[:h], table[:h], hkv, dcfg)
        b_half = Half(lens[h:], table[h:], hkv, dcfg)
        cache = torch.randn((2, num_blocks, BS, hkv, hd), device=dev, dtype=torch.bfloat16)
        hidden = torch.randn(b, mcfg.hidden_size, device=dev, dtype=torch.bfloat16)
        with torch.inference_mode():
            cos, sin = model._rope(whole.positions, None)
            _, qkv = model._regions[2](hidden, None, *model.layers[0].pre_qkv_args())
            H = mcfg.num_attention_heads
            out_w = torch.empty(b, H, hd, device=dev, dtype=torch.bfloat16)
            out_a, out_b = out_w[:h].clone(), out_w[h:].clone()

            def one():
                return decode_layers(model, cache, whole, hidden, qkv, cos, sin, out_w)

            def part(grp, lo, hi, out):
                return decode_layers(model, cache, grp, hidden[lo:hi], qkv[lo:hi], cos[lo:hi],
                                     sin[lo:hi], out)

            def halves():
                return torch.cat([part(a_half, 0, h, out_a), part(b_half, h, b, out_b)])

            side = torch.cuda.Stream()

            def two():
                main_s = torch.cuda.current_stream()
                side.wait_stream(main_s)
                ya = part(a_half, 0, h, out_a)
                with torch.cuda.stream(side):
                    yb = part(b_half, h, b, out_b)
                main_s.wait_stream(side)
                return torch.cat([ya, yb])

            res = {"batch": b, "sum_len": int(lens.sum())}
            outs = {}
            for name, fn in (("one", one), ("halves", halves), ("two", two)):
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    fn()  # warm: compiles, workspaces
                torch.cuda.current_stream().wait_stream(s)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y = fn()
                graph.replay()
                torch.cuda.synchronize()
                outs[name] = y.float().clone()
                res[name + "_us"] = replay_us(graph, min_ms=30.0, max_reps=100)
                del graph
            res["two_equals_halves"] = bool(torch.equal(outs["two"], outs["halves"]))
            ref = outs["one"]
            res["halves_rel_err"] = float((outs["halves"] - ref).norm() / ref.norm())
        kv_bytes = 2 * int(lens.sum()) * hkv * hd * 2 * mcfg.num_hidden_layers
        res["kv_bytes_us"] = kv_bytes / 4.27e12 * 1e6
        print(f"B{b:4d} sum_len {res['sum_len']:7d}: one {res['one_us']:8.1f} us | halves "
              f"{res['halves_us']:8.1f} | two streams {res['two_us']:8.1f} "
              f"({res['one_us'] / res['two_us']:.3f}x one) | K/V bytes {res['kv_bytes_us']:.0f} us"
              f" | two == halves {res['two_equals_halves']}, halves vs one rel err "
              f"{res['halves_rel_err']:.1e}", flush=True)
        rows.append(res)
        del cache
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
