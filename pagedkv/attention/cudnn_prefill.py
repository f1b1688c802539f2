"""Fresh prefills through cuDNN's varlen flash attention (torch's ``_cudnn_attention_forward``).

A fresh prefill request (no cached context: ``seq_len == query_len``) attends causally to its
own new tokens only, so its keys and values are contiguous rows of the step and need no block
table. cuDNN's fused attention over packed ("ragged") sequences serves such requests in one
launch per run of consecutive requests; on the H200 it reaches 540 TFLOP/s on a 7,000-token
prompt where the paged Triton kernel stays near 320 (BENCHMARKS.md, twelfth session). The
Triton backend hands it the fresh requests of at least ``min_query_len`` tokens of any step,
mixed steps included (``TritonAttentionBackend(fresh_prefill="cudnn")``), and tells the paged
prefill kernel to skip them.

Layout: ``q [N, H, D]``, ``k``/``v [N, Hkv, D]`` (rows of the run's requests, in order),
``cu_seqlens`` int32 ``[R + 1]`` from 0 to ``N`` on the device, ``max_len`` a host int. Where
the backend's caller wrote the step's K/V into the cache itself (the models' fused q/k-norm +
RoPE + K/V-write kernel), ``gather_kv`` reads them back by the step's slots.

Availability is decided once per device by a probe (:func:`cudnn_prefill_support`): a small
grouped-query call against the plain reference; where cuDNN rejects grouped-query heads the
K/V heads are repeated to the query heads, and where it fails or differs the path is off.
"""

from __future__ import annotations

import functools

import torch

from pagedkv.errors import ConfigError

_DTYPES = (torch.bfloat16, torch.float16)


def _op():
    """torch's cuDNN attention forward (packed sequences), or None in a torch without it."""
    return getattr(torch.ops.aten, "_cudnn_attention_forward", None)


def _call(q, k, v, cu_seqlens, max_len: int, scale: float) -> torch.Tensor:
    return _op()(q, k, v, None, cu_seqlens, cu_seqlens, int(max_len), int(max_len), False,
                 0.0, True, False, scale=float(scale))[0]


def _reference(q, k, v, lens, scale) -> torch.Tensor:
    """Plain causal attention of packed sequences (fp32): the probe's expectation."""
    out, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lens:
        qs = q[start:start + n].float().transpose(0, 1)
        ks = k[start:start + n].float().repeat_interleave(group, 1).transpose(0, 1)
        vs = v[start:start + n].float().repeat_interleave(group, 1).transpose(0, 1)
        s = qs @ ks.transpose(1, 2) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        out.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


@functools.lru_cache(maxsize=None)
def cudnn_prefill_support(device_index: int, dtype: torch.dtype, head_dim: int) -> str | None:
    """How this device runs cuDNN varlen attention for ``dtype`` / ``head_dim``: ``"gqa"``
    (grouped-query heads natively), ``"repeat"`` (K/V heads repeated) or None (not at all).
    Decided by a probe (three sequences of 1, 37 and 100 tokens, 4 query / 2 K/V heads)
    against :func:`_reference` at 2e-2; synchronizes once per device, dtype and head size."""
    if (_op() is None or not torch.cuda.is_available() or dtype not in _DTYPES
            or head_dim % 8 or head_dim > 128 or not torch.backends.cudnn.is_available()):
        return None
    dev = torch.device("cuda", device_index)
    gen = torch.Generator(device=dev).manual_seed(0)
    lens = (1, 37, 100)
    n = sum(lens)
    q = torch.randn(n, 4, head_dim, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(n, 2, head_dim, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(n, 2, head_dim, device=dev, dtype=dtype, generator=gen)
    cu = torch.tensor((0, 1, 38, n), dtype=torch.int32, device=dev)
    scale = head_dim ** -0.5
    want = _reference(q, k, v, lens, scale)
    for mode in ("gqa", "repeat"):
        try:
            kk, vv = (k, v) if mode == "gqa" else (k.repeat_interleave(2, 1),
                                                   v.repeat_interleave(2, 1))
            got = _call(q, kk, vv, cu, max(lens), scale).float()
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


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``slots`` of a ``[2, num_blocks, block_size, Hkv, D]`` cache as ``[N, Hkv, D]`` K
    and V (the step's K/V that a fused writer put there)."""
    heads, dim = kv_cache.shape[3], kv_cache.shape[4]
    try:
        k_rows = kv_cache[0].view(-1, heads, dim)
        v_rows = kv_cache[1].view(-1, heads, dim)
    except RuntimeError as e:
        raise ConfigError("gather_kv: the cache halves must be viewable as [slots, Hkv, D]") from e
    idx = slots.long()
    return k_rows.index_select(0, idx), v_rows.index_select(0, idx)


def cudnn_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens: torch.Tensor, max_len: int, scale: float,
                            out: torch.Tensor) -> torch.Tensor:
    """Causal attention of packed fresh sequences into ``out [N, H, D]`` (module docstring).
    ``q``/``k``/``v`` with a contiguous last dimension; copied contiguous where they are not
    (cuDNN's packed layout)."""
    fn = "cudnn_prefill_attention"
    mode = cudnn_prefill_support(q.device.index if q.device.index is not None
                                 else torch.cuda.current_device(), q.dtype, q.shape[-1]) \
        if q.is_cuda else None
    if mode is None:
        raise ConfigError(f"{fn}: cuDNN varlen attention is not available for "
                          f"{q.dtype} / head_dim {q.shape[-1]} on {q.device}")
    if (q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]
            or q.shape[1] % k.shape[1] or out.shape != q.shape):
        raise ConfigError(f"{fn}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                          f"out {tuple(out.shape)} do not fit [N, H, D] / [N, Hkv, D]")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    group = q.shape[1] // k.shape[1]
    if group > 1 and mode == "repeat":
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out.copy_(_call(q, k, v, cu_seqlens, max_len, scale))
    return out


__all__ = ["cudnn_prefill_attention", "cudnn_prefill_available_for", "cudnn_prefill_support",
           "gather_kv"]
