"""DeepSeek sparse attention (DSA, DeepSeek-V3.2) over the paged caches: the contract.

An attention layer of DeepSeek-V3.2 has two paged caches, each its own cache layer with its own
``MLAAttentionSpec`` (one "head" per token, no separate V), both written through the slot
mapping of their KV-cache group:

- the MLA latent cache ``[N, B, kv_lora_rank + qk_rope_head_dim]`` (``mla.py``): ``[c | k_pe]``;
- the indexer key cache ``[N, B, index_head_dim]``: the lightning indexer's key of each token
  (``k_norm(wk(x))``, RoPE on its first ``qk_rope_head_dim`` dimensions).

Token ``t`` of request ``r`` sits at position ``p_t = seq_lens[r] - query_len[r] + i`` (its
index ``i`` in the request's query rows); the request's positions ``0 .. p_t`` are in the
caches when it attends (the step writes its own rows first). Per layer and step:

1. :meth:`DSABackend.index_topk` writes the step's indexer keys, scores every position ``j <=
   p_t`` of the token's request, ``s(t, j) = sum_h w[t, h] relu(scale q[t, h] . k_j)``
   (``dsa_index_logits``), and returns ``int32 [T, K]``, ``K = min(topk, max_seq_len)``: the
   request-local positions of the ``min(topk, p_t + 1)`` best scores, best first, then ``-1``
   (padding tokens: all ``-1``). Ties are broken as ``torch.topk`` breaks them.
2. :meth:`DSABackend.forward` writes the step's latent rows, translates the top-k positions
   into flat slots of the latent cache and per-token lengths
   (``kernels.sparse_index.convert_req_index_to_global_index`` with the group's block table),
   and attends each token to exactly those rows (``mla_sparse_attention``), in the absorbed
   form: ``ql = W_UK^T q_nope`` per head, scores ``[ql | q_pe] . [c | k_pe]``, output
   ``W_UV (P c)``. Returns ``[T, H, v_head_dim]``; rows of padding tokens are zero.

With ``topk >= p_t + 1`` a token selects its whole causal context: DSA is then MLA.

The plan (:class:`DSAPlan`, one per step and KV-cache group) derives each token's request row
and position from the metadata once, on the device (no host sync). ``kernels``: "auto" (the
Triton kernels for CUDA tensors, the torch twins for CPU ones), "kernel" (always the kernels:
the Triton interpreter on CPU) or "ref" (always the twins); the KV writer follows
``writer`` as ``TorchRefMLABackend``'s. The top-k itself is ``torch.topk`` on either path.
The lengths and the top-k width come from host ints of the metadata: no CUDA graphs yet.
"""

from __future__ import annotations

import torch

from pagedkv.attention.backend import AttentionBackend, AttentionLayout, AttentionMetadataLike, AttentionPlan
from pagedkv.attention.dsa_index_logits import indexer_logits, indexer_logits_ref
from pagedkv.attention.kv_write import WRITERS
from pagedkv.attention.mla import MLABackend, MLAWeights, check_mla_cache, write_latent
from pagedkv.attention.mla_sparse_attention import sparse_mla_attention, sparse_mla_attention_ref
from pagedkv.errors import ConfigError, InvariantError

KERNEL_MODES = ("auto", "kernel", "ref")

# scores computed per chunk of tokens: logits elements of one chunk (bounds the [T, S] buffer
# of a long prefill)
_TOPK_CHUNK_ELEMENTS = 1 << 26


