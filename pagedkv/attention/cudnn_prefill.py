"""Long fresh prefills through cuDNN's fused attention (torch's
``_scaled_dot_product_cudnn_attention``), one call per request.

A fresh prefill request (no cached context: ``seq_len == query_len``) attends causally to its
own new tokens only, so its keys and values need no block table. cuDNN's fused attention
reaches 538 TFLOP/s on one 7,168-token causal sequence on the H200 (heads-first contiguous
tensors; the paged Triton kernel's 8 x 2,048 benchmark runs at 320). The Triton backend
hands it the fresh requests of at least ``min_query_len`` tokens of an eager step, mixed steps
included (``TritonAttentionBackend(fresh_prefill="cudnn")``, opt-in: with the gathers and
copies made by torch ops it did not pay on W2, 3,559 against 3,586 output tok/s; see
BENCHMARKS.md, twelfth session), and tells the paged prefill kernel to skip them.

cuDNN builds an execution plan per problem shape (about 45 ms on the H200) and torch caches it
by shape. So a request of ``S`` tokens runs padded to ``S' = padded_len(S)`` (a multiple of
``PAD_GRANULE``): its query rows and its K/V rows (gathered from the cache by the step's
slots; a slot < 0 reads slot 0) are copied heads-first into ``[heads, S', D]`` buffers
whose padding rows are zero (``pagedkv.kernels.heads_first``, one launch a tensor). Causal
attention keeps the real rows exact: row ``i < S`` sees keys ``<= i`` only (the padding keys
are masked, and zero); the padding rows' outputs are dropped. :func:`warm_plans` builds every
padded shape up to a token count once (the engine's warm-up step of a full budget reaches
it), so no plan is built while serving.

Availability is decided once per device, dtype and head size by a probe
(:func:`cudnn_prefill_support`): a small padded grouped-query call against the plain
reference; where cuDNN rejects grouped-query heads the K/V heads are repeated, and where it
fails or differs the path is off.
"""

from __future__ import annotations

import functools

import torch

from pagedkv.errors import ConfigError
from pagedkv.kernels.heads_first import gather_heads_first

_DTYPES = (torch.bfloat16, torch.float16)
# padded lengths are multiples of this many tokens: at most PAD_GRANULE - 1 wasted rows (7% at
# 7,000 tokens), one plan per multiple (25 between 4,096 and 16,384 tokens)
PAD_GRANULE = 512


