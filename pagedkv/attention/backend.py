"""The attention backend interface.

One call per layer and step: write the step's K/V into the layer's paged KV cache through the
slot mapping, then attend every query token to its request's paged context. A backend serves
mixed batches (prefill, chunked prefill, decode) in one call.

Conventions (shared by every backend):

- ``q [T, num_heads, head_dim]``, ``k``/``v [T, num_kv_heads, head_dim]``; ``T`` may exceed
  ``metadata.num_actual_tokens`` (padding for CUDA graphs): padding rows are neither written
  nor attended, and their output rows are zero.
- KV cache per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V).
- Query ``i`` of request ``r`` sits at position ``seq_lens[r] - query_len[r] + i`` and attends
  to the request's positions ``<=`` it; query head ``h`` reads KV head
  ``h // (num_heads // num_kv_heads)`` (GQA).
- ``block_table_tensor[r, j]`` is the physical block of the request's logical block ``j``;
  slot ``s = block * block_size + offset``; ``slot_mapping[t] < 0`` means "do not write".

The step's plan (``AttentionBackend.plan``) is made once per step and KV-cache group and handed
to every layer of the group (see ``AttentionBackend``); a model's forward pass receives them as
a :class:`StepAttention`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class AttentionMetadataLike(Protocol):
    """What a backend reads from the attention metadata (any object with these attributes)."""

    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], device
    query_start_loc_cpu: Any  # same values on the CPU (tensor or numpy array)
    seq_lens: torch.Tensor  # int32 [num_reqs], device
    seq_lens_cpu: Any
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor  # int32 [num_reqs, width], device
    slot_mapping: torch.Tensor  # int64 [>= num_actual_tokens], device
    # cascade attention (see AttentionBackend.use_cascade): the leading positions every request
    # of the step shares in the same blocks, none of its queries before them (0: none); the
    # same value on the device (int32 [1]; None: a backend makes it when it needs it); a CUDA
    # graph's baked decision (None: the backend decides from common_prefix_len)
    common_prefix_len: int
    common_prefix_len_device: torch.Tensor | None
    use_cascade: bool | None


@dataclass(frozen=True)
class AttentionLayout:
    """What a plan must know of the layers it serves (the layers of one KV-cache group share
    it): query heads, KV heads, head size, the dtype and device of queries and cache, and the
    attention variant: ``sliding_window`` W (a query at ``p`` sees keys ``p - W < k <= p``;
    None: full causal attention) and ``logits_soft_cap`` c (scores -> ``c tanh(s / c)``)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    @classmethod
    def of(cls, q: torch.Tensor, kv_cache: torch.Tensor, **variant) -> "AttentionLayout":
        """The layout of one layer's query ``[T, H, D]`` and KV cache ``[2, N, B, Hkv, D]``
        (``variant``: ``sliding_window`` / ``logits_soft_cap``)."""
        return cls(q.shape[1], kv_cache.shape[3], q.shape[2], q.dtype, q.device, **variant)

    def same_shapes(self, other: "AttentionLayout") -> bool:
        """Equal heads, head size, dtype and device (the variant aside)."""
        return (self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, self.device) == (
            other.num_heads, other.num_kv_heads, other.head_dim, other.dtype, other.device)


class AttentionPlan:
    """One step's attention for the layers of one KV-cache group: its ``metadata`` (block
    table, slot mapping, lengths) and whatever the backend decided from it once, on the host,
    for all those layers (``AttentionBackend.plan``). A plan lives for one forward pass (or
    one CUDA-graph capture) and is never reused for another step."""

    __slots__ = ("metadata", "layout")

    def __init__(self, metadata: AttentionMetadataLike, layout: AttentionLayout) -> None:
        self.metadata = metadata
        self.layout = layout


@dataclass
class StepAttention:
    """The attention part of one forward pass: the step's base ``metadata`` (what the model
    reads itself: lengths for dynamic RoPE) and, per layer index, the plan of the layer's
    KV-cache group (layers of one group share one plan object)."""

    metadata: AttentionMetadataLike
    plans: Sequence[AttentionPlan]

    @classmethod
    def uniform(cls, backend: "AttentionBackend", metadata: AttentionMetadataLike,
                layout: AttentionLayout, num_layers: int) -> "StepAttention":
        """One group for every layer: one plan of ``metadata`` for all of them."""
        plan = backend.plan(metadata, layout)
        return cls(metadata, [plan] * num_layers)