class DSAPlan(AttentionPlan):
    """One step's DSA plan for the layers of one KV-cache group: the metadata, whether the
    kernels run, and per token (``token_rows(T)``, computed once per row count): its request
    row (int32, -1 past the last request's tokens) and its position (int32);
    ``workspace``: the sparse attention kernel's split partials, shared by its layers."""

    __slots__ = ("kernels", "max_seq_len", "workspace", "_rows")

    def __init__(self, metadata: AttentionMetadataLike, layout: AttentionLayout | None,
                 kernels: bool):
        super().__init__(metadata, layout)
        self.kernels = kernels
        self.max_seq_len = int(metadata.max_seq_len)
        self.workspace: dict = {}
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def token_rows(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(req_id_per_token, positions)``, int32 ``[num_tokens]`` on the metadata's device:
        token ``t < query_start_loc[num_reqs]`` belongs to the request ``r`` with
        ``query_start_loc[r] <= t < query_start_loc[r + 1]`` and sits at ``seq_lens[r] -
        (query_start_loc[r + 1] - t)``; later (padding) tokens get ``-1`` for both."""
        got = self._rows.get(num_tokens)
        if got is None:
            got = self._rows[num_tokens] = token_rows(self.metadata, num_tokens)
        return got


def token_rows(metadata: AttentionMetadataLike, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(req_id_per_token, positions)`` of ``num_tokens`` packed tokens, int32 on the
    metadata's device, from its ``query_start_loc`` and ``seq_lens`` (no host sync): token
    ``t`` of request ``r`` (``query_start_loc[r] <= t < query_start_loc[r + 1]``) sits at
    ``seq_lens[r] - (query_start_loc[r + 1] - t)``; later (padding) tokens get ``-1``."""
    md = metadata
    n = int(md.num_reqs)
    qsl = md.query_start_loc.to(torch.int64)
    tok = torch.arange(num_tokens, device=qsl.device, dtype=torch.int64)
    if n == 0:
        none = torch.full((num_tokens,), -1, dtype=torch.int32, device=qsl.device)
        return none, none
    req = torch.searchsorted(qsl[1: n + 1], tok, right=True)
    ok = req < n
    req = req.clamp_(max=n - 1)
    pos = md.seq_lens[:n].to(torch.int64)[req] - (qsl[1: n + 1][req] - tok)
    return torch.where(ok, req, -1).to(torch.int32), torch.where(ok, pos, -1).to(torch.int32)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                 block_table: torch.Tensor, req_id_per_token: torch.Tensor,
                 last: torch.Tensor, num_s: int, topk: int, scale: float,
                 kernels: bool) -> torch.Tensor:
    """Each token's ``topk`` best cached entries by the lightning indexer's score (read only):
    int32 ``[T, min(topk, num_s)]``, request-local entry indices, best first, then ``-1``.

    Token ``t`` scores the entries ``j <= last[t]`` of its request (``req_id_per_token``, -1:
    none) in ``index_cache [N, B, D]`` through ``block_table`` (``dsa_index_logits``: the
    Triton kernel with ``kernels``, else its twin), ``num_s`` the widest request's entry
    count; ties are broken as ``torch.topk`` breaks them. DeepSeek-V3.2 scores positions
    (``last`` = the token's position); DeepSeek-V4 compressed entries (``last`` = its last
    closed group)."""
    t = q.shape[0]
    k = min(topk, num_s)
    out = torch.full((t, k), -1, dtype=torch.int32, device=q.device)
    if t == 0 or k == 0:
        return out
    fn = indexer_logits if kernels else indexer_logits_ref
    chunk = max(1, _TOPK_CHUNK_ELEMENTS // num_s)
    logits = torch.empty((min(t, chunk), num_s), dtype=torch.float32, device=q.device)
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        lg = fn(q[s:e], weights[s:e], index_cache, block_table, req_id_per_token[s:e],
                last[s:e], scale, logits[: e - s])
        vals, idx = lg.topk(k, dim=-1)
        out[s:e] = torch.where(vals == float("-inf"), -1, idx).to(torch.int32)
    return out


def check_sparse_modes(kernels: str, writer: str, family: str) -> None:
    """A DeepSeek sparse backend's ``kernels`` (``KERNEL_MODES``) and KV ``writer``
    (``WRITERS``), or a ``ConfigError`` naming ``family``."""
    if kernels not in KERNEL_MODES:
        raise ConfigError(f"unknown {family} kernel mode {kernels!r}; use one of "
                          f"{', '.join(KERNEL_MODES)}")
    if writer not in WRITERS:
        raise ConfigError(f"unknown KV writer {writer!r}; use one of {', '.join(WRITERS)}")


class DSABackend(AttentionBackend):
    """DeepSeek sparse attention over the paged latent and indexer caches (the contract in the
    module docstring). ``kernels``: "auto", "kernel" or "ref"; ``writer``: the KV writer
    ("auto", "kernel", "ref", see ``write_latent``)."""

    name = "dsa"
    supports_cuda_graphs = False

    def __init__(self, kernels: str = "auto", writer: str = "auto"):
        check_sparse_modes(kernels, writer, "DSA")
        self.kernels = kernels
        self.writer = writer

    def plan(self, metadata: AttentionMetadataLike, layout: AttentionLayout | None) -> DSAPlan:
        if self.kernels == "auto":
            kernels = metadata.slot_mapping.is_cuda
        else:
            kernels = self.kernels == "kernel"
        return DSAPlan(metadata, layout, kernels)

    # ---- 1. the indexer's top-k
    def index_topk(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor | None,
                   index_cache: torch.Tensor, plan: DSAPlan, topk: int,
                   scale: float) -> torch.Tensor:
        """Write ``keys [T, D]`` (None: already written) into ``index_cache [N, B, D]`` at the
        plan's slot mapping, then each token's top-``topk`` positions (module docstring):
        int32 ``[T, min(topk, max_seq_len)]``, request-local, -1 = none.

        ``q [T, H, D]``: the indexer's query heads; ``weights [T, H]`` (float32): the per-head
        weights (``weights_proj(x) * H ** -0.5``); ``scale``: the score scale (``D ** -0.5``).
        """
        check_mla_cache(index_cache, q.shape[2] if q.dim() == 3 else None)
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ConfigError(f"index topk must be a positive int, got {topk!r}")
        md = plan.metadata
        t = q.shape[0]
        if keys is not None:
            n = int(md.num_actual_tokens)
            write_latent(keys, index_cache, md.slot_mapping[:n], writer=self.writer)
        req, pos = plan.token_rows(t)
        return indexer_topk(q, weights, index_cache, md.block_table_tensor, req, pos,
                            plan.max_seq_len, topk, scale, plan.kernels)

    # ---- 2. the sparse latent attention
    def forward(self, layer_idx: int, q: torch.Tensor, latent: torch.Tensor | None,
                kv_cache: torch.Tensor, plan: DSAPlan, scale: float, weights: MLAWeights,
                topk_indices: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Write ``latent`` at the plan's slot mapping, attend each token to the latent rows of
        its ``topk_indices [T, K]`` (request-local positions, -1 = none; what
        :meth:`index_topk` returns); ``[T, H, v_head_dim]``."""
        from pagedkv.kernels.sparse_index import (
            convert_req_index_to_global_index,
            convert_req_index_to_global_index_ref,
        )

        MLABackend.check_shapes(q, latent, kv_cache, weights)
        t = q.shape[0]
        if topk_indices.dim() != 2 or topk_indices.shape[0] != t:
            raise InvariantError("dsa-topk-shape", "topk_indices must be [T, K], a row per "
                                 "query token", topk_shape=tuple(topk_indices.shape), tokens=t)
        md = plan.metadata
        if latent is not None:
            n = int(md.num_actual_tokens)
            write_latent(latent, kv_cache, md.slot_mapping[:n], writer=self.writer)
        req, _ = plan.token_rows(t)
        slots = torch.empty(topk_indices.shape, dtype=torch.int32, device=q.device)
        lens = torch.empty(t, dtype=torch.int32, device=q.device)
        translate = (convert_req_index_to_global_index if plan.kernels
                     else convert_req_index_to_global_index_ref)
        translate(req, md.block_table_tensor, topk_indices, kv_cache.shape[1], slots, lens)
        nope, rank = weights.qk_nope_head_dim, weights.kv_lora_rank
        # absorbed queries [T, H, L + R]: W_UK^T q_nope per head, then q_pe
        if q.dtype == torch.float32 or not plan.kernels:
            f32 = torch.float32
            ql = torch.einsum("thn,hnl->thl", q[..., :nope].to(f32), weights.w_uk.to(f32))
            q_lat = torch.cat([ql, q[..., nope:].to(f32)], dim=-1)
        else:
            ql = torch.bmm(q[..., :nope].transpose(0, 1), weights.w_uk.to(q.dtype)).transpose(0, 1)
            q_lat = torch.cat([ql, q[..., nope:]], dim=-1)
        o_lat = torch.empty((t, q.shape[1], rank), dtype=q_lat.dtype, device=q.device)
        attend = sparse_mla_attention if plan.kernels else sparse_mla_attention_ref
        attend(q_lat, kv_cache, slots, lens, scale, o_lat, kv_lora_rank=rank,
               workspace=plan.workspace)
        out = torch.einsum("thl,hvl->thv", o_lat, weights.w_uv.to(o_lat.dtype))
        return out.to(q.dtype)


def sparse_backend_modes(backend: AttentionBackend, family: str) -> tuple[str, str]:
    """``(kernels, writer)`` of the DeepSeek sparse backends (DSA, DeepSeek-V4) standing in for
    an engine's attention backend: the torch references (``TorchRefBackend``,
    ``TorchRefMLABackend``) -> the twins with the same KV writer; the Triton backends -> the
    kernels ("auto": on CUDA tensors). ``family`` names the variant in the error."""
    from pagedkv.attention.mla_torch_ref import TorchRefMLABackend
    from pagedkv.attention.mla_triton_backend import TritonMLABackend
    from pagedkv.attention.torch_ref import TorchRefBackend
    from pagedkv.attention.triton_backend import TritonAttentionBackend

    if isinstance(backend, (TorchRefBackend, TorchRefMLABackend)):
        return "ref", backend.writer
    if isinstance(backend, (TritonAttentionBackend, TritonMLABackend)):
        return "auto", "auto"
    raise ConfigError(f"attention backend {type(backend).__name__} has no {family} variant; "
                      "use 'torch_ref' or 'triton'")


def dsa_backend_for(backend: AttentionBackend) -> DSABackend:
    """The DSA counterpart of an engine's attention backend: a :class:`DSABackend` as it is,
    else as ``sparse_backend_modes`` says."""
    if isinstance(backend, DSABackend):
        return backend
    kernels, writer = sparse_backend_modes(backend, "DeepSeek sparse attention (DSABackend)")
    return DSABackend(kernels=kernels, writer=writer)


__all__ = ["DSABackend", "DSAPlan", "KERNEL_MODES", "check_sparse_modes", "dsa_backend_for",
           "indexer_topk", "sparse_backend_modes", "token_rows"]
