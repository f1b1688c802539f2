#!/usr/bin/env python
"""GPU benchmark: programmatic dependent launch (``pagedkv.kernels.pdl``) on the decode path.

Times the same CUDA graphs with PDL off and on (alternating, ``--rounds`` times), us per call:

* ``paged_decode_attention`` (split kernel + reduce) on equal lengths (B1/L512, B1/L8192,
  B64/L2048, B256/L2048) and on mixed lengths U[100, 2048] (B8 ... B256), the same method as
  ``bench_attention_gpu.py`` / ``bench_decode_mixed.py`` (graph replays over disjoint pages,
  cold L2);
* a decode layer's attention chain as the engine runs it: the fused q/k norm + RoPE + K/V
  write (``qk_norm_rope_cache``) then decode attention, 28 layers in one graph (W1-like mixed
  lengths, B64 / B128 / B256).

Before timing, every PDL output is checked bitwise equal to the PDL-off output (the same
kernels, only the launch differs). Run on the GPU machine from the repository root:
    python3 bench/bench_pdl_gpu.py --out $OUT/pdl.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_attention_gpu import COPY_TBPS, D, DTYPE, H, HKV, DecodeSetup, time_graph  # noqa: E402
from bench_decode_mixed import MixedSetup  # noqa: E402
from pagedkv.kernels import pdl  # noqa: E402
from pagedkv.kernels.qk_norm_rope_cache import qk_norm_rope_cache  # noqa: E402


def set_pdl(on: bool) -> None:
    pdl.PDL_ENABLED = on


def ab(name: str, make_calls, check_outs, rounds: int, bytes_: int | None = None) -> dict:
    """PDL off / on alternating ``rounds`` times; outputs bitwise equal first."""
    res = {"name": name}
    outs = {}
    for on in (False, True):
        set_pdl(on)
        for fn in make_calls():
            fn()
        torch.cuda.synchronize()
        outs[on] = [o.clone() for o in check_outs()]
    res["bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
    for on in (False, True):
        res["on" if on else "off"] = []
    for _ in range(rounds):
        for on in (False, True):
            set_pdl(on)
            res["on" if on else "off"].append(time_graph(make_calls()))
    for k in ("off", "on"):
        res[k + "_us"] = min(res[k])
    res["gain_us"] = res["off_us"] - res["on_us"]
    if bytes_:
        res["on_frac"] = bytes_ / (res["on_us"] * 1e-6) / 1e12 / COPY_TBPS
    print(f"{name}: off {res['off_us']:.2f} us, on {res['on_us']:.2f} us "
          f"(gain {res['gain_us']:+.2f}), bitwise equal {res['bitwise_equal']}", flush=True)
    set_pdl(False)
    return res


def chain_setup(batch: int, layers: int = 28, seed: int = 0):
    """``layers`` of (qk_norm_rope_cache -> decode) over one mixed-length batch: each layer
    writes its own cache's new positions and attends over them."""
    mix = MixedSetup(batch, 100, 2048, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    qkv = [torch.randn((batch, (H + 2 * HKV) * D), generator=g, device="cuda", dtype=DTYPE)
           for _ in range(layers)]
    qw = torch.rand(D, generator=g, device="cuda", dtype=DTYPE) + 0.5
    kw = torch.rand(D, generator=g, device="cuda", dtype=DTYPE) + 0.5
    pos = (mix.seq.long() - 1)
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    ang = pos[:, None].float() * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    table = mix.tables[0]
    bs = mix.cache.shape[2]
    slots = (table.gather(1, (pos // bs)[:, None]).squeeze(1).long() * bs + pos % bs)
    q_out = [torch.empty((batch, H, D), device="cuda", dtype=DTYPE) for _ in range(layers)]
    outs = [torch.empty((batch, H, D), device="cuda", dtype=DTYPE) for _ in range(layers)]
    from bench_attention_gpu import SCALE
    from pagedkv.attention._triton_common import num_sms
    from pagedkv.attention.triton_decode import DecodeConfig, one_range_for, paged_decode_attention

    bal = one_range_for(mix.lens.numpy(), batch, HKV, num_sms(torch.device("cuda")), DecodeConfig())

    def calls():
        fns = []
        for i in range(layers):
            def f(i=i):
                qk_norm_rope_cache(qkv[i], H, HKV, D, qw, kw, 1e-6, cos, sin, slots,
                                   mix.cache[0], mix.cache[1], q_out=q_out[i])
                paged_decode_attention(q_out[i], mix.cache, table, mix.qsl, mix.seq, batch,
                                       SCALE, outs[i], balanced=bal)
            fns.append(f)
        return [lambda: [f() for f in fns]]

    return calls, lambda: outs + [mix.cache], mix.kv_bytes * layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trigger", choices=["early", "exit"], default=pdl.PDL_TRIGGER,
                   help="where a kernel lets its dependents launch (pagedkv.kernels.pdl)")
    p.add_argument("--out", default="pdl.json")
    args = p.parse_args()
    pdl.PDL_TRIGGER = args.trigger
    if not pdl.pdl_supported(torch.device("cuda")):
        raise SystemExit("PDL needs compute capability 9.0+")
    rows = []
    for b, l in ((1, 512), (1, 8192), (64, 2048), (256, 2048)):
        st = DecodeSetup(b, l)
        rows.append(ab(f"decode B{b}/L{l}", lambda st=st: [st.call(i) for i in range(st.rot)],
                       lambda st=st: st.outs, args.rounds, st.kv_bytes))
        del st
        torch.cuda.empty_cache()
    for b in (8, 64, 128, 256):
        st = MixedSetup(b, 100, 2048)
        rows.append(ab(f"mixed B{b} U[100,2048]", lambda st=st: [st.call(i) for i in range(st.rot)],
                       lambda st=st: st.outs, args.rounds, st.kv_bytes))
        del st
        torch.cuda.empty_cache()
    for b in (64, 128, 256):
        calls, outs, nbytes = chain_setup(b)
        rows.append(ab(f"28 layers qk_norm_rope_cache + decode, B{b}", calls, outs, args.rounds,
                       nbytes))
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "trigger": args.trigger, "torch": torch.__version__}, f, indent=1)
    print("\n| case | PDL off (us) | PDL on (us) | gain | bitwise equal |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['off_us']:.2f} | {r['on_us']:.2f} | {r['gain_us']:+.2f} | "
              f"{r['bitwise_equal']} |")


if __name__ == "__main__":
    main()
