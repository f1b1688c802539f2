"""KV tensors of MLA groups (``pagedkv.worker.kv_caches``): one latent vector per token,
``[num_blocks, storage_block_size, latent_dim]`` per slot, the block bytes the pool is sized by
(the specs' page sizes, equal to the old K+V formula for full attention), the block dimension
the runner zeroes and copies blocks along, and the layouts still refused."""

import pytest
import torch

from pagedkv.core.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.engine.memory import block_bytes
from pagedkv.errors import ConfigError
from pagedkv.worker.kv_caches import (
    allocate_group_kv_caches,
    kv_block_bytes,
    kv_block_dim,
    layer_slots,
)

NAMES = tuple(f"model.layers.{i}.self_attn" for i in range(3))


def _mla(block_size=16, width=40, dtype="float32", **kw):
    return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=width, dtype=dtype, **kw)


def test_mla_group_allocates_one_latent_tensor_per_layer():
    kv = KVCacheConfig(num_blocks=7, kv_cache_groups=(KVCacheGroupSpec(NAMES, _mla()),))
    caches = allocate_group_kv_caches(kv, NAMES, device="cpu", fill=float("nan"))
    assert [tuple(t.shape) for t in caches] == [(7, 16, 40)] * 3
    assert len({id(t) for t in caches}) == 3 and all(t.dtype == torch.float32 for t in caches)
    assert all(torch.isnan(t).all() for t in caches)
    # the pool is sized by the page: one latent (no V) per token
    assert kv_block_bytes(kv) == 3 * 16 * 40 * 4 == 3 * _mla().page_size_bytes
    assert sum(t[0].numel() * t.element_size() for t in caches) == kv_block_bytes(kv)
    assert all(kv_block_dim(t) == 0 for t in caches)


def test_mla_bf16_and_compressed_storage_blocks():
    spec = _mla(block_size=32, width=576, dtype="bfloat16", compress_ratio=4)
    kv = KVCacheConfig(num_blocks=3, kv_cache_groups=(KVCacheGroupSpec(NAMES[:1], spec),))
    (t,) = allocate_group_kv_caches(kv, NAMES[:1], device="cpu")
    assert tuple(t.shape) == (3, 8, 576) and t.dtype == torch.bfloat16
    assert kv_block_bytes(kv) == 8 * 576 * 2 == spec.page_size_bytes


@pytest.mark.parametrize("hybrid", [False, True])
def test_full_attention_block_bytes_equal_the_k_plus_v_formula(hybrid):
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype="float32")
    if hybrid:  # two groups sharing two slots
        swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=16, dtype="float32",
                                sliding_window=8)
        groups = (KVCacheGroupSpec(("a", "b"), full), KVCacheGroupSpec(("c", "d"), swa))
        names = ("a", "b", "c", "d")
    else:
        groups = (KVCacheGroupSpec(NAMES, full),)
        names = NAMES
    kv = KVCacheConfig(num_blocks=5, kv_cache_groups=groups)
    slots = max(layer_slots(kv).values()) + 1
    assert kv_block_bytes(kv) == block_bytes(slots, 16, 2, 16, 4)
    caches = allocate_group_kv_caches(kv, names, device="cpu")
    assert tuple(caches[0].shape) == (2, 5, 16, 2, 16) and kv_block_dim(caches[0]) == 1
    assert len({id(t) for t in caches}) == slots


def test_mla_beside_full_attention_shares_byte_slots_and_heads_are_refused():
    """An MLA latent group beside a full-attention group: one raw slot, a strided view per
    layout (tests/worker/test_kv_caches_mixed.py checks the views never overlap)."""
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=40, dtype="float32")
    kv = KVCacheConfig(num_blocks=5, kv_cache_groups=(KVCacheGroupSpec(NAMES[:1], _mla()),
                                                       KVCacheGroupSpec(NAMES[1:2], full)))
    mla_t, full_t = allocate_group_kv_caches(kv, NAMES[:2], device="cpu")
    assert mla_t.dim() == 3 and full_t.shape == (2, 5, 16, 1, 40)
    assert mla_t.untyped_storage().data_ptr() == full_t.untyped_storage().data_ptr()
    two = MLAAttentionSpec(block_size=16, num_kv_heads=2, head_size=40, dtype="float32")
    kv = KVCacheConfig(num_blocks=5, kv_cache_groups=(KVCacheGroupSpec(NAMES[:1], two),))
    with pytest.raises(ConfigError, match="one KV head"):
        allocate_group_kv_caches(kv, NAMES[:1], device="cpu")
