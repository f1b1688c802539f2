"""Plain torch reference attention over a paged KV cache (CPU and GPU).

Slow and simple on purpose: one loop over requests, each gathering its context from the block
table and attending in float32. Serves mixed batches (prefill, chunked prefill with context
already cached, decode). The reference the Triton backends are tested against.
"""

from __future__ import annotations

import torch

from pagedkv.attention.backend import AttentionBackend, AttentionMetadataLike, AttentionPlan
from pagedkv.attention.kv_write import WRITERS, write_kv
from pagedkv.errors import ConfigError, InvariantError
from pagedkv.kernels.fp8_kv import check_kv_scale, dequantize_ref


def _as_list(x) -> list[int]:
    return [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadataLike,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
    lse: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    cp: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [T, H, D]`` over each request's paged context (read only).

    ``sliding_window`` W: a query at position ``p`` sees the keys ``p - W < k <= p`` (W keys,
    itself included, as transformers' and vLLM's windows); only the blocks that hold such keys
    are read (older ones may be the null block, as the sliding-window manager leaves them).
    ``logits_soft_cap`` c: scores become ``c * tanh(scores / c)`` before the softmax.
    ``sinks [H]`` (GPT-OSS's attention sinks): per query head one more logit in the softmax,
    as is (not scaled or capped), whose probability is dropped: ``exp(sink)`` joins the
    denominator only. Rows past ``metadata.num_actual_tokens`` are zero.

    ``causal=False``: every query row of a request sees all of its ``seq_len`` keys (then
    ``seq_len`` may be below the query count; no sliding window). Cascade attention's shared
    prefix is such a request: the whole batch's queries against the prefix blocks.
    ``lse``: a float32 ``[T, H]`` tensor that receives, for every served row, the natural-log
    log-sum-exp of the row's (scaled, capped, masked) scores, the sink included: the log of the
    softmax denominator the output was normalized by. Other rows are left as they are.

    An FP8 cache (``float8_e4m3fn``) is dequantized after the gather: K as ``k * k_scale``,
    V as ``v * v_scale`` in float32 (``pagedkv.kernels.fp8_kv``); the scales do not apply to
    other caches.

    ``cp = (world, rank, interleave)``: decode context parallelism, this cache being rank
    ``rank``'s share (the slot mapping's CP rule, reference sec. 12): a request's local keys
    ``j < dcp_local_seq_lens(seq_len)`` lie in table order (block ``j // B``, offset ``j % B``)
    and sit at the global positions ``cp_global_positions``; queries sit at the global
    positions ``seq_len - q_len ...``. A row that sees no local key gets zeros and
    ``lse = -inf`` (the merge across the ranks weighs it 0).
    """
    check_kv_scale("paged_attention_ref", "k_scale", k_scale)
    check_kv_scale("paged_attention_ref", "v_scale", v_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if num_heads % num_kv_heads:
        raise InvariantError("attention-gqa", "query heads are not a multiple of KV heads",
                             num_heads=num_heads, num_kv_heads=num_kv_heads)
    group = num_heads // num_kv_heads
    if not causal and sliding_window:
        raise InvariantError("attention-noncausal-window",
                             "non-causal attention takes no sliding window",
                             sliding_window=sliding_window)
    n = int(metadata.num_reqs)
    qsl = _as_list(metadata.query_start_loc_cpu)[: n + 1]
    seq_lens = _as_list(metadata.seq_lens_cpu)[:n]
    table = metadata.block_table_tensor
    if n and qsl[n] > num_tokens:
        raise InvariantError("attention-token-count", "query_start_loc ends past the query rows",
                             end=qsl[n], rows=num_tokens)
    out = torch.zeros_like(q)
    for r in range(n):
        start, end = qsl[r], qsl[r + 1]
        q_len, seq_len = end - start, seq_lens[r]
        if q_len == 0:
            continue
        if q_len < 0 or (causal and seq_len < q_len):
            raise InvariantError("attention-lengths", "need 0 <= query_len <= seq_len",
                                 request=r, query_len=q_len, seq_len=seq_len)
        n_keys = seq_len if cp is None else _cp_local_len(seq_len, cp)
        num_blocks = -(-n_keys // block_size)
        if num_blocks > table.shape[1]:
            raise InvariantError("attention-table-width", "sequence needs more blocks than the table has",
                                 request=r, blocks=num_blocks, width=table.shape[1])
        # first key any query of the request sees, and its block (earlier blocks are not read)
        k_lo = max(0, seq_len - q_len - sliding_window + 1) if sliding_window else 0
        b_lo = k_lo // block_size if cp is None else 0
        blocks = table[r, b_lo:num_blocks].to(torch.int64)
        first = b_lo * block_size
        k = dequantize_ref(kv_cache[0][blocks].reshape(-1, num_kv_heads, head_dim)
                           [: n_keys - first], k_scale)
        v = dequantize_ref(kv_cache[1][blocks].reshape(-1, num_kv_heads, head_dim)
                           [: n_keys - first], v_scale)
        qr = q[start:end].reshape(q_len, num_kv_heads, group, head_dim).to(torch.float32)
        scores = torch.einsum("qhgd,khd->hgqk", qr, k) * scale
        if logits_soft_cap:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = (torch.arange(first, seq_len, device=q.device) if cp is None
                 else cp_global_positions(n_keys, block_size, *cp).to(q.device))
        if causal:
            visible = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [q_len, keys]
        else:
            visible = torch.ones(q_len, k_pos.shape[0], dtype=torch.bool, device=q.device)
        if sliding_window:
            visible &= k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - sliding_window
        # keys of the first block before the window hold finite values but are not attended:
        # their V rows are zeroed so that 0 * NaN (a never-written slot) cannot occur
        v = torch.where((k_pos >= k_lo)[:, None, None], v, torch.zeros((), dtype=v.dtype))
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.to(torch.float32).reshape(num_kv_heads, group, 1, 1)
            scores = torch.cat((scores, sink.expand(-1, -1, q_len, 1)), dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., :-1]
        elif cp is not None:  # a rank may hold no key a row sees: zeros, not NaN
            probs = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))
            probs = torch.nan_to_num(probs, nan=0.0)
        else:
            probs = torch.softmax(scores, dim=-1)
        if lse is not None:
            row_lse = torch.logsumexp(scores, dim=-1)  # [Hkv, G, q_len]
            lse[start:end] = row_lse.permute(2, 0, 1).reshape(q_len, num_heads).to(lse.dtype)
        o = torch.einsum("hgqk,khd->qhgd", probs, v)
        out[start:end] = o.reshape(q_len, num_heads, head_dim).to(q.dtype)
    return out


def _cp_local_len(seq_len: int, cp: tuple[int, int, int]) -> int:
    world, rank, inter = cp
    base = seq_len // inter // world * inter
    return base + min(max(seq_len - base * world - rank * inter, 0), inter)


def cp_global_positions(n_local: int, block_size: int, world: int, rank: int,
                        interleave: int) -> torch.Tensor:
    """The global positions of a request's first ``n_local`` keys on CP rank ``rank`` (the
    inverse of the slot mapping's CP rule: local index ``j`` = block ``j // B``, offset
    ``o = j % B`` holds position ``(j // B) * B * world + (o // I) * I * world + rank * I +
    o % I``), int64."""
    j = torch.arange(n_local, dtype=torch.int64)
    o = j % block_size
    return ((j // block_size) * block_size * world + (o // interleave) * interleave * world
            + rank * interleave + o % interleave)


class TorchRefBackend(AttentionBackend):
    """KV write (the index layer's writer, see ``write_kv``) + ``paged_attention_ref``.

    ``writer``: "auto" (Triton kernel for CUDA caches, its torch twin for CPU caches),
    "kernel" or "ref".
    """

    name = "torch_ref"
    # reads the host copies of the lengths per request: a CUDA graph would freeze them
    supports_cuda_graphs = False

    def __init__(self, writer: str = "auto"):
        if writer not in WRITERS:
            raise ConfigError(f"unknown KV writer {writer!r}; use one of {', '.join(WRITERS)}")
        self.writer = writer
        # decode context parallelism: this rank's DCP group (``pagedkv.distributed.group``
        # ``DCPGroup``), set by the tensor-parallel worker; None without DCP
        self.dcp = None

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
        scale: float,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        metadata = plan.metadata
        if k is not None:
            n = int(metadata.num_actual_tokens)
            write_kv(k, v, kv_cache, metadata.slot_mapping[:n], writer=self.writer,
                     k_scale=k_scale, v_scale=v_scale)
        layout = plan.layout
        if self.dcp is not None:
            if sinks is not None:
                raise ConfigError("attention sinks under decode context parallelism are not "
                                  "supported (each rank would count the sink once)")
            return self.dcp.attend(q, kv_cache, plan, scale, sliding_window=layout.sliding_window,
                                   logits_soft_cap=layout.logits_soft_cap, k_scale=k_scale,
                                   v_scale=v_scale, layer_idx=layer_idx)
        return paged_attention_ref(q, kv_cache, metadata, scale,
                                   sliding_window=layout.sliding_window,
                                   logits_soft_cap=layout.logits_soft_cap, sinks=sinks,
                                   k_scale=k_scale, v_scale=v_scale)


__all__ = ["TorchRefBackend", "cp_global_positions", "paged_attention_ref"]
