"""The experts of a mixture-of-experts layer: tokens sorted by expert, one GEMM per expert.

``fused_moe(x, w13, w2, topk_weights, topk_ids) -> [T, H]``::

    x             [T, H]        the tokens (model dtype)
    w13           [E, 2I, H]    each expert's gate | up projection (rows 0..I-1 gate, I..2I-1 up)
    w2            [E, H, I]     each expert's down projection
    topk_weights  [T, k]        routing weights (model dtype or float32)
    topk_ids      [T, k]        the experts each token is routed to, in [0, E)

    out[t] = sum_j topk_weights[t, j] * w2[e] (silu(w13[e, :I] x[t]) * w13[e, I:] x[t]),
             e = topk_ids[t, j]

Options (GPT-OSS's experts): ``gate_up_interleaved`` (w13's rows alternate gate / up: row
``2i`` is gate unit ``i``, row ``2i + 1`` its up unit, as GPT-OSS stores ``gate_up_proj``);
biases ``b13 [E, 2I]`` (in w13's row order) and ``b2 [E, H]`` added to the two products; the
activation (``GatedActivation``): ``silu(gate) * up``, GPT-OSS's clamped SwiGLU
``(clamp(up, -limit, limit) + 1) * g sigmoid(alpha g)``, ``g = min(gate, limit)``, or
DeepSeek-V4's ``silu(min(gate, limit)) * clamp(up, -limit, limit)``.

The ``T * k`` (token, choice) pairs are sorted by expert (stable: within one expert in pair
order ``t * k + j``); each expert that received tokens runs its two GEMMs on its contiguous
segment only (no dense all-experts compute). The weighted outputs are summed over the ``k``
choices in ``promote_types(x.dtype, topk_weights.dtype)`` and rounded once to ``x``'s dtype:
transformers' ``grouped_mm`` experts (its default), where Qwen3-MoE passes model-dtype weights
and Mixtral float32 ones.

``fused_moe_ref`` is the plain torch twin (host syncs for the per-expert counts; not
graph-capturable). :func:`fused_moe` is the GPU path: an alignment, then two Triton kernels
over the sorted pairs:

1. ``moe_align`` (torch, on the device, no host sync): the pairs sorted by expert, each expert's
   segment padded to a multiple of ``BLOCK_M`` (pad entries hold the sentinel ``T * k``), and
   the expert of every ``BLOCK_M`` block; the number of blocks is bounded on the host by
   ``cdiv(T * k, BLOCK_M) + min(E, T * k)``, so the grids have fixed sizes (CUDA-graph safe);
   blocks past the last expert's segment exit at once.
2. ``_moe_gate_up_kernel``, grid ``(blocks, cdiv(I, BLOCK_N))``: a grouped GEMM, each program
   one block of rows of one expert: the rows' tokens gathered from ``x`` times the expert's gate
   and up tiles (two float32 accumulators), ``silu(gate) * up`` in float32, stored once in the
   model dtype at the rows' sorted positions.
3. ``_moe_down_kernel``, grid ``(blocks, cdiv(H, BLOCK_N))``: the same blocks times the
   expert's ``w2`` tile, float32 accumulator times the pair's routing weight, stored at the
   pair's row ``t * k + j`` of a ``[T * k, H]`` buffer in the promoted dtype; the sum over the
   ``k`` choices follows (torch, no atomics: deterministic).

Measured on the H200 (bf16, the Qwen3-30B-A3B shape E=128, k=8, H=2048, I=768; one run):
a CUDA-graph replay takes 83 us at T=1, 372 us at T=64 (every expert's weights read), 738 us at
T=2048 (about 200 TFLOP/s); an eager call costs about 0.8 ms of host time, most of it
``moe_align``'s dozen torch launches, so decode steps rely on the runner's CUDA graphs. Block
sizes are a first choice, not tuned (Mixtral-8x7B's shape at T=2048: 4.1 ms vs 3.0 ms for the
torch twin's cuBLAS GEMMs).

``H`` and ``I`` are compile-time constants of the kernels (one compilation per model shape;
the loops over them are static). Float32 GEMMs use exact fp32 ``tl.dot`` (no tf32). Versus the
twin, the kernels round the gate/up products once instead of after each op, so bf16/fp16
results differ by about one ulp of the intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import cdiv, next_pow2

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ACTIVATIONS = ("silu", "swiglu_clamp", "silu_clamp")


@dataclass(frozen=True)
class GatedActivation:
    """The experts' gated activation of ``(gate, up)``: ``"silu"`` (``silu(gate) * up``),
    ``"swiglu_clamp"`` (GPT-OSS: ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
    ``(u + 1) * g * sigmoid(alpha * g)``) or ``"silu_clamp"`` (DeepSeek-V4: ``silu(g) * u``
    with the same ``g`` and ``u``; ``alpha`` unused). The Triton kernel computes the same in
    float32."""

    name: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        if self.name not in ACTIVATIONS:
            raise ConfigError(f"unknown expert activation {self.name!r}; one of {ACTIVATIONS}")
        if not (self.alpha > 0 and self.limit > 0):
            raise ConfigError(f"GatedActivation: alpha and limit must be positive, got "
                              f"{self.alpha}, {self.limit}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The torch form (in the inputs' dtype, as transformers' experts compute it)."""
        if self.name == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        if self.name == "silu_clamp":
            return F.silu(gate) * up
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SILU = GatedActivation()


