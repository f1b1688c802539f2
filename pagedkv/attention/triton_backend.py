"""The Triton attention backend: KV write + paged decode + paged prefill/extend in one call.

``TritonAttentionBackend.forward`` (conventions in ``backend.py``):
  1. writes the step's K/V into the layer's cache with the index layer's writer
     (``pagedkv.kernels.reshape_and_cache``; slots < 0 skipped, token count from the slot
     mapping);
  2. serves the batch, whatever the order of its rows:
       * requests with one query token -> ``paged_decode_attention`` (GQA-packed, split-KV);
       * requests with more -> ``paged_prefill_attention`` (causal, context through the block
         table), which skips the single-token requests when the decode kernel runs;
       * a batch of fresh prefills only (every request's ``seq_len == query_len``) ->
         ``varlen_prefill_attention`` (torch's varlen flash kernel) where ``fresh_prefill``
         selects it and it is available (CUDA, bf16/fp16);
  3. rows past ``query_start_loc[num_reqs]`` (CUDA-graph padding) are zero.

Host work per call reads only host ints and the metadata's ``*_cpu`` copies: a decode-only
batch (``max_query_len <= 1``) costs no array work at all and its launches depend on host ints
only (CUDA-graph safe); a mixed batch takes one ``numpy.diff`` of ``query_start_loc_cpu``.

Without CUDA and without the Triton interpreter (compiled Triton cannot run on CPU tensors) the
backend falls back to ``paged_attention_ref``, like the index layer's launchers do.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedkv.attention.backend import AttentionBackend, AttentionMetadataLike
from pagedkv.attention.torch_ref import paged_attention_ref
from pagedkv.attention.triton_decode import (
    DecodeConfig,
    _decode_kernel,
    paged_decode_attention,
)
from pagedkv.attention.triton_prefill import (
    PrefillConfig,
    paged_prefill_attention,
    varlen_available,
    varlen_prefill_attention,
)
from pagedkv.errors import ConfigError, InvariantError
from pagedkv.kernels._common import use_triton
from pagedkv.kernels.reshape_and_cache import reshape_and_cache

FRESH_PREFILL_CHOICES = ("auto", "triton", "varlen")
# What "auto" picks for batches of fresh prefills on CUDA (bf16/fp16). Measured on the H200
# (bench/bench_attention_gpu.py, 8 x 2048 causal, 16 q / 8 KV heads, head_dim 128, bf16):
# the paged Triton kernel 511 us (269 TFLOP/s); torch 2.11's varlen_attn 676 us (203) with the
# K/V heads repeated to 16 as that torch requires (it has no enable_gqa), 500 us (275) for its
# kernel alone. The Triton kernel wins as the backend can call them.
AUTO_FRESH_PREFILL = "triton"


def _host_ints(x, n: int) -> np.ndarray:
    """The first ``n`` entries of a host tensor / array / sequence as an int64 numpy array."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ConfigError("attention metadata: the *_cpu fields must live on the CPU")
        return x[:n].numpy().astype(np.int64, copy=False)
    return np.asarray(x, dtype=np.int64)[:n]


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through Triton kernels (see the module docstring).

    Args:
        fresh_prefill: for batches of fresh prefills only: ``"triton"`` (the paged prefill
            kernel), ``"varlen"`` (torch's varlen flash attention where available, else the
            Triton kernel) or ``"auto"`` (the faster one on the H200: ``AUTO_FRESH_PREFILL``).
        decode_config / prefill_config: launch parameters (default per device).
    """

    name = "triton"
    # Grids and buffers depend only on host ints fixed at capture: safe to replay in a CUDA graph.
    cuda_graph_capturable = True

    def __init__(self, *, fresh_prefill: str = "auto", decode_config: DecodeConfig | None = None,
                 prefill_config: PrefillConfig | None = None):
        if fresh_prefill not in FRESH_PREFILL_CHOICES:
            raise ConfigError(f"unknown fresh_prefill {fresh_prefill!r}; use one of "
                              f"{', '.join(FRESH_PREFILL_CHOICES)}")
        self.fresh_prefill = AUTO_FRESH_PREFILL if fresh_prefill == "auto" else fresh_prefill
        self.decode_config = decode_config
        self.prefill_config = prefill_config

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadataLike,
        scale: float,
    ) -> torch.Tensor:
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise InvariantError("kv-cache-shape",
                                 "KV cache must be [2, num_blocks, block_size, num_kv_heads, head_dim]",
                                 cache_shape=tuple(kv_cache.shape))
        num_actual = int(metadata.num_actual_tokens)
        reshape_and_cache(k, v, kv_cache[0], kv_cache[1], metadata.slot_mapping[:num_actual])
        if not use_triton(_decode_kernel, kv_cache):
            return paged_attention_ref(q, kv_cache, metadata, scale)

        n = int(metadata.num_reqs)
        out = torch.empty_like(q)
        if n == 0:
            return out.zero_()
        end = int(_host_ints(metadata.query_start_loc_cpu, n + 1)[n])
        if end > q.shape[0]:
            raise InvariantError("attention-token-count", "query_start_loc ends past the query rows",
                                 end=end, rows=q.shape[0])
        if end < q.shape[0]:
            out[end:].zero_()
        qsl = metadata.query_start_loc
        seq_lens = metadata.seq_lens
        table = metadata.block_table_tensor
        max_q = int(metadata.max_query_len)
        if max_q <= 1:  # decode-only batch: host ints only
            paged_decode_attention(q, kv_cache, table, qsl, seq_lens, n, scale, out,
                                   max_seq_len=int(metadata.max_seq_len),
                                   config=self.decode_config)
            return out

        qsl_h = _host_ints(metadata.query_start_loc_cpu, n + 1)
        q_lens = np.diff(qsl_h)
        seq_h = _host_ints(metadata.seq_lens_cpu, n)
        if (q_lens < 0).any() or (seq_h < q_lens).any():
            r = int(np.flatnonzero((q_lens < 0) | (seq_h < q_lens))[0])
            raise InvariantError("attention-lengths", "need 0 <= query_len <= seq_len",
                                 request=r, query_len=int(q_lens[r]), seq_len=int(seq_h[r]))
        if (self.fresh_prefill == "varlen" and varlen_available(q)
                and np.array_equal(seq_h, q_lens)):
            varlen_prefill_attention(q, k, v, qsl[: n + 1], end, max_q, scale, out)
            return out
        has_decode = bool((q_lens == 1).any())
        if has_decode:
            paged_decode_attention(q, kv_cache, table, qsl, seq_lens, n, scale, out,
                                   max_seq_len=int(metadata.max_seq_len),
                                   config=self.decode_config)
        paged_prefill_attention(q, kv_cache, table, qsl, seq_lens, n, scale, out,
                                num_tokens=end, skip_decode=has_decode,
                                config=self.prefill_config)
        return out


__all__ = ["AUTO_FRESH_PREFILL", "FRESH_PREFILL_CHOICES", "TritonAttentionBackend"]