def padded_len(n: int) -> int:
    """The length a request of ``n`` tokens runs at: ``n`` rounded up to ``PAD_GRANULE``."""
    return -(-int(n) // PAD_GRANULE) * PAD_GRANULE


def _op():
    """torch's cuDNN attention forward, or None in a torch without it."""
    return getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal cuDNN attention of one sequence: ``q [H, S, D]``, ``k``/``v [Hkv, S, D]``, each
    contiguous (heads outermost: cuDNN ran token-major views at about half the speed on the
    H200); returns ``[H, S, D]``."""
    out = _op()(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, False, 0.0, True, False,
                scale=float(scale))[0]
    return out[0]


def _reference(q, k, v, scale) -> torch.Tensor:
    """Plain causal attention of one sequence in fp32: the probe's expectation."""
    group = q.shape[1] // k.shape[1]
    qs = q.float().transpose(0, 1)
    ks = k.float().repeat_interleave(group, 1).transpose(0, 1)
    vs = v.float().repeat_interleave(group, 1).transpose(0, 1)
    n = q.shape[0]
    s = (qs @ ks.transpose(1, 2) * scale).masked_fill(
        torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ vs).transpose(0, 1)


@functools.lru_cache(maxsize=None)
def cudnn_prefill_support(device_index: int, dtype: torch.dtype, head_dim: int) -> str | None:
    """How this device runs cuDNN attention for ``dtype`` / ``head_dim``: ``"gqa"`` (grouped
    query heads natively), ``"repeat"`` (K/V heads repeated) or None (not at all). Decided by
    a probe (100 tokens padded to 128 with NaN query rows, 4 query / 2 K/V heads) against
    :func:`_reference` at 2e-2; synchronizes once per device, dtype and head size."""
    if (_op() is None or not torch.cuda.is_available() or dtype not in _DTYPES
            or head_dim % 8 or head_dim > 128 or not torch.backends.cudnn.is_available()):
        return None
    dev = torch.device("cuda", device_index)
    gen = torch.Generator(device=dev).manual_seed(0)
    n, padded = 100, 128
    q = torch.randn(padded, 4, head_dim, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(padded, 2, head_dim, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(padded, 2, head_dim, device=dev, dtype=dtype, generator=gen)
    q[n:] = float("nan")
    k[n:] = 0
    v[n:] = 0
    scale = head_dim ** -0.5
    want = _reference(q[:n], k[:n], v[:n], scale)
    for mode in ("gqa", "repeat"):
        try:
            kk, vv = (k, v) if mode == "gqa" else (k.repeat_interleave(2, 1),
                                                   v.repeat_interleave(2, 1))
            heads_first = lambda t: t.transpose(0, 1).contiguous()  # noqa: E731
            got = _attend(heads_first(q), heads_first(kk), heads_first(vv),
                          scale).transpose(0, 1)[:n].float()
        except RuntimeError:
            continue
        if got.shape == want.shape and torch.allclose(got, want, atol=2e-2, rtol=2e-2):
            return mode
    return None


def cudnn_prefill_available_for(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """True where :func:`cudnn_prefill_attention` runs: CUDA, bf16/fp16, ``head_dim <= 128``
    and a multiple of 8, a torch with the op, and the device's probe passed."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return cudnn_prefill_support(index, dtype, int(head_dim)) is not None


def _mode(q: torch.Tensor) -> str:
    mode = cudnn_prefill_support(q.device.index if q.device.index is not None
                                 else torch.cuda.current_device(), q.dtype, q.shape[-1]) \
        if q.is_cuda else None
    if mode is None:
        raise ConfigError(f"cuDNN attention is not available for {q.dtype} / head_dim "
                          f"{q.shape[-1]} on {q.device}")
    return mode


def _kv_rows(kv_cache: torch.Tensor, half: int) -> torch.Tensor:
    heads, dim = kv_cache.shape[3], kv_cache.shape[4]
    try:
        return kv_cache[half].view(-1, heads, dim)
    except RuntimeError as e:
        raise ConfigError("cudnn_prefill_attention: the cache halves must be viewable as "
                          "[slots, Hkv, D]") from e


def cudnn_prefill_attention(q: torch.Tensor, row: int, n: int, kv_cache: torch.Tensor,
                            slots: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """Causal attention of one fresh request into ``out[row:row + n]`` (module docstring).

    ``q``/``out [T, H, D]``: the step's query rows, the request's at ``[row, row + n)``;
    ``kv_cache [2, num_blocks, block_size, Hkv, D]`` holding the request's K/V (written this
    step) at ``slots [n]`` (int64, the step's slot mapping of those rows). Returns ``out``."""
    mode = _mode(q)
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = kv_cache.shape[3]
    if (q.dim() != 3 or out.shape != q.shape or kv_cache.shape[4] != dim or heads % kv_heads
            or not 0 <= row <= row + n <= q.shape[0] or slots.shape[0] != n):
        raise ConfigError(f"cudnn_prefill_attention: q {tuple(q.shape)}, out "
                          f"{tuple(out.shape)}, cache {tuple(kv_cache.shape)}, rows "
                          f"[{row}, {row + n}), {slots.shape[0]} slots do not fit")
    padded = padded_len(n)
    # heads first, padded with zero rows (gather_heads_first: one launch a tensor)
    qp = gather_heads_first(q, None, row, n, q.new_empty(heads, padded, dim))
    kp, vp = (gather_heads_first(_kv_rows(kv_cache, half), slots, 0, n,
                                 q.new_empty(kv_heads, padded, dim)) for half in (0, 1))
    group = heads // kv_heads
    if group > 1 and mode == "repeat":
        kp, vp = kp.repeat_interleave(group, 0), vp.repeat_interleave(group, 0)
    out[row:row + n] = _attend(qp, kp, vp, scale)[:, :n].transpose(0, 1)
    return out


def warm_plans(q: torch.Tensor, kv_heads: int, scale: float, lo: int, hi: int) -> None:
    """Build cuDNN's plans for every padded length in ``[padded_len(lo), padded_len(hi)]``
    for queries like ``q`` (heads, head size, dtype, device) and ``kv_heads`` K/V heads."""
    mode = _mode(q)
    heads, dim = q.shape[1], q.shape[2]
    top = padded_len(hi)
    kv = kv_heads if mode == "gqa" else heads
    for length in range(padded_len(lo), top + 1, PAD_GRANULE):
        qb = q.new_zeros(heads, length, dim)
        kb = q.new_zeros(kv, length, dim)
        _attend(qb, kb, kb, scale)


__all__ = ["PAD_GRANULE", "cudnn_prefill_attention", "cudnn_prefill_available_for",
           "cudnn_prefill_support", "padded_len", "warm_plans"]
