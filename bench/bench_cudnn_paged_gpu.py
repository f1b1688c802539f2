#!/usr/bin/env python
"""GPU probe: cuDNN's SDPA reading the engine's paged K/V cache directly (no gather).

The thirteenth session's cuDNN fresh-prefill path ran torch's cuDNN SDPA at ~530 TFLOP/s on long
fresh prefills but had to gather each request's K / V out of the pages first (and left chunks
with context to the Triton kernel), so W2 gained 0.45%. cuDNN's graph API (the
``nvidia-cudnn-frontend`` package, carried as a wheel; not a dependency of the package) also
takes K / V as page pools with per-request page tables: ``paged_attention_k_table`` /
``_v_table``, ragged (THD) queries and outputs through ragged offsets, per-request lengths with
the padding mask, and a bottom-right causal diagonal (a chunk's queries are the last of its
keys). This probe builds that graph over the engine's cache layout (one half ``[num_blocks,
block_size, kv_heads, head_dim]`` declared as the pool ``[pages, kv_heads, page, head_dim]``
with the token-major strides) and times it against the package's paged Triton prefill on the
same cache:

* PERF.md's anchor, 8 x 2,048 fresh causal;
* a W2-like prefill step: fresh 7,000 + fresh 6,500 + a 2,860-token chunk after 4,000 cached.

Each output is checked against the package kernel (and the first sequence against the fp32
torch reference) before it is timed; the graph's build time is reported.

Run on the GPU machine from the repository root, with the wheel installed into a scratch dir:
    pip install --no-deps --no-index --target /tmp/cfe .whl/cudnn_fe/*.whl
    PYTHONPATH=/tmp/cfe python3 bench/bench_cudnn_paged_gpu.py --out $OUT/cudnn_paged.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_attention_gpu import BS, D, DTYPE, H, HKV, SCALE, do_bench_us, log, rel_err  # noqa: E402

from pagedkv.attention.torch_ref import paged_attention_ref  # noqa: E402
from pagedkv.attention.triton_prefill import paged_prefill_attention  # noqa: E402


def make_case(q_lens: list[int], ctx_lens: list[int], block_size: int, seed: int = 0):
    """Requests with ``ctx_lens[i]`` cached tokens and ``q_lens[i]`` new ones (all written to
    shuffled pages; unowned pages hold NaN)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    pages = [-(-s // block_size) for s in seq_lens]
    max_pages = max(pages)
    nb = 1 + sum(pages) + 4
    cache = torch.full((2, nb, block_size, HKV, D), float("nan"), dtype=DTYPE, device="cuda")
    perm = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(q_lens), max_pages, dtype=torch.int32)
    at = 0
    for i, p in enumerate(pages):
        table[i, :p] = torch.tensor(perm[at:at + p], dtype=torch.int32)
        at += p
    # the engine's cache is zero-initialized for this path: owned pages' unwritten tails and the
    # null page (table padding) hold zeros; the pages no request owns keep NaN
    cache[:, 0] = 0
    cache[:, table[table > 0].long().cuda()] = 0
    for i, s in enumerate(seq_lens):
        kv = torch.randn(2, s, HKV, D, generator=g).to(DTYPE).cuda()
        pos = torch.arange(s)
        slots = (table[i, pos // block_size].long() * block_size + pos % block_size).cuda()
        cache[0].view(-1, HKV, D)[slots] = kv[0]
        cache[1].view(-1, HKV, D)[slots] = kv[1]
    T = sum(q_lens)
    q = torch.randn(T, H, D, generator=g).to(DTYPE).cuda()
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32).cuda()
    return SimpleNamespace(q=q, cache=cache, table=table.cuda(), qsl=qsl, T=T,
                           q_lens=q_lens, ctx_lens=ctx_lens, max_pages=max_pages,
                           seq_lens=torch.tensor(seq_lens, dtype=torch.int32).cuda(),
                           block_size=block_size)


def causal_flops(case) -> float:
    """4 H D per (query, visible key) pair, causal with the context before the chunk."""
    pairs = sum(n * c + n * (n + 1) / 2 for n, c in zip(case.q_lens, case.ctx_lens))
    return 4 * H * D * pairs


class CudnnPagedPrefill:
    """One cuDNN SDPA graph for ``B`` requests (ragged queries up to ``max_q`` tokens, paged K/V
    up to ``max_kv`` tokens in pages of ``block_size``), built once."""

    # the sdpa keywords tried in order (the Python graph records them and hands them to the
    # compiled node when the graph is built: names differ between frontend versions)
    MASKS = (
        lambda c: dict(is_inference=True, diagonal_alignment=c.diagonal_alignment.BOTTOM_RIGHT,
                       diagonal_band_right_bound=0),
        lambda c: dict(is_inference=True, use_causal_mask_bottom_right=True),
        lambda c: dict(generate_stats=False,
                       diagonal_alignment=c.diagonal_alignment.BOTTOM_RIGHT, right_bound=0),
    )

    def __init__(self, cudnn, B: int, max_q: int, max_kv: int, total_q: int, num_blocks: int,
                 block_size: int, max_pages: int):
        self.cudnn = cudnn
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        errors = []
        for i, mask in enumerate(self.MASKS):
            try:
                self._build(B, max_q, max_kv, total_q, num_blocks, block_size, max_pages,
                            mask(cudnn))
                self.mask_variant = i
                break
            except Exception as e:  # noqa: BLE001
                errors.append(f"variant {i}: {type(e).__name__}: {str(e)[-900:]}")
        else:
            raise RuntimeError(" | ".join(errors))
        self.errors = errors

    def _build(self, B, max_q, max_kv, total_q, num_blocks, block_size, max_pages, mask):
        cudnn = self.cudnn
        g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16,
                          intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)
        i32 = cudnn.data_type.INT32
        self.q = g.tensor(name="q", dim=[B, H, max_q, D], stride=[max_q * H * D, D, H * D, 1],
                          data_type=cudnn.data_type.BFLOAT16)
        self.q_off = g.tensor(name="q_off", dim=[B + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                              data_type=i32)
        self.q.set_ragged_offset(self.q_off)
        pool = [num_blocks, HKV, block_size, D]
        pool_stride = [block_size * HKV * D, D, HKV * D, 1]
        self.k = g.tensor(name="k", dim=pool, stride=pool_stride,
                          data_type=cudnn.data_type.BFLOAT16)
        self.v = g.tensor(name="v", dim=pool, stride=pool_stride,
                          data_type=cudnn.data_type.BFLOAT16)
        tdim, tstride = [B, 1, max_pages, 1], [max_pages, max_pages, 1, 1]
        self.pt_k = g.tensor(name="pt_k", dim=tdim, stride=tstride, data_type=i32)
        self.pt_v = g.tensor(name="pt_v", dim=tdim, stride=tstride, data_type=i32)
        self.sq = g.tensor(name="seq_q", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
        self.skv = g.tensor(name="seq_kv", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
        o, _ = g.sdpa(name="sdpa", q=self.q, k=self.k, v=self.v, attn_scale=SCALE,
                      use_padding_mask=True, seq_len_q=self.sq, seq_len_kv=self.skv,
                      paged_attention_k_table=self.pt_k, paged_attention_v_table=self.pt_v,
                      paged_attention_max_seq_len_kv=max_kv, **mask)
        self.o_off = g.tensor(name="o_off", dim=[B + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                              data_type=i32)
        o.set_output(True).set_dim([B, H, max_q, D]).set_stride(
            [max_q * H * D, D, H * D, 1]).set_ragged_offset(self.o_off)
        self.o = o
        t0 = time.perf_counter()
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.ALL)
        self.build_s = time.perf_counter() - t0
        self.graph = g
        self.plans = g.get_execution_plan_count()
        ws = [g.get_workspace_size()]
        for i in range(self.plans):
            try:
                ws.append(g.get_workspace_size_plan_at_index(i))
            except Exception:  # noqa: BLE001
                pass
        self.workspace = torch.empty(max(1, *ws), dtype=torch.uint8, device="cuda")

    def bind(self, case, out, batch: int | None = None, max_pages: int | None = None):
        """The variant pack for one batch (offsets in elements of the token-major rows),
        padded to ``batch`` requests of no tokens and ``max_pages`` table columns."""
        B = len(case.q_lens)
        batch, max_pages = batch or B, max_pages or case.table.shape[1]
        qsl = torch.full((batch + 1,), case.T, dtype=torch.int32, device="cuda")
        qsl[:B + 1] = case.qsl
        table = torch.zeros(batch, max_pages, dtype=torch.int32, device="cuda")
        table[:B, :case.table.shape[1]] = case.table
        skv = torch.zeros(batch, dtype=torch.int32, device="cuda")
        skv[:B] = case.seq_lens
        self._keep = dict(q_off=(qsl * (H * D)).view(-1, 1, 1, 1).contiguous(),
                          pt=table.view(batch, 1, -1, 1).contiguous(),
                          sq=(qsl[1:] - qsl[:-1]).view(-1, 1, 1, 1).contiguous(),
                          skv=skv.view(-1, 1, 1, 1).contiguous())
        k = self._keep
        self.pack = {self.q: case.q, self.q_off: k["q_off"], self.k: case.cache[0],
                     self.v: case.cache[1], self.pt_k: k["pt"], self.pt_v: k["pt"],
                     self.sq: k["sq"], self.skv: k["skv"], self.o: out,
                     self.o_off: k["q_off"]}

    def __call__(self):
        self.graph.execute(self.pack, self.workspace, handle=self.handle)

    def plan_times(self) -> list:
        """Every built plan's time (us), None where it does not run."""
        times = []
        for i in range(self.plans):
            try:
                f = lambda i=i: self.graph.execute_plan_at_index(  # noqa: E731
                    self.pack, self.workspace, i, handle=self.handle)
                f()
                torch.cuda.synchronize()
                times.append(do_bench_us(f))
            except Exception as e:  # noqa: BLE001
                times.append(f"{type(e).__name__}: {str(e)[:120]}")
        return times


DECLARED_BATCHES = (16, 64, 256)


def run_case(cudnn, name: str, case) -> dict:
    flops = causal_flops(case)
    tflops = lambda us: flops / (us * 1e-6) / 1e12  # noqa: E731
    out_t = torch.full_like(case.q, float("nan"))
    B = len(case.q_lens)

    def package():
        return paged_prefill_attention(case.q, case.cache, case.table, case.qsl, case.seq_lens,
                                       B, SCALE, out_t, num_tokens=case.T)

    package()
    torch.cuda.synchronize()
    n0, c0 = case.q_lens[0], case.ctx_lens[0]
    meta = SimpleNamespace(query_start_loc_cpu=torch.tensor([0, n0], dtype=torch.int32),
                           num_reqs=1, seq_lens_cpu=torch.tensor([n0 + c0], dtype=torch.int32),
                           block_table_tensor=case.table[:1])
    ref = paged_attention_ref(case.q[:n0].float(), case.cache, meta, SCALE)
    row = {"case": name, "q_lens": case.q_lens, "ctx_lens": case.ctx_lens,
           "block_size": case.block_size, "gflop": flops / 1e9}
    us = do_bench_us(package)
    row["triton"] = {"us": us, "tflops": tflops(us), "rel_err_ref": rel_err(out_t[:n0], ref)}
    log(f"{name} (block {case.block_size}) triton: {us:.0f} us {tflops(us):.0f} TFLOP/s "
        f"err {row['triton']['rel_err_ref']:.1e}")
    try:
        out_c = torch.full_like(case.q, float("nan"))
        g = CudnnPagedPrefill(cudnn, B, max(case.q_lens), max(case.seq_lens.tolist()), case.T,
                              case.cache.shape[1], case.block_size, case.max_pages)
        g.bind(case, out_c)
        g()
        torch.cuda.synchronize()
        us = do_bench_us(g)
        row["cudnn"] = {"us": us, "tflops": tflops(us), "build_s": g.build_s,
                        "rel_err_ref": rel_err(out_c[:n0], ref),
                        "rel_err_vs_triton": rel_err(out_c, out_t.float()),
                        "workspace": g.workspace.numel(), "mask_variant": g.mask_variant,
                        "declined": g.errors}
        log(f"{name} (block {case.block_size}) cudnn paged: {us:.0f} us {tflops(us):.0f} "
            f"TFLOP/s err {row['cudnn']['rel_err_ref']:.1e} vs triton "
            f"{row['cudnn']['rel_err_vs_triton']:.1e} build {g.build_s:.2f} s "
            f"mask variant {g.mask_variant}")
        row["cudnn"]["plan_us"] = g.plan_times()
        log(f"  plans ({g.plans}): {row['cudnn']['plan_us']}")
        try:  # one CUDA-graph capture of the launch, replayed on zeroed output
            cg = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                cudnn.set_stream(handle=g.handle, stream=s.cuda_stream)
                g()
                with torch.cuda.graph(cg, stream=s):
                    g()
            torch.cuda.current_stream().wait_stream(s)
            cudnn.set_stream(handle=g.handle,
                             stream=torch.cuda.current_stream().cuda_stream)
            out_c.zero_()
            cg.replay()
            torch.cuda.synchronize()
            row["cudnn"]["graph_replay_rel_err_vs_triton"] = rel_err(out_c, out_t.float())
            row["cudnn"]["graph_replay_us"] = do_bench_us(cg.replay)
        except Exception as e:  # noqa: BLE001
            row["cudnn"]["graph_replay"] = f"{type(e).__name__}: {str(e)[:300]}"
        log(f"  CUDA graph: {row['cudnn'].get('graph_replay_rel_err_vs_triton')} "
            f"{row['cudnn'].get('graph_replay_us')} {row['cudnn'].get('graph_replay', '')}")
        # the same batch under an over-declared graph (the engine's buckets): 2x the requests,
        # max_num_batched_tokens rows, max_model_len keys
        row["cudnn_declared"] = []
        for B2 in DECLARED_BATCHES:
            try:
                mq2, mkv2 = 16384, 8192
                mp2 = mkv2 // case.block_size
                g2 = CudnnPagedPrefill(cudnn, B2, mq2, mkv2, mq2, case.cache.shape[1],
                                       case.block_size, mp2)
                out_c.fill_(float("nan"))
                g2.bind(case, out_c, batch=B2, max_pages=mp2)
                g2()
                torch.cuda.synchronize()
                us2 = do_bench_us(g2)
                r2 = {"batch": B2, "max_q": mq2, "max_kv": mkv2, "us": us2,
                      "rel_err_vs_triton": rel_err(out_c, out_t.float()), "build_s": g2.build_s}
            except Exception as e:  # noqa: BLE001
                r2 = {"batch": B2, "error": f"{type(e).__name__}: {str(e)[:1500]}"}
            row["cudnn_declared"].append(r2)
            log(f"  over-declared: {r2}")
    except Exception as e:  # noqa: BLE001
        row["cudnn"] = {"error": f"{type(e).__name__}: {str(e)[:3000]}"}
        log(f"{name} cudnn paged: {row['cudnn']['error'][:1500]}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="cudnn_paged.json")
    args = ap.parse_args()
    import cudnn

    res = {"cudnn_frontend": getattr(cudnn, "__version__", "?"),
           "cudnn_backend": cudnn.backend_version(), "torch_cudnn": torch.backends.cudnn.version(),
           "rows": []}
    log(f"cudnn frontend {res['cudnn_frontend']}, backend {res['cudnn_backend']}, "
        f"torch's {res['torch_cudnn']}")
    cases = [("8x2048 fresh", [2048] * 8, [0] * 8, BS),
             ("w2 step", [7000, 6500, 2860], [0, 0, 4000], BS),
             ("8x2048 fresh", [2048] * 8, [0] * 8, 64)]
    for name, ql, cl, bs in cases:
        res["rows"].append(run_case(cudnn, name, make_case(ql, cl, bs)))
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
