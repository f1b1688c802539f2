"""Attention backends over the paged KV cache (see ``backend.py`` for the conventions)."""

from pagedkv.attention.backend import AttentionBackend, AttentionMetadataLike
from pagedkv.attention.kv_cache import allocate_kv_caches, kv_cache_shape
from pagedkv.attention.kv_write import write_kv
from pagedkv.attention.metadata import SimpleAttentionMetadata, build_attention_metadata
from pagedkv.attention.torch_ref import TorchRefBackend, paged_attention_ref

__all__ = [
    "AttentionBackend",
    "AttentionMetadataLike",
    "SimpleAttentionMetadata",
    "TorchRefBackend",
    "allocate_kv_caches",
    "build_attention_metadata",
    "kv_cache_shape",
    "paged_attention_ref",
    "write_kv",
]