class AttentionBackend(ABC):
    """Paged attention for the layers of a model, one step at a time.

    The contract: the caller (the model runner, or a harness) calls ``plan(metadata, layout)``
    once per step and KV-cache group (or inside a CUDA-graph capture) and passes that plan to
    ``forward`` for every layer of the group. Capabilities are declared class attributes, read
    by the runner as they are (never probed):

    * ``supports_cuda_graphs``: ``forward``'s launches depend only on host values fixed in the
      plan, never on device values read on the host, so a decode step may be captured and
      replayed;
    * ``fused_kv_write``: ``forward`` also accepts ``k = v = None``, meaning the caller has
      already written the step's K/V into ``kv_cache`` at the plan's slot mapping (the decoder
      then fuses q/k norms, RoPE and the KV write into one kernel);
    * ``reorder_batch_threshold``: rows with at most this many scheduled tokens are decodes that
      the batch should put first (None: no reordering);
    * ``metadata_builder``: the builder of the page-index format ``forward`` reads
      (``metadata_builder_for(spec)``: per KV-cache spec, default this one);
    * ``graph_variants`` / ``graph_variant``: host decisions a decode graph bakes in besides its
      size (default: none, one graph per size); ``graph_capture_fields``: the metadata fields a
      capture of a variant sets;
    * ``supports_mixed_cuda_graphs``: a plan made from metadata with ``mixed_graph=True``
      (``pagedkv.worker.cuda_graphs``: a graph of mixed prefill / decode steps, captured on
      padded buffers) launches every kernel with grids fixed by the metadata's host bounds
      (``num_reqs``, ``num_actual_tokens``) and reads every length on the device, so any mixed
      step up to those bounds replays it; ``mixed_graph_variants`` /
      ``mixed_graph_capture_fields`` name the decisions such graphs bake in (default: one);
    * ``supports_cascade`` / ``use_cascade``: cascade (shared-prefix) attention: where the
      step's requests share their first ``metadata.common_prefix_len`` positions in the same
      blocks (the scheduler's ``num_common_prefix_blocks``, capped by the runner so that every
      query sits after them), the backend may read those blocks once for the whole batch and
      merge with each request's own blocks; ``use_cascade`` is its host decision for a step.
    * ``wants_decode_order``: ``forward`` reads ``metadata.decode_order`` (the requests longest
      first, staged by the input preparer only for a backend that wants it).
    """

    name: str = "abstract"
    supports_cuda_graphs: bool = False
    supports_mixed_cuda_graphs: bool = False
    fused_kv_write: bool = False
    reorder_batch_threshold: int | None = None
    # the metadata builder class of the page-index format ``forward`` reads
    # (``pagedkv.worker.attn_builders``); None: the step's common metadata per KV-cache group
    metadata_builder: type | None = None
    # ``forward`` serves a plan with ``metadata.common_prefix_len`` through cascade attention
    # where ``use_cascade`` says so (the runner then fills the metadata's prefix fields)
    supports_cascade: bool = False
    wants_decode_order: bool = False

    def metadata_builder_for(self, spec: Any) -> type | None:
        """The metadata builder class of the KV-cache groups with ``spec`` (None: the step's
        common metadata). Default: ``metadata_builder`` for every spec; a backend serving
        channels of different index formats (DeepSeek-V4's compressed and sliding-window
        latent groups) picks per spec."""
        return self.metadata_builder

    def plan(self, metadata: AttentionMetadataLike, layout: AttentionLayout) -> AttentionPlan:
        """This step's plan for the layers of ``layout`` (default: the metadata as it is)."""
        return AttentionPlan(metadata, layout)

    @abstractmethod
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write ``k``/``v`` into ``kv_cache`` at the plan's slot mapping and return the
        attention output ``[T, num_heads, head_dim]``. ``sinks``: the layer's attention sinks
        ``[num_heads]`` (GPT-OSS; a per-layer weight, so it comes with the call, not the
        group's plan): one logit per query head that joins the softmax denominator as
        ``exp(sink)`` (see ``paged_attention_ref``); None: plain softmax."""

    def forward_with_metadata(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None,
                              v: torch.Tensor | None, kv_cache: torch.Tensor,
                              metadata: AttentionMetadataLike, scale: float,
                              sinks: torch.Tensor | None = None, **variant) -> torch.Tensor:
        """One layer of one step from its metadata: :meth:`plan` (for this layer's layout;
        ``variant``: ``sliding_window`` / ``logits_soft_cap``), then :meth:`forward` (tests and
        single-layer drivers; ``sinks`` as :meth:`forward` takes them)."""
        layout = AttentionLayout.of(q, kv_cache, **variant)
        plan = self.plan(metadata, layout)
        if sinks is None:
            return self.forward(layer_idx, q, k, v, kv_cache, plan, scale)
        return self.forward(layer_idx, q, k, v, kv_cache, plan, scale, sinks=sinks)

    def graph_variants(self, num_reqs: int, num_kv_heads: int, device: torch.device) -> tuple:
        """The values of the host decision a decode graph of ``num_reqs`` requests bakes in
        besides its size (one graph per value); carried as the capture metadata's
        ``decode_balanced``. Default: ``(None,)``."""
        return (None,)

    def graph_variant(self, num_reqs: int, num_kv_heads: int, seq_lens, device: torch.device,
                      cascade: bool = False):
        """The value of :meth:`graph_variants` a decode step of ``num_reqs`` (padded) requests
        replays, from its actual requests' host lengths ``seq_lens``; ``cascade``: every
        attention group of the step would take cascade attention (:meth:`use_cascade`)."""
        return None

    def graph_capture_fields(self, variant) -> dict:
        """The metadata fields a capture of graph variant ``variant`` sets (the decisions the
        graph bakes in). Default: ``decode_balanced=variant``."""
        return {"decode_balanced": variant}

    def mixed_graph_variants(self, num_reqs: int) -> tuple:
        """The variants of a mixed-step graph over ``num_reqs`` (padded) requests (one graph
        per value; see ``supports_mixed_cuda_graphs``). Default: ``(None,)``."""
        return (None,)

    def mixed_graph_capture_fields(self, variant) -> dict:
        """The metadata fields a capture of mixed variant ``variant`` sets. Default: none."""
        return {}

    def use_cascade(self, num_reqs: int, common_prefix_len: int,
                    layout: AttentionLayout) -> bool:
        """Whether a step of ``num_reqs`` requests sharing their first ``common_prefix_len``
        positions takes cascade attention on the layers of ``layout`` (a host decision, made
        once per step and group). Default: never."""
        return False


__all__ = ["AttentionBackend", "AttentionLayout", "AttentionMetadataLike", "AttentionPlan",
           "StepAttention"]
