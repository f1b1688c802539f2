#!/usr/bin/env python3
"""A decode layer without its attention, Qwen3-0.6B shape (random bf16 weights, 28 layers in one
CUDA graph, us per layer), as the model runs it by default and with the fused decode kernels:

* ``default``: the compiled region between two attention calls (``post_pre_qkv``: o_proj,
  residual + RMSNorm, gate/up, SiLU, down_proj, residual + RMSNorm, QKV GEMM) then
  ``qk_norm_rope_cache`` (q/k norms + RoPE + KV write);
* ``fused_qkv``: the region up to the input norm (``post_pre_norm``), then ``qkv_rope_cache``;
* ``fused_qkv_gate_up``: the same with the gate/up + SiLU kernel inside the region;
* ``chain``: ``DecoderLayer.decode_chain`` without attention: ``splitk_residual`` (o),
  ``gate_up_silu`` with the norm, ``splitk_residual`` (down), ``qkv_rope_cache`` with the norm;
* ``chain_pdl``: the chain with programmatic dependent launch and its weight prefetch;
* ``persistent``: the probe ``pagedkv/kernels/persistent_layer.py`` (o_proj, gate/up + SiLU,
  down_proj and the next QKV projection with both norms in one launch of one program an SM,
  grid barriers between them), then ``qk_norm_rope_cache`` as in ``default``;
* ``persistent_pf``: the same with every weight tile of the launch asked of the L2 at its start;
* ``persistent_rope``: ``persistent_pf`` with the next QKV projection as ``qkv_rope_cache``'s
  tiles (q/k norms, RoPE, K/V write in the same launch: one launch a layer besides attention,
  the engine's ``fuse_persistent_decode`` path until the thirty-fifth session;
  ``persistent_layer``'s default splits);
* ``persistent_rope_nosplit``: the same with the o / down phases unsplit (``SPLITS_O`` /
  ``SPLITS_D`` 1: few rows leave most programs idle there, split partials cost a round trip);
* ``persistent_rope_nopf``: ``persistent_rope`` without the L2 prefetch (the engine's path
  since the thirty-fifth session, where the prefetch measured slower);
* ``persistent_rope_x2``: ``persistent_rope_nopf`` with two programs an SM (the thirty-fifth
  session's reading of the loss: one program of 4 warps an SM keeps too few weight bytes in
  flight; the sm_90 compile fits at least two an SM at every row count, which the barrier
  needs).

The attention output is a fixed random tensor, so the numbers are the fixed cost a decode step
pays per layer besides attention (W1's decode-step fit, BENCHMARKS.md nineteenth session:
1.16 ms a step over 28 layers, attention included). Each variant's last hidden state and q
after the 28 layers are compared with the default's (``max_rel_dev_from_default``: largest
absolute deviation over the largest magnitude; bf16 rounding differs, so not zero).

    python3 bench/bench_decode_layer_gpu.py --out $OUT/decode_layer.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench_attention_gpu import time_graph  # noqa: E402
from pagedkv.kernels.persistent_layer import barrier_probe, persistent_layer  # noqa: E402
from pagedkv.kernels import gate_up_silu as gu  # noqa: E402
from pagedkv.kernels import pdl  # noqa: E402
from pagedkv.kernels.qk_norm_rope_cache import qk_norm_rope_cache  # noqa: E402
from pagedkv.kernels.qkv_rope_cache import qkv_rope_cache  # noqa: E402
from pagedkv.models.config import shape_config  # noqa: E402
from pagedkv.models.decoder import DecoderForCausalLM  # noqa: E402
from pagedkv.tools.benchmark import environment  # noqa: E402

MS = (1, 8, 32, 64, 128, 192, 256)
VARIANTS = ("default", "fused_qkv", "fused_qkv_gate_up", "chain", "chain_pdl", "persistent",
            "persistent_pf", "persistent_rope", "persistent_rope_nosplit", "persistent_rope_nopf",
            "persistent_rope_x2")
BS, NB = 16, 4096


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_layer.json")
    ap.add_argument("--ms", default=",".join(str(m) for m in MS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda", help="cuda (a CPU run only checks the script)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dev = torch.device(args.device)
    bf = getattr(torch, args.dtype)
    cfg = shape_config(args.shape, dtype=args.dtype)
    model = DecoderForCausalLM(cfg, dtype=bf, device=dev).init_random_weights(seed=0)
    assert model.compile_regions(allow_cpu=True)
    layers = model.layers
    attn0 = layers[0].self_attn
    H, HKV, D = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
    caches = [torch.zeros(2, NB, BS, HKV, D, device=dev, dtype=bf) for _ in layers]
    _, _, _, mid = model._regions
    _, mid_norm = model._norm_regions
    bar = torch.zeros(2, device=dev, dtype=torch.int32)  # the probe's grid barrier
    num_programs = (torch.cuda.get_device_properties(dev).multi_processor_count
                    if dev.type == "cuda" else 1)
    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        g = torch.Generator(device=dev).manual_seed(m)
        hidden0 = torch.randn(m, cfg.hidden_size, generator=g, device=dev).to(bf)
        attn_out = (torch.randn(m, H, D, generator=g, device=dev) * 0.5).to(bf)
        pos = torch.randint(0, 4000, (m,), generator=g, device=dev)
        cos, sin = model._rope(pos, None)
        slots = torch.randperm(NB * BS, generator=g, device=dev)[:m]
        results, checks, ref = {}, {}, None

        def layer_fn(variant, i):
            layer, nxt = layers[i], layers[(i + 1) % len(layers)]
            qn, kn = nxt.self_attn.q_norm, nxt.self_attn.k_norm
            kv = caches[(i + 1) % len(layers)]

            def default(h):
                h, qkv = mid(h, attn_out, *layer.post_args(), *nxt.pre_qkv_args())
                q = qk_norm_rope_cache(qkv, H, HKV, D, qn.weight, kn.weight, qn.eps, cos, sin,
                                       slots, kv[0], kv[1], check=False)
                return h, q

            def fused_qkv(h):
                h, x = mid_norm(h, attn_out, *layer.post_args(), *nxt.pre_qkv_args()[:2])
                proj = nxt.self_attn.qkv_proj
                q = qkv_rope_cache(x, proj.weight, proj.bias, H, HKV, D, qn.weight, kn.weight,
                                   qn.eps, cos, sin, slots, kv[0], kv[1], check=False)
                return h, q

            def chain(h):
                from pagedkv.kernels.gate_up_silu import gate_up_silu_op
                from pagedkv.kernels.splitk_gemm import splitk_residual_op, splitk_splits

                o, mlp = layer.self_attn.o_proj, layer.mlp
                h = splitk_residual_op(attn_out.reshape(m, -1), o.weight, o.bias, h,
                                       splitk_splits(*o.weight.shape))
                ln = layer.post_attention_layernorm
                act = gate_up_silu_op(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
                                      ln.weight, ln.eps)
                h = splitk_residual_op(act, mlp.down_proj.weight, mlp.down_proj.bias, h,
                                       splitk_splits(*mlp.down_proj.weight.shape))
                proj, nln = nxt.self_attn.qkv_proj, nxt.input_layernorm
                q = qkv_rope_cache(h, proj.weight, proj.bias, H, HKV, D, qn.weight, kn.weight,
                                   qn.eps, cos, sin, slots, kv[0], kv[1], check=False,
                                   ln_weight=nln.weight, ln_eps=nln.eps)
                return h, q

            def persistent(h, prefetch=False, fused_rope=False, tiles=None, per_sm=1):
                o, mlp, ln = layer.self_attn.o_proj, layer.mlp, layer.post_attention_layernorm
                proj, nln = nxt.self_attn.qkv_proj, nxt.input_layernorm
                assert o.bias is None and mlp.down_proj.bias is None and proj.bias is None
                rope = None
                if fused_rope:
                    rope = dict(num_heads=H, num_kv_heads=HKV, head_dim=D,
                                q_norm_weight=qn.weight, k_norm_weight=kn.weight, eps=qn.eps,
                                cos=cos, sin=sin, slot_mapping=slots, key_cache=kv[0],
                                value_cache=kv[1],
                                q_out=torch.empty(m, H, D, device=dev, dtype=bf))
                h, qkv, _, _ = persistent_layer(h, attn_out, o.weight, ln.weight,
                                           mlp.gate_up_proj.weight, mlp.down_proj.weight,
                                           nln.weight, proj.weight, ln.eps, prefetch=prefetch,
                                           num_programs=num_programs * per_sm, rope=rope,
                                           tiles=tiles)
                if fused_rope:
                    return h, qkv
                q = qk_norm_rope_cache(qkv, H, HKV, D, qn.weight, kn.weight, qn.eps, cos, sin,
                                       slots, kv[0], kv[1], check=False)
                return h, q

            return {"default": default, "fused_qkv": fused_qkv, "fused_qkv_gate_up": fused_qkv,
                    "chain": chain, "chain_pdl": chain, "persistent": persistent,
                    "persistent_pf": lambda h: persistent(h, True),
                    "persistent_rope": lambda h: persistent(h, True, True),
                    "persistent_rope_nosplit": lambda h: persistent(
                        h, True, True, dict(SPLITS_O=1, SPLITS_D=1)),
                    "persistent_rope_nopf": lambda h: persistent(h, False, True),
                    "persistent_rope_x2": lambda h: persistent(h, False, True, per_sm=2)}[variant]

        for variant in args.variants.split(","):
            gu.FUSED_GATE_UP_ENABLED = variant == "fused_qkv_gate_up"
            pdl.PDL_ENABLED = variant == "chain_pdl"
            fns = [layer_fn(variant, i) for i in range(len(layers))]
            state = {}

            def run():
                h = hidden0
                for fn in fns:
                    h, q = fn(h)
                state["h"], state["q"] = h, q

            try:
                run()
                torch.cuda.synchronize()
                if variant == "default":
                    ref = (state["h"].float().clone(), state["q"].float().clone())
                elif ref is not None:  # the largest deviation from the default, relative
                    checks[variant] = max(
                        float((state[k].float() - r).abs().max() / r.abs().max().clamp_min(1e-6))
                        for k, r in zip(("h", "q"), ref))
                results[variant] = time_graph([run], trials=args.trials) / len(layers)
            except Exception as e:  # report and go on with the other variants
                results[variant] = f"{type(e).__name__}: {str(e)[:160]}"
        gu.FUSED_GATE_UP_ENABLED = False
        pdl.PDL_ENABLED = False
        rows.append({"m": m, **results, "max_rel_dev_from_default": checks})
        print(f"M={m:4d} " + " | ".join(
            f"{k} {v:6.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in results.items()),
            flush=True)
    barrier = {}
    if dev.type == "cuda" and any(v.startswith("persistent") for v in args.variants.split(",")):
        # the probe's grid barrier alone: one launch of one program an SM through n barriers
        count = torch.zeros(1, device=dev, dtype=torch.int32)
        for n in (0, 4, 16, 64):
            barrier[n] = time_graph([lambda n=n: barrier_probe(n, bar, count, num_programs)],
                                    trials=args.trials)
        barrier["us_per_barrier"] = (barrier[64] - barrier[0]) / 64
        print("grid barrier (one launch, us): " + ", ".join(
            f"{k} barriers {v:.2f}" for k, v in barrier.items() if k != "us_per_barrier")
            + f"; {barrier['us_per_barrier']:.3f} us a barrier", flush=True)
    with open(args.out, "w") as f:
        json.dump({"environment": environment(), "unit": "us a layer (no attention)",
                   "rows": rows, "barrier_us": barrier}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
