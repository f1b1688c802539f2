"""The Triton MLA backend: latent write + absorbed decode through the Triton latent kernel.

``TritonMLABackend.forward`` (the MLA contract of ``mla.py``):
  1. writes the step's latent rows into the layer's cache with the index layer's writer
     (``reshape_and_cache`` on one-head views; slots < 0 skipped);
  2. single-token requests (decodes) attend absorbed: ``ql = W_UK^T q_nope`` for every row
     (one batched GEMM over the heads), ``mla_decode_attention`` over the latent cache
     (``mla_triton_decode``) gives the latent outputs, ``W_UV`` maps them to ``v_head_dim``
     (a second batched GEMM);
  3. requests with more tokens (prefill, chunked prefill over cached context) go through the
     torch reference's up-projected form (``mla_attention_ref(skip_decode=True)``: host lengths,
     one request at a time); their rows and the decode rows are disjoint (the other path leaves
     zeros), so the sum is each row's result;
  4. rows past ``query_start_loc[num_reqs]`` are zero.

A decode-only batch (``max_query_len <= 1``, every captured CUDA graph) reads host ints only:
its launches are CUDA-graph safe (``supports_cuda_graphs``). Without CUDA and without the Triton
interpreter the backend falls back to the torch reference, like the Triton attention backend.
"""

from __future__ import annotations

import torch

from pagedkv.attention.backend import AttentionLayout, AttentionMetadataLike, AttentionPlan
from pagedkv.attention.mla import MLABackend, MLAWeights, write_latent
from pagedkv.attention.mla_torch_ref import mla_attention_ref
from pagedkv.attention.mla_triton_decode import (
    MLADecodeConfig,
    _mla_decode_kernel,
    mla_decode_attention,
)
from pagedkv.errors import InvariantError
from pagedkv.kernels._common import use_triton


class TritonMLAPlan(AttentionPlan):
    """What :meth:`TritonMLABackend.forward` derives from one step's metadata once for every
    layer of the group: the path (Triton or the reference fallback), host ints, a workspace
    for the decode kernel's split partials, and the CUDA-graph capture state (a plan serves
    the forward passes it was made for, as ``TritonPlan``)."""

    __slots__ = ("slots", "triton", "workspace", "n", "decode_only", "max_seq_len", "capturing",
                 "checked")

    def __init__(self, metadata: AttentionMetadataLike, layout: AttentionLayout):
        super().__init__(metadata, layout)
        dev = layout.device
        self.capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
        self.slots = metadata.slot_mapping[: int(metadata.num_actual_tokens)]
        self.triton = use_triton(_mla_decode_kernel, metadata.slot_mapping)
        self.workspace: dict = {}
        self.n = int(metadata.num_reqs)
        self.decode_only = int(metadata.max_query_len) <= 1
        self.max_seq_len = int(metadata.max_seq_len)
        self.checked = False


class TritonMLABackend(MLABackend):
    """Paged MLA through the Triton latent decode kernel (see the module docstring).
    ``decode_config``: its launch parameters (default per device)."""

    name = "triton_mla"
    supports_cuda_graphs = True

    def __init__(self, *, decode_config: MLADecodeConfig | None = None):
        self.decode_config = decode_config

    def plan(self, metadata: AttentionMetadataLike, layout: AttentionLayout) -> TritonMLAPlan:
        return TritonMLAPlan(metadata, layout)

    def forward(self, layer_idx: int, q: torch.Tensor, latent: torch.Tensor | None,
                kv_cache: torch.Tensor, plan: TritonMLAPlan, scale: float,
                weights: MLAWeights) -> torch.Tensor:  # type: ignore[override]
        check = not plan.checked
        if check:  # first layer of the step (later layers have the same shapes)
            self.check_shapes(q, latent, kv_cache, weights)
            if (q.is_cuda and torch.cuda.is_current_stream_capturing()) != plan.capturing:
                raise InvariantError("plan-capture", "a plan serves the forward passes it was "
                                     "made for: make plans inside a CUDA-graph capture for the "
                                     "capture")
            plan.checked = True
        metadata = plan.metadata
        if latent is not None:
            write_latent(latent, kv_cache, plan.slots, writer="kernel" if plan.triton else "ref")
        if not plan.triton:
            return mla_attention_ref(q, kv_cache, metadata, scale, weights)
        n = plan.n
        t, h = q.shape[0], q.shape[1]
        if n == 0:
            return q.new_zeros((t, h, weights.v_head_dim))
        nope, rank = weights.qk_nope_head_dim, weights.kv_lora_rank
        # absorbed queries [T, H, L + R]: W_UK^T q_nope per head, then q_pe
        ql = torch.bmm(q[..., :nope].transpose(0, 1), weights.w_uk.to(q.dtype)).transpose(0, 1)
        q_lat = torch.cat([ql, q[..., nope:]], dim=-1)
        o_lat = (torch.empty if plan.decode_only else torch.zeros)((t, h, rank), dtype=q.dtype,
                                                                   device=q.device)
        if plan.decode_only and n < t:
            o_lat[n:].zero_()  # rows past the padded requests; padded requests' rows: the kernel
        mla_decode_attention(q_lat, kv_cache, metadata.block_table_tensor,
                             metadata.query_start_loc, metadata.seq_lens, n, scale, o_lat,
                             kv_lora_rank=rank, max_seq_len=plan.max_seq_len,
                             config=self.decode_config, zero_padded_rows=plan.decode_only,
                             check=check, workspace=plan.workspace)
        out = torch.bmm(o_lat.transpose(0, 1), weights.w_uv.to(q.dtype).transpose(1, 2)).transpose(0, 1)
        if plan.decode_only:
            return out
        return out + mla_attention_ref(q, kv_cache, metadata, scale, weights, skip_decode=True)


__all__ = ["TritonMLABackend", "TritonMLAPlan"]
