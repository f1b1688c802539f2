#!/usr/bin/env python
"""GPU probe: does Triton 3.6's warp specialization speed up a paged causal prefill?

The package's prefill kernel (``pagedkv.attention.triton_prefill``) gathers K / V through
pointer loads (any page size), and Triton 3.6's Hopper warp specialization refuses such loops;
it runs at ~320 TFLOP/s on PERF.md's 8 x 2,048 causal anchor against the 450 target (cuDNN on
contiguous K / V: ~490). On the CPU (sm_90 compiles, twenty-second session) Triton 3.6 *does*
warp-specialize (``ttg.warp_specialize`` in the TTGIR) a causal loop whose key tiles are one
page each, loaded with TMA tensor descriptors from the cache half viewed as a 2-D
``[num_blocks * page, kv_heads * head_dim]`` array (the block-table entry read in the loop), at
4 warps, as long as the kernel has that one loop (a second loop for the diagonal tiles, in
either order, makes the ``NVGPUWarpSpecialization`` pass fail: the package kernel's case).
This probe times that kernel (:func:`ws_prefill`: fresh prefills of equal-length sequences,
``BLOCK_N`` = the page size; one loop with every tile masked, with and without
``warp_specialize``, and the two-loop structure without it) against the package's kernel on
the same cache (pages of 16, 64 and 128 tokens), after checking each against the torch
reference. It is a probe, not an engine path: equal lengths, no chunk context, no windows.

Run on the GPU machine from the repository root (no installs):
    python3 bench/bench_ws_prefill_gpu.py --out $OUT/ws_prefill.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@triton.jit
def _page_tile(acc, l_i, m_i, q, kd, vd, bt_row, start, rows, kvh, scale_log2, D: tl.constexpr,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Key tile ``[start, start + BLOCK_N)``: one page, ``bt_row[start // BLOCK_N]``, loaded
    whole by the tensor descriptors; ``MASKED``: row ``rows[i]`` sees keys ``<= rows[i]``."""
    page = tl.load(bt_row + start // BLOCK_N)
    k = kd.load([page * BLOCK_N, kvh * D])
    v = vd.load([page * BLOCK_N, kvh * D])
    qk = tl.dot(q, k.T) * scale_log2
    if MASKED:
        n = start + tl.arange(0, BLOCK_N)
        qk = tl.where(n[None, :] <= rows[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _ws_prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, bt_s0, seq, num_rows, num_cache_rows,
                       scale_log2, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr,
                       SPLIT_DIAG: tl.constexpr = False, RANGE_LOOP: tl.constexpr = True):
    """Program ``(j, h, b)``: query rows ``[j BLOCK_M, (j + 1) BLOCK_M)`` of sequence ``b``
    (rows ``b seq + i`` of ``q`` / ``o``, ``[num_rows, H D]``), head ``h``, against its keys
    ``<= `` each row's position; key tile ``t`` is page ``bt[b, t]`` of the cache halves
    (``[num_cache_rows, HKV D]``, ``BLOCK_N`` rows a page). ``seq`` and ``BLOCK_M`` multiples
    of ``BLOCK_N``; ``seq`` a multiple of ``BLOCK_M``. ``SPLIT_DIAG``: the unmasked keys in
    one loop and the diagonal tiles in a second (the package kernel's structure); Triton 3.6's
    ``NVGPUWarpSpecialization`` pass fails on a kernel with a second loop (either order,
    compiled for sm_90 on the CPU), so ``WS`` needs ``SPLIT_DIAG`` off: one loop, every tile
    masked. ``RANGE_LOOP`` False: while-loops (the interpreter cannot iterate ranges over
    runtime values; ``WS`` has no effect there)."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    kvh = h // (H // HKV)
    row0 = b * seq + j * BLOCK_M
    qd = tl.make_tensor_descriptor(q_ptr, shape=[num_rows, H * D], strides=[H * D, 1],
                                   block_shape=[BLOCK_M, D])
    kd = tl.make_tensor_descriptor(k_ptr, shape=[num_cache_rows, HKV * D], strides=[HKV * D, 1],
                                   block_shape=[BLOCK_N, D])
    vd = tl.make_tensor_descriptor(v_ptr, shape=[num_cache_rows, HKV * D], strides=[HKV * D, 1],
                                   block_shape=[BLOCK_N, D])
    q = qd.load([row0, h * D])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt_row = bt_ptr + b * bt_s0
    # keys [0, j BLOCK_M): visible to every row of the tile
    rows = j * BLOCK_M + tl.arange(0, BLOCK_M)
    if RANGE_LOOP:
        if SPLIT_DIAG:  # keys [0, j BLOCK_M) unmasked, then the diagonal tiles masked
            for start in tl.range(0, j * BLOCK_M, BLOCK_N, warp_specialize=WS):
                acc, l_i, m_i = _page_tile(acc, l_i, m_i, q, kd, vd, bt_row, start, rows,
                                           kvh, scale_log2, D, BLOCK_N, False)
            for start in range(j * BLOCK_M, (j + 1) * BLOCK_M, BLOCK_N):
                acc, l_i, m_i = _page_tile(acc, l_i, m_i, q, kd, vd, bt_row, start, rows,
                                           kvh, scale_log2, D, BLOCK_N, True)
        else:  # one loop, every tile masked (row i sees keys <= j BLOCK_M + i)
            for start in tl.range(0, (j + 1) * BLOCK_M, BLOCK_N, warp_specialize=WS):
                acc, l_i, m_i = _page_tile(acc, l_i, m_i, q, kd, vd, bt_row, start, rows,
                                           kvh, scale_log2, D, BLOCK_N, True)
    else:
        start = j * 0
        while start < (j + 1) * BLOCK_M:
            acc, l_i, m_i = _page_tile(acc, l_i, m_i, q, kd, vd, bt_row, start, rows, kvh,
                                       scale_log2, D, BLOCK_N, True)
            start += BLOCK_N
    od = tl.make_tensor_descriptor(o_ptr, shape=[num_rows, H * D], strides=[H * D, 1],
                                   block_shape=[BLOCK_M, D])
    od.store([row0, h * D], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty))


def _scratch(size: int, align: int, stream) -> torch.Tensor:
    """Triton's allocator for device-side tensor descriptors (their scratch bytes)."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available()
                       and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")


def ws_prefill(q, kv_cache, block_table, seq: int, scale: float, out, *, block_m: int = 64,
               ws: bool = True, split_diag: bool = False, num_warps: int = 4,
               num_stages: int = 3):
    """Causal fresh prefill of ``q`` (``[B seq, H, D]``, B equal-length sequences in order)
    over ``kv_cache`` (``[2, num_blocks, page, HKV, D]``, pages of ``block_table[b]``) into
    ``out``; the key tile is one page."""
    triton.set_allocator(_scratch)
    rows, H, D = q.shape
    _, nb, page, HKV, _ = kv_cache.shape
    B = rows // seq
    if seq % block_m or block_m % page or rows % seq:
        raise ValueError("seq must be a multiple of block_m, block_m of the page size")
    k2 = kv_cache[0].reshape(nb * page, HKV * D)
    v2 = kv_cache[1].reshape(nb * page, HKV * D)
    grid = (seq // block_m, H, B)
    _ws_prefill_kernel[grid](q.view(rows, H * D), k2, v2, out.view(rows, H * D), block_table,
                             block_table.stride(0), seq, rows, nb * page,
                             scale * 1.4426950408889634, H=H, HKV=HKV, D=D, BLOCK_M=block_m,
                             BLOCK_N=page, WS=ws, SPLIT_DIAG=split_diag,
                             RANGE_LOOP=os.environ.get("TRITON_INTERPRET") != "1",
                             num_warps=num_warps, num_stages=num_stages)
    return out


def ws_prefill_ref(q, kv_cache, block_table, seq: int, scale: float) -> torch.Tensor:
    """The twin: each sequence's K / V gathered from its pages, causal softmax attention in
    float32 (grouped query heads)."""
    rows, H, D = q.shape
    page, HKV = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.empty(rows, H, D, dtype=torch.float32, device=q.device)
    for b in range(rows // seq):
        pages = block_table[b, : seq // page].long()
        k = kv_cache[0][pages].reshape(seq, HKV, D).float().repeat_interleave(H // HKV, 1)
        v = kv_cache[1][pages].reshape(seq, HKV, D).float().repeat_interleave(H // HKV, 1)
        qb = q[b * seq:(b + 1) * seq].float()
        s = torch.einsum("ihd,jhd->hij", qb, k) * scale
        s = s.masked_fill(torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
        out[b * seq:(b + 1) * seq] = torch.einsum("hij,jhd->ihd", s.softmax(-1), v)
    return out


def make_inputs(num_seqs: int, seq: int, page: int, H: int, HKV: int, D: int, dtype, device,
                seed: int = 0):
    """``(q, cache, table)``: random queries and K / V written into shuffled pages (NaN in the
    pages no sequence owns)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = seq // page
    nb = 1 + num_seqs * pages + 2
    cache = torch.full((2, nb, page, HKV, D), float("nan"), dtype=dtype, device=device)
    perm = torch.randperm(nb - 1, generator=g)[: num_seqs * pages] + 1
    table = perm.view(num_seqs, pages).to(torch.int32).to(device)
    kv = torch.randn(2, num_seqs * pages, page, HKV, D, generator=g).to(dtype).to(device)
    cache[:, table.view(-1).long()] = kv
    q = torch.randn(num_seqs * seq, H, D, generator=g).to(dtype).to(device)
    return q, cache, table


def main() -> None:
    from bench_attention_gpu import D, DTYPE, H, HKV, SCALE, do_bench_us, log, rel_err

    from pagedkv.attention.triton_prefill import paged_prefill_attention

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="ws_prefill.json")
    ap.add_argument("--num-seqs", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    n, seq = args.num_seqs, args.seq
    flops = n * 4 * H * D * seq * (seq + 1) / 2
    tflops = lambda us: flops / (us * 1e-6) / 1e12  # noqa: E731
    res = {"num_seqs": n, "seq": seq, "triton": triton.__version__, "rows": []}
    for page in (16, 64, 128):
        q, cache, table = make_inputs(n, seq, page, H, HKV, D, DTYPE, "cuda", seed=page)
        ref = ws_prefill_ref(q[:seq], cache, table[:1], seq, SCALE)
        out = torch.empty_like(q)
        qsl = torch.arange(0, n * seq + 1, seq, dtype=torch.int32, device="cuda")
        lens = torch.full((n,), seq, dtype=torch.int32, device="cuda")

        def package():
            return paged_prefill_attention(q, cache, table, qsl, lens, n, SCALE, out,
                                           num_tokens=n * seq)

        variants = [("package kernel (default)", package)]
        for bm in (64, 128):
            if bm % page:
                continue
            # (warp specialization, diagonal split, warps): the specialized loop needs one loop
            for ws, split, warps in ((True, False, 4), (False, False, 4), (False, True, 4),
                                     (False, True, 8)):
                name = f"one page a tile, BM {bm}, {warps} warps, ws {int(ws)}, split {int(split)}"
                variants.append((name, lambda bm=bm, ws=ws, split=split, warps=warps: ws_prefill(
                    q, cache, table, seq, SCALE, out, block_m=bm, ws=ws, split_diag=split,
                    num_warps=warps)))
        for name, fn in variants:
            row = {"page": page, "variant": name}
            try:
                out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                row["rel_err"] = rel_err(out[:seq], ref)
                row["us"] = do_bench_us(fn)
                row["tflops"] = tflops(row["us"])
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"page {page} {name}: {row}")
            res["rows"].append(row)
        del q, cache, out
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
