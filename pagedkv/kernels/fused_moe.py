"""The experts of a mixture-of-experts layer: tokens sorted by expert, one GEMM per expert.

``fused_moe(x, w13, w2, topk_weights, topk_ids) -> [T, H]``::

    x             [T, H]        the tokens (model dtype)
    w13           [E, 2I, H]    each expert's gate | up projection (rows 0..I-1 gate, I..2I-1 up)
    w2            [E, H, I]     each expert's down projection
    topk_weights  [T, k]        routing weights (model dtype or float32)
    topk_ids      [T, k]        the experts each token is routed to, in [0, E)

    out[t] = sum_j topk_weights[t, j] * w2[e] (silu(w13[e, :I] x[t]) * w13[e, I:] x[t]),
             e = topk_ids[t, j]

The ``T * k`` (token, choice) pairs are sorted by expert (stable: within one expert in pair
order ``t * k + j``); each expert that received tokens runs its two GEMMs on its contiguous
segment only (no dense all-experts compute). The weighted outputs are summed over the ``k``
choices in ``promote_types(x.dtype, topk_weights.dtype)`` and rounded once to ``x``'s dtype:
transformers' ``grouped_mm`` experts (its default), where Qwen3-MoE passes model-dtype weights
and Mixtral float32 ones.

``fused_moe_ref`` is the plain torch twin (one host sync for the per-expert counts; not
graph-capturable). The Triton kernel (:func:`fused_moe`) is the GPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv.errors import ConfigError

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_moe_args(fn: str, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> tuple[int, int, int, int, int]:
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
    devices = {a.device for a in (x, w13, w2, topk_weights, topk_ids)}
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


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Plain torch twin: sort the pairs by expert, per expert with tokens ``silu(gate) * up``
    then ``down`` on its segment (model dtype, as ``F.linear``), un-sort, weighted sum."""
    t, h, e, inter, k = check_moe_args("fused_moe_ref", x, w13, w2, topk_weights, topk_ids)
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
        gate, up = F.linear(seg, w13[expert]).chunk(2, dim=-1)
        out[start:start + n] = F.linear(F.silu(gate) * up, w2[expert])
        start += n
    pair_out = torch.empty_like(out)
    pair_out[order] = out  # back to pair order t * k + j
    return weighted_sum(pair_out.view(t, k, h), topk_weights, x.dtype)


__all__ = ["check_moe_args", "fused_moe_ref", "sort_by_expert", "weighted_sum"]