def check_moe_args(fn: str, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   b13: torch.Tensor | None = None,
                   b2: torch.Tensor | None = None) -> tuple[int, int, int, int, int]:
    """Shapes, dtypes and devices of the experts' arguments (metadata only: no host sync).
    Returns ``(T, H, E, I, k)``."""
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            raise ConfigError(f"{fn}: {name} must be a bf16/fp16/fp32 tensor, got "
                              f"{getattr(t, 'dtype', type(t).__name__)}")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ConfigError(f"{fn}: topk_ids must be an int32/int64 tensor")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ConfigError(f"{fn}: x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got "
                          f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    t, h = x.shape
    e, two_i, h13 = w13.shape
    if two_i % 2 or h13 != h or tuple(w2.shape) != (e, h, two_i // 2):
        raise ConfigError(f"{fn}: w13 must be [E, 2I, H={h}] and w2 [E, H, I]; got "
                          f"{tuple(w13.shape)} and {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ConfigError(f"{fn}: topk_ids and topk_weights must both be [T={t}, k]; got "
                          f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ConfigError(f"{fn}: x, w13 and w2 must share one dtype, got {x.dtype}, "
                          f"{w13.dtype}, {w2.dtype}")
    for name, b, shape in (("b13", b13, (e, two_i)), ("b2", b2, (e, h))):
        if b is not None and (not isinstance(b, torch.Tensor) or b.dtype not in FLOAT_DTYPES
                              or tuple(b.shape) != shape or b.stride(-1) != 1):
            raise ConfigError(f"{fn}: {name} must be a float tensor {list(shape)} contiguous in "
                              f"its last dimension, got {getattr(b, 'dtype', type(b).__name__)} "
                              f"{tuple(getattr(b, 'shape', ()))}")
    devices = {a.device for a in (x, w13, w2, topk_weights, topk_ids, b13, b2) if a is not None}
    if len(devices) != 1:
        raise ConfigError(f"{fn}: all tensors must be on one device, got {sorted(map(str, devices))}")
    return t, h, e, two_i // 2, topk_ids.shape[1]


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, counts)``: the pair indices ``t * k + j`` sorted by expert (stable) and the
    number of pairs of each expert ``[E]`` (int64)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def weighted_sum(pair_out: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * pair_out[t, j]`` for ``pair_out [T, k, H]`` in the promoted
    dtype of the two, rounded once to ``dtype``."""
    return (pair_out * topk_weights.unsqueeze(-1)).sum(dim=1).to(dtype)


def split_gate_up(gate_up: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate, up)`` of ``[..., 2I]`` projections in w13's row order: halves, or alternating
    units (``interleaved``)."""
    if interleaved:
        return gate_up[..., 0::2], gate_up[..., 1::2]
    return gate_up.chunk(2, dim=-1)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  activation: GatedActivation = SILU,
                  gate_up_interleaved: bool = False) -> torch.Tensor:
    """Plain torch twin: sort the pairs by expert, per expert with tokens the gated activation
    (``silu(gate) * up`` by default) then ``down`` on its segment (model dtype, as
    ``F.linear``; biases added there), un-sort, weighted sum."""
    t, h, e, inter, k = check_moe_args("fused_moe_ref", x, w13, w2, topk_weights, topk_ids,
                                       b13, b2)
    if t == 0:
        return x.new_zeros((0, h))
    lo, hi = int(topk_ids.min()), int(topk_ids.max())  # host syncs: the reference may
    if lo < 0 or hi >= e:
        raise ConfigError(f"fused_moe_ref: topk_ids must lie in [0, {e}), got values in [{lo}, {hi}]")
    order, counts = sort_by_expert(topk_ids, e)
    counts_host = counts.tolist()
    rows = x.index_select(0, order // k)  # [T * k, H], sorted by expert
    out = torch.empty((t * k, h), dtype=x.dtype, device=x.device)
    start = 0
    for expert, n in enumerate(counts_host):
        if n == 0:
            continue
        seg = rows[start:start + n]
        gate_up = F.linear(seg, w13[expert], None if b13 is None else b13[expert].to(x.dtype))
        act = activation(*split_gate_up(gate_up, gate_up_interleaved))
        out[start:start + n] = F.linear(act, w2[expert], None if b2 is None else b2[expert].to(x.dtype))
        start += n
    pair_out = torch.empty_like(out)
    pair_out[order] = out  # back to pair order t * k + j
    return weighted_sum(pair_out.view(t, k, h), topk_weights, x.dtype)


# ---------------------------------------------------------------------------------------------
# The Triton path


def _empty(shape, dtype, device) -> torch.Tensor:
    """The kernels' scratch buffers (uninitialized; tests poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def moe_block_config(num_pairs: int, num_experts: int, hidden: int, inter: int,
                     device: torch.device) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` from host ints: ``BLOCK_M`` about
    the mean number of pairs per expert (16 for decode batches, up to 64), ``BLOCK_N`` 64 /
    ``BLOCK_K`` 64 on the GPU (32 / 32 in the interpreter, whose cost grows with tile size)."""
    per_expert = cdiv(max(num_pairs, 1), max(num_experts, 1))
    block_m = max(16, min(64, next_pow2(per_expert)))
    if device.type != "cuda":
        return block_m, 32, 32, 4, 1
    return block_m, 64, 64, 4, 3


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs [blocks * block_m] int64, block_expert [blocks] int64)`` on the device,
    no host sync: the pairs ``t * k + j`` sorted by expert (stable), each expert's segment
    padded with the sentinel ``T * k`` to a multiple of ``block_m``, segments in expert order;
    ``block_expert[b]`` the expert of block ``b`` (``num_experts`` for the unused blocks at the
    end). ``blocks = cdiv(T * k, block_m) + min(E, T * k)`` bounds the padded length."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    dev = flat.device
    blocks = cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=dev) - start[expert_of]
    sorted_pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int64, device=dev)
    sorted_pairs[pad_start[expert_of] + rank] = order
    block_start = torch.arange(blocks, device=dev, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    return sorted_pairs, block_expert


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(x_ptr, sx0, sx1, w_ptr, sw0, sw1, sw2, out_ptr, so0, so1,
                        pairs_ptr, block_expert_ptr, num_pairs, b_ptr, sb0, alpha, limit,
                        HIDDEN: tl.constexpr,
                        INTER: tl.constexpr, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                        INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
                        SWIGLU_CLAMP: tl.constexpr, SILU_CLAMP: tl.constexpr = False):
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b)
    if e >= NUM_EXPERTS:
        return
    rows = b.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    token = tl.where(valid, pair // TOP_K, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    if INTERLEAVED:  # w13 rows alternate gate / up units
        g_row, u_row = 2 * n, 2 * n + 1
    else:
        g_row, u_row = n, n + INTER
    w_base = w_ptr + e * sw0
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < HIDDEN
        a = tl.load(x_ptr + token[:, None] * sx0 + kk[None, :] * sx1,
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_base + g_row[None, :].to(tl.int64) * sw1 + kk[:, None] * sw2, mask=w_mask,
                     other=0.0)
        wu = tl.load(w_base + u_row[None, :].to(tl.int64) * sw1 + kk[:, None] * sw2,
                     mask=w_mask, other=0.0)
        acc_g = tl.dot(a, wg, acc_g, input_precision=PREC)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PREC)
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + e * sb0 + g_row, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptr + e * sb0 + u_row, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SWIGLU_CLAMP:  # GPT-OSS: (clamp(up) + 1) * g sigmoid(alpha g), g = min(gate, limit)
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    elif SILU_CLAMP:  # DeepSeek-V4: silu(min(gate, limit)) * clamp(up)
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = g / (1.0 + tl.exp(-g)) * u
    else:
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(out_ptr + rows[:, None] * so0 + n[None, :] * so1, h.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(h_ptr, sh0, sh1, w_ptr, sw0, sw1, sw2, out_ptr, so0, so1, rw_ptr, srw0, srw1,
                     pairs_ptr, block_expert_ptr, num_pairs, b_ptr, sb0, HIDDEN: tl.constexpr,
                     INTER: tl.constexpr, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
                     HAS_BIAS: tl.constexpr):
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b)
    if e >= NUM_EXPERTS:
        return
    rows = b.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    pair = tl.where(valid, pair, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < HIDDEN
    w_base = w_ptr + e * sw0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < INTER
        a = tl.load(h_ptr + rows[:, None] * sh0 + kk[None, :] * sh1,
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + n[None, :].to(tl.int64) * sw1 + kk[:, None] * sw2,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e * sb0 + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    rw = tl.load(rw_ptr + (pair // TOP_K) * srw0 + (pair % TOP_K) * srw1, mask=valid, other=0.0)
    acc = acc * rw.to(tl.float32)[:, None]
    tl.store(out_ptr + pair[:, None] * so0 + n[None, :] * so1, acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              activation: GatedActivation = SILU,
              gate_up_interleaved: bool = False) -> torch.Tensor:
    """The experts with the Triton kernels (CUDA tensors, or any tensors under the Triton
    interpreter): same signature and result as :func:`fused_moe_ref` (see the module
    docstring). No host sync: CUDA-graph safe. ``topk_ids`` must lie in ``[0, E)`` (not
    checked: that would read the device)."""
    t, h, e, inter, k = check_moe_args("fused_moe", x, w13, w2, topk_weights, topk_ids, b13, b2)
    if t == 0:
        return x.new_zeros((0, h))
    num_pairs = t * k
    bm, bn, bk, warps, stages = moe_block_config(num_pairs, e, h, inter, x.device)
    sorted_pairs, block_expert = moe_align(topk_ids, e, bm)
    blocks = block_expert.numel()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    inter_buf = _empty((blocks * bm, inter), x.dtype, x.device)
    _moe_gate_up_kernel[(blocks, cdiv(inter, bn))](
        x, x.stride(0), x.stride(1), w13, w13.stride(0), w13.stride(1), w13.stride(2),
        inter_buf, inter_buf.stride(0), inter_buf.stride(1), sorted_pairs, block_expert,
        num_pairs, x if b13 is None else b13, 0 if b13 is None else b13.stride(0),  # x: unread
        float(activation.alpha), float(activation.limit),
        HIDDEN=h, INTER=inter, TOP_K=k, NUM_EXPERTS=e, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        PREC=prec, INTERLEAVED=bool(gate_up_interleaved), HAS_BIAS=b13 is not None,
        SWIGLU_CLAMP=activation.name == "swiglu_clamp", SILU_CLAMP=activation.name == "silu_clamp",
        num_warps=warps, num_stages=stages)
    pair_out = _empty((num_pairs, h), torch.promote_types(x.dtype, topk_weights.dtype), x.device)
    _moe_down_kernel[(blocks, cdiv(h, bn))](
        inter_buf, inter_buf.stride(0), inter_buf.stride(1), w2, w2.stride(0), w2.stride(1),
        w2.stride(2), pair_out, pair_out.stride(0), pair_out.stride(1), topk_weights,
        topk_weights.stride(0), topk_weights.stride(1), sorted_pairs, block_expert, num_pairs,
        x if b2 is None else b2, 0 if b2 is None else b2.stride(0),
        HIDDEN=h, INTER=inter, TOP_K=k, NUM_EXPERTS=e, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PREC=prec,
        HAS_BIAS=b2 is not None, num_warps=warps, num_stages=stages)
    return pair_out.view(t, k, h).sum(dim=1).to(x.dtype)


__all__ = ["ACTIVATIONS", "GatedActivation", "SILU", "check_moe_args", "fused_moe", "fused_moe_ref",
           "moe_align", "moe_block_config", "sort_by_expert", "split_gate_up", "weighted_sum"]
