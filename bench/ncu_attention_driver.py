#!/usr/bin/env python
"""Launches a few attention kernels once each, for Nsight Compute's hardware counters.

Every launch is compiled and run once first (outside the profiled range); then each named
case runs once between ``cudaProfilerStart`` / ``cudaProfilerStop``, so
``ncu --profile-from-start off`` sees exactly those launches. Cases (bf16, block 16, 16 query /
8 K/V heads, head_dim 128, Qwen3-0.6B's attention):

* ``prefill``: ``paged_prefill_attention`` 8 x 2048 causal, the default ``PrefillConfig``;
* ``prefill_packed``: the same with two query heads a program (64 x 64, 8 warps, 3 stages:
  the sweep's best packed tiling);
* ``prefix``: cascade attention's shared-prefix launch on W3's decode shape: 256 query rows,
  non-causal over 2,048 shared positions, 4 key splits with log-sum-exps, the engine's
  ``default_prefix_config``;
* ``decode_mixed``: ``paged_decode_attention`` on 200 requests of lengths U[100, 2048] with the
  split count a CUDA graph bakes in for ``max_model_len`` 4096 (the split kernel and the
  reduce kernel: W1's decode shape); ``decode_mixed_rh1``: the same, one head a reduce
  program.

Usage on the GPU machine (installs nothing)::

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section WarpStateStats python3 bench/ncu_attention_driver.py prefill prefix
    python3 bench/ncu_attention_driver.py --dump $OUT/asm prefill   # TTGIR / PTX of the variants
"""

from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pagedkv.attention.triton_decode import (  # noqa: E402
    DecodeConfig,
    _decode_kernel,
    paged_decode_attention,
)
from pagedkv.attention.triton_backend import default_prefix_config  # noqa: E402
from pagedkv.attention.triton_prefill import (  # noqa: E402
    PrefillConfig,
    _prefill_kernel,
    paged_prefill_attention,
)

H, HKV, D, BS = 16, 8, 128, 16
DT = torch.bfloat16
SCALE = D ** -0.5


def _cache(num_blocks: int) -> torch.Tensor:
    return torch.randn((2, num_blocks, BS, HKV, D), device="cuda", dtype=DT)


def case_prefill(config: PrefillConfig | None):
    n, s = 8, 2048
    blocks = s // BS
    cache = _cache(1 + n * blocks)
    table = (torch.randperm(n * blocks, device="cuda").to(torch.int32) + 1).view(n, blocks)
    q = torch.randn((n * s, H, D), device="cuda", dtype=DT)
    qsl = torch.arange(0, n * s + 1, s, dtype=torch.int32, device="cuda")
    lens = torch.full((n,), s, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    return lambda: paged_prefill_attention(q, cache, table, qsl, lens, n, SCALE, out,
                                           num_tokens=n * s, config=config)


def case_prefix():
    rows, prefix, splits = 256, 2048, 4
    blocks = prefix // BS
    cache = _cache(1 + blocks)
    table = (torch.randperm(blocks, device="cuda").to(torch.int32) + 1).view(1, blocks)
    q = torch.randn((rows, H, D), device="cuda", dtype=DT)
    qsl = torch.tensor([0, rows], dtype=torch.int32, device="cuda")
    lens = torch.tensor([prefix], dtype=torch.int32, device="cuda")
    out = torch.empty((splits, rows, H, D), device="cuda", dtype=torch.float32)
    lse = torch.empty((splits, rows, H), device="cuda", dtype=torch.float32)
    cfg = default_prefix_config(torch.device("cuda"))  # the engine's prefix launch
    return lambda: paged_prefill_attention(q, cache, table, qsl, lens, 1, SCALE, out,
                                           num_tokens=rows, config=cfg, causal=False, lse=lse,
                                           kv_splits=splits)


def case_decode_mixed(config: DecodeConfig | None = None):
    rng = random.Random(0)
    n = 200
    lens_l = [rng.randint(100, 2048) for _ in range(n)]
    width = max(-(-x // BS) for x in lens_l)
    total = sum(-(-x // BS) for x in lens_l)
    cache = _cache(1 + total)
    perm = torch.randperm(total, device="cuda").to(torch.int32) + 1
    table = torch.zeros((n, width), dtype=torch.int32, device="cuda")
    at = 0
    for r, x in enumerate(lens_l):
        nb = -(-x // BS)
        table[r, :nb] = perm[at:at + nb]
        at += nb
    q = torch.randn((n, H, D), device="cuda", dtype=DT)
    qsl = torch.arange(n + 1, dtype=torch.int32, device="cuda")
    lens = torch.tensor(lens_l, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    ws: dict = {}
    return lambda: paged_decode_attention(q, cache, table, qsl, lens, n, SCALE, out,
                                          max_seq_len=4096, workspace=ws, config=config)


CASES = {
    "prefill": lambda: case_prefill(None),
    "prefill_packed": lambda: case_prefill(PrefillConfig(64, 64, 8, 3, 2)),
    "prefix": case_prefix,
    "decode_mixed": case_decode_mixed,
    "decode_mixed_rh1": lambda: case_decode_mixed(DecodeConfig(reduce_heads=1)),
}


def dump(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    for name, kern in (("prefill", _prefill_kernel), ("decode", _decode_kernel)):
        for dev, entry in kern.device_caches.items():
            for i, ck in enumerate(entry[0].values()):
                for ext in ("ttgir", "ptx"):
                    text = ck.asm.get(ext)
                    if text:
                        with open(os.path.join(path, f"{name}{i}.{ext}"), "w") as f:
                            f.write(text)
                print(name, i, "regs", ck.n_regs, "spills", ck.n_spills, "shared",
                      ck.metadata.shared, "warps", ck.metadata.num_warps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="+", choices=sorted(CASES))
    ap.add_argument("--dump", default=None, help="write each compiled variant's TTGIR / PTX here")
    args = ap.parse_args()
    torch.manual_seed(0)
    fns = [CASES[c]() for c in args.cases]
    for fn in fns:  # compile, warm the allocator
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    if args.dump:
        dump(args.dump)


if __name__ == "__main__":
    main()
