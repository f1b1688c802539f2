"""DeepSeek-V4 attention over its paged channels: the contract and the torch references.

A DeepSeek-V4 attention layer reads up to five cache layers, each a KV-cache group channel of
its own (``pagedkv.models.deepseek_v4`` declares them), all one vector per token or state
(``[num_blocks, block_or_states, width]``, the MLA layout):

* the sliding-window latent (``SlidingWindowMLASpec``, window W): the shared key = value
  vector of every token; its group's metadata (``SlidingWindowMLAMetadata``,
  ``pagedkv.worker.dsv4_builders``) lists, per token at position ``p``, the slots of ``p - W
  < j <= p`` (``swa_indices`` / ``swa_lens``);
* the compressed latent (``MLAAttentionSpec`` with ``compress_ratio`` C): one entry per
  closed group of C tokens, written by the closing token only, at the group's
  ``compressed_slot_mapping`` (``CompressedMLAMetadata``); entry ``w`` of a request sits at
  ``table[r, w // S] * S + w % S`` (``topk_to_global``);
* the compressor's state (``SlidingWindowMLASpec``, window C or 2C, float32): per token its
  ``[kv | score]`` projections, read back by the closing token through its window's slot
  list (chunked prefill and decode steps see the tokens of earlier steps);
* for compressed sparse attention, the indexer's compressed keys and its compressor state
  (the same two kinds of channel at ``index_head_dim``).

One step, per layer: the layer writes its rows (:meth:`Dsv4Backend.write`, the index
layer's KV writer: ``slot < 0`` skipped), computes the entries of its closing tokens, and
attends each query to the union of its window's latents and its compressed entries (all of
those of HCA, the indexer's top-k of CSA) with the layer's sinks: :func:`dsv4_attention_ref`.

:class:`Dsv4Backend` is the engine's backend for the family: ``metadata_builder_for`` gives
the runner the DeepSeek-V4 builders per spec (compressed specs ->
``CompressedMLAMetadataBuilder``, sliding-window latents -> ``SlidingWindowMLAMetadataBuilder``),
its plans are the builders' metadata; ``kernels`` / ``writer`` choose the Triton kernels or
their twins for the KV writes and the indexer scores ("auto": kernels for CUDA tensors). The
attention itself is the torch reference (float32) on every device for now; no CUDA graphs.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pagedkv.attention.backend import AttentionBackend, AttentionPlan
from pagedkv.attention.mla import write_latent
from pagedkv.attention.mla_sparse import check_sparse_modes, sparse_backend_modes
from pagedkv.errors import ConfigError, InvariantError

# gathered key elements per chunk of query tokens in the reference (bounds its temporaries)
_CHUNK_ELEMENTS = 1 << 25


def gather_slots(cache: torch.Tensor, slots: torch.Tensor,
                 valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [..., width], ok [...])``: the rows of ``cache [N, B, width]`` at flat
    ``slots`` (``block * B + offset``; any strides), ``ok`` where ``slot >= 0`` (and
    ``valid``); rows that are not ok are zero (never read: a NaN-poisoned slot cannot leak)."""
    s = slots.to(torch.int64)
    ok = s >= 0
    if valid is not None:
        ok &= valid
    s = torch.where(ok, s, 0)
    b = cache.shape[1]
    rows = cache[s // b, s % b]
    return torch.where(ok.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype)), ok


def dsv4_attention_ref(q: torch.Tensor, sources: Sequence[tuple[torch.Tensor, torch.Tensor,
                                                                 torch.Tensor | None]],
                       sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of ``q [T, H, D]`` over, per token, the rows of each source ``(cache [N, B,
    D], slots [T, K] (-1: none), lens [T] or None)`` (the first ``lens[t]`` slots of token
    ``t``), keys = values (DeepSeek-V4's shared latent), in float32: ``softmax([q.k * scale,
    sink_h])`` with the sink's probability dropped (``exp(sink)`` joins the denominator only).
    A token with no key (padding) gets a zero row. Returns ``[T, H, D]`` in ``q``'s dtype."""
    t, h, d = q.shape
    out = torch.zeros_like(q)
    if t == 0:
        return out
    width = sum(s.shape[1] for _, s, _ in sources)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, width * (d + h)))
    sink = sinks.to(torch.float32).view(1, h, 1)
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        keys, masks = [], []
        for cache, slots, lens in sources:
            sl = slots[s:e]
            valid = None
            if lens is not None:
                valid = torch.arange(sl.shape[1], device=sl.device)[None, :] < lens[s:e, None]
            rows, ok = gather_slots(cache, sl, valid)
            keys.append(rows.to(torch.float32))
            masks.append(ok)
        k = torch.cat(keys, dim=1)
        m = torch.cat(masks, dim=1)
        scores = torch.einsum("thd,tkd->thk", q[s:e].to(torch.float32), k) * scale
        scores = scores.masked_fill(~m.unsqueeze(1), float("-inf"))
        scores = torch.cat((scores, sink.expand(e - s, h, 1)), dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :-1]
        out[s:e] = torch.einsum("thk,tkd->thd", probs, k).to(q.dtype)
    return out


