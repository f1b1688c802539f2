"""Plain torch reference of multi-head latent attention over the paged latent cache.

One loop over requests (host lengths), each gathering its latent rows ``[c | k_pe]`` from the
block table, in float32 (the contract in ``mla.py``):

- a request with one query token (decode) attends *absorbed*: ``ql = W_UK^T q_nope`` per head,
  scores ``[ql | q_pe] . latent`` over the latent rows, output ``W_UV (P c)``;
- a request with more (prefill, chunked prefill over cached context) attends *up-projected*:
  ``k_nope, v = kv_b_proj(c)`` for its cached latents, keys ``[k_nope | k_pe]``, causal.

``absorb`` switches the rule for tests: ``"decode"`` (default, as above), ``"all"`` (every
request absorbed) or ``"never"`` (every request up-projected). The two forms are the same
attention in exact arithmetic; in float32 they differ by rounding only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv.attention.backend import AttentionMetadataLike, AttentionPlan
from pagedkv.attention.kv_write import WRITERS
from pagedkv.attention.mla import MLABackend, MLAWeights, write_latent
from pagedkv.errors import ConfigError, InvariantError

ABSORB_RULES = ("decode", "all", "never")


def _as_list(x) -> list[int]:
    return [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]


def mla_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadataLike,
                      scale: float, weights: MLAWeights, *, absorb: str = "decode",
                      skip_decode: bool = False) -> torch.Tensor:
    """``[T, H, v_head_dim]``: causal MLA of ``q [T, H, nope + rope]`` over each request's
    latent rows in ``kv_cache [N, B, L + R]`` (read only). Rows of no request are zero, and so
    are the rows of single-token requests with ``skip_decode`` (another path serves them)."""
    if absorb not in ABSORB_RULES:
        raise ConfigError(f"unknown absorb rule {absorb!r}; use one of {', '.join(ABSORB_RULES)}")
    MLABackend.check_shapes(q, None, kv_cache, weights)
    num_tokens, num_heads, _ = q.shape
    block_size, width = kv_cache.shape[1], kv_cache.shape[2]
    rank, nope, vdim = weights.kv_lora_rank, weights.qk_nope_head_dim, weights.v_head_dim
    n = int(metadata.num_reqs)
    qsl = _as_list(metadata.query_start_loc_cpu)[: n + 1]
    seq_lens = _as_list(metadata.seq_lens_cpu)[:n]
    table = metadata.block_table_tensor
    if n and qsl[n] > num_tokens:
        raise InvariantError("attention-token-count", "query_start_loc ends past the query rows",
                             end=qsl[n], rows=num_tokens)
    out = q.new_zeros((num_tokens, num_heads, vdim))
    f32 = torch.float32
    kv_b = weights.kv_b.to(f32)
    w_uk, w_uv = weights.w_uk.to(f32), weights.w_uv.to(f32)
    for r in range(n):
        start, end = qsl[r], qsl[r + 1]
        q_len, seq_len = end - start, seq_lens[r]
        if q_len == 0 or (skip_decode and q_len == 1):
            continue
        if q_len < 0 or seq_len < q_len:
            raise InvariantError("attention-lengths", "need 0 <= query_len <= seq_len",
                                 request=r, query_len=q_len, seq_len=seq_len)
        num_blocks = -(-seq_len // block_size)
        if num_blocks > table.shape[1]:
            raise InvariantError("attention-table-width", "sequence needs more blocks than the "
                                 "table has", request=r, blocks=num_blocks, width=table.shape[1])
        blocks = table[r, :num_blocks].to(torch.int64)
        lat = kv_cache[blocks].reshape(-1, width)[:seq_len].to(f32)  # [S, L + R]
        c = lat[:, :rank]
        qr = q[start:end].to(f32)
        q_nope, q_pe = qr[..., :nope], qr[..., nope:]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        future = (k_pos.unsqueeze(0) > q_pos.unsqueeze(1)).unsqueeze(0)  # [1, q, S]
        if absorb == "all" or (absorb == "decode" and q_len == 1):
            ql = torch.einsum("qhn,hnl->qhl", q_nope, w_uk)  # q_nope absorbed: [q, H, L]
            scores = torch.einsum("qhd,kd->hqk", torch.cat([ql, q_pe], dim=-1), lat) * scale
            probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            o_lat = torch.einsum("hqk,kl->qhl", probs, c)  # [q, H, L]
            o = torch.einsum("qhl,hvl->qhv", o_lat, w_uv)
        else:
            kv = F.linear(c, kv_b).view(seq_len, num_heads, nope + vdim)
            k_nope, v = kv[..., :nope], kv[..., nope:]
            k = torch.cat([k_nope, lat[:, None, rank:].expand(seq_len, num_heads, -1)], dim=-1)
            scores = torch.einsum("qhd,khd->hqk", qr, k) * scale
            probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            o = torch.einsum("hqk,khv->qhv", probs, v)
        out[start:end] = o.to(q.dtype)
    return out


class TorchRefMLABackend(MLABackend):
    """Latent write (the index layer's writer, see ``write_latent``) + :func:`mla_attention_ref`.

    ``writer``: "auto" (Triton kernel for CUDA caches, its torch twin for CPU caches),
    "kernel" or "ref"; ``absorb``: see the module docstring."""

    name = "torch_ref_mla"
    # reads the host copies of the lengths per request: a CUDA graph would freeze them
    supports_cuda_graphs = False

    def __init__(self, writer: str = "auto", absorb: str = "decode"):
        if writer not in WRITERS:
            raise ConfigError(f"unknown KV writer {writer!r}; use one of {', '.join(WRITERS)}")
        if absorb not in ABSORB_RULES:
            raise ConfigError(f"unknown absorb rule {absorb!r}; use one of {', '.join(ABSORB_RULES)}")
        self.writer = writer
        self.absorb = absorb

    def forward(self, layer_idx: int, q: torch.Tensor, latent: torch.Tensor | None,
                kv_cache: torch.Tensor, plan: AttentionPlan, scale: float,
                weights: MLAWeights) -> torch.Tensor:  # type: ignore[override]
        self.check_shapes(q, latent, kv_cache, weights)
        metadata = plan.metadata
        if latent is not None:
            n = int(metadata.num_actual_tokens)
            write_latent(latent, kv_cache, metadata.slot_mapping[:n], writer=self.writer)
        return mla_attention_ref(q, kv_cache, metadata, scale, weights, absorb=self.absorb)


__all__ = ["ABSORB_RULES", "TorchRefMLABackend", "mla_attention_ref"]
