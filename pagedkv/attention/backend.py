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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol, runtime_checkable

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


class AttentionBackend(ABC):
    """Paged attention for one step of one layer.

    ``fused_kv_write``: True when ``forward`` also accepts ``k = v = None``, meaning the caller
    has already written the step's K/V into ``kv_cache`` at ``metadata.slot_mapping`` (the
    decoder then fuses q/k norms, RoPE and the KV write into one kernel)."""

    name: str = "abstract"
    fused_kv_write: bool = False

    @abstractmethod
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
        """Write ``k``/``v`` into ``kv_cache`` and return the attention output ``[T, num_heads, head_dim]``."""


__all__ = ["AttentionBackend", "AttentionMetadataLike"]