class Dsv4Backend(AttentionBackend):
    """DeepSeek-V4's attention over its paged channels (the module docstring). ``kernels``:
    the indexer scores' Triton kernel ("auto": on CUDA tensors, "kernel": always, "ref": the
    twin); ``writer``: the KV writer ("auto", "kernel", "ref")."""

    name = "dsv4"
    supports_cuda_graphs = False

    def __init__(self, kernels: str = "auto", writer: str = "auto"):
        check_sparse_modes(kernels, writer, "DeepSeek-V4")
        self.kernels = kernels
        self.writer = writer

    def metadata_builder_for(self, spec) -> type | None:
        """Compressed specs -> ``CompressedMLAMetadataBuilder``; sliding-window latents ->
        ``SlidingWindowMLAMetadataBuilder``; anything else: the common metadata."""
        from pagedkv.core.spec import AttentionSpec, SlidingWindowMLASpec
        from pagedkv.worker.dsv4_builders import (
            CompressedMLAMetadataBuilder,
            SlidingWindowMLAMetadataBuilder,
        )

        if isinstance(spec, AttentionSpec) and spec.compress_ratio > 1:
            return CompressedMLAMetadataBuilder
        if isinstance(spec, SlidingWindowMLASpec):
            return SlidingWindowMLAMetadataBuilder
        return None

    def use_kernels(self, like: torch.Tensor) -> bool:
        """Whether the Triton kernels score the indexer for tensors like ``like``."""
        return self.kernels == "kernel" or (self.kernels == "auto" and like.is_cuda)

    def write(self, rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """``cache[slot] = rows[t]`` for every ``t < len(slot_mapping)`` with ``slot >= 0``."""
        write_latent(rows, cache, slot_mapping, writer=self.writer)

    def attend(self, q: torch.Tensor, sources, sinks: torch.Tensor, scale: float) -> torch.Tensor:
        """:func:`dsv4_attention_ref` (the reference on every device for now)."""
        return dsv4_attention_ref(q, sources, sinks, scale)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None,
                v: torch.Tensor | None, kv_cache: torch.Tensor, plan: AttentionPlan,
                scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """A sliding-window-only layer: write the latents ``k [T, D]`` (``v`` unused: keys
        are values; None: already written) at the plan's slot mapping, then attend every
        query to its window (the plan's ``SlidingWindowMLAMetadata``) with ``sinks``."""
        md = plan.metadata
        if not hasattr(md, "swa_indices"):
            raise InvariantError("dsv4-plan", "a sliding-window layer needs the plan of a "
                                 "SlidingWindowMLASpec group", metadata=type(md).__name__)
        if sinks is None:
            raise ConfigError("DeepSeek-V4 attention needs the layer's sinks [num_heads]")
        if k is not None:
            self.write(k, kv_cache, md.slot_mapping)
        return self.attend(q, [(kv_cache, md.swa_indices, md.swa_lens)], sinks, scale)


def dsv4_backend_for(backend: AttentionBackend) -> Dsv4Backend:
    """The DeepSeek-V4 counterpart of an engine's attention backend: a :class:`Dsv4Backend`
    as it is, else as ``mla_sparse.sparse_backend_modes`` says (references -> twins, Triton
    -> kernels on CUDA tensors)."""
    if isinstance(backend, Dsv4Backend):
        return backend
    kernels, writer = sparse_backend_modes(backend, "DeepSeek-V4 (Dsv4Backend)")
    return Dsv4Backend(kernels=kernels, writer=writer)


__all__ = ["Dsv4Backend", "dsv4_attention_ref", "dsv4_backend_for", "gather_slots"]
