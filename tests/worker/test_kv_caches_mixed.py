"""Groups of different cache geometries share raw byte slots (vLLM's hybrid allocator for
mixed pages): every layer's tensor is a strided view of its slot, block-major, so a block id
is one page in every view. Checked: a random assignment of blocks to groups, each group
writing its layers' blocks, reads back intact everywhere (no two groups' blocks overlap);
block zeroing touches one page; the paged attention kernels read a strided view exactly as a
contiguous cache; the pool's per-block bytes are the slots' largest pages."""

import random
import sys
import os

import pytest
import torch

from pagedkv.core.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from pagedkv.worker.kv_caches import allocate_group_kv_caches, kv_block_bytes, kv_block_dim

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "attention"))


def _config(num_blocks=12):
    full = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
    mla = MLAAttentionSpec(block_size=4, num_kv_heads=1, head_size=24, dtype="float32")
    swa = SlidingWindowSpec(block_size=4, num_kv_heads=4, head_size=4, dtype="float16",
                            sliding_window=8)
    groups = [KVCacheGroupSpec(("a0", "a1"), full), KVCacheGroupSpec(("m0",), mla),
              KVCacheGroupSpec(("s0", "s1"), swa)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)


NAMES = ["a0", "m0", "s0", "a1", "s1"]


def test_views_have_the_specs_layouts_and_share_slots():
    cfg = _config()
    t = dict(zip(NAMES, allocate_group_kv_caches(cfg, NAMES, device="cpu")))
    assert t["a0"].shape == (2, 12, 4, 2, 8) and t["a0"].dtype == torch.float32
    assert t["m0"].shape == (12, 4, 24)
    assert t["s0"].shape == (2, 12, 4, 4, 4) and t["s0"].dtype == torch.float16
    # slot 0 = a0, m0, s0 (first layer of each group); slot 1 = a1, s1
    assert t["a0"].untyped_storage().data_ptr() == t["m0"].untyped_storage().data_ptr() \
        == t["s0"].untyped_storage().data_ptr()
    assert t["a1"].untyped_storage().data_ptr() == t["s1"].untyped_storage().data_ptr()
    assert t["a0"].untyped_storage().data_ptr() != t["a1"].untyped_storage().data_ptr()
    # pages: full 4*2*16*4 = 512 B, MLA 4*24*4 = 384 B, SWA 4*4*8*2 = 256 B -> slot 0: 512
    assert kv_block_bytes(cfg) == 512 + 512
    assert all(float(v.abs().sum()) == 0 for v in t.values())  # zero-filled


@pytest.mark.parametrize("seed", range(5))
def test_blocks_of_different_groups_never_overlap(seed):
    rng = random.Random(seed)
    cfg = _config()
    t = dict(zip(NAMES, allocate_group_kv_caches(cfg, NAMES, device="cpu")))
    group_of = {"a0": 0, "a1": 0, "m0": 1, "s0": 2, "s1": 2}
    owner = {b: rng.randrange(3) for b in range(1, 12)}
    g = torch.Generator().manual_seed(seed)
    want = {}
    for name in NAMES:
        view = t[name]
        d = kv_block_dim(view)
        for b, grp in owner.items():
            if grp != group_of[name]:
                continue
            blk = view.select(d, b)
            val = torch.randn(blk.shape, generator=g).to(view.dtype)
            blk.copy_(val)
            want[(name, b)] = val
    for (name, b), val in want.items():
        view = t[name]
        assert torch.equal(view.select(kv_block_dim(view), b), val), (name, b)
    # zeroing one block of one layer (the runner's new_block_ids_to_zero) touches that page only
    b0 = next(b for b, grp in owner.items() if grp == 0)
    t["a0"].index_fill_(kv_block_dim(t["a0"]), torch.tensor([b0]), 0)
    assert float(t["a0"].select(1, b0).abs().sum()) == 0
    for (name, b), val in want.items():
        if (name, b) != ("a0", b0):
            assert torch.equal(t[name].select(kv_block_dim(t[name]), b), val), (name, b)


def test_decode_kernel_reads_a_strided_view_exactly(kernel_device):
    """The paged decode kernel (and its twin) on a block-major strided view equal the same
    cache stored contiguously."""
    from test_triton_cases import make_case, poisoned_out

    from pagedkv.attention.triton_decode import paged_decode_attention

    case = make_case([(9, 1), (20, 1), (3, 1)], block_size=4, device=kernel_device,
                     write_new=True, seed=2)
    cache = case["cache"]  # [2, N, B, H, D] contiguous
    _, n, bs, h, dim = cache.shape
    page = 2 * bs * h * dim + 16  # a padded page, as a larger layer in the slot would force
    raw = torch.full((n * page,), float("nan"), dtype=cache.dtype, device=cache.device)
    view = raw.as_strided(cache.shape, (bs * h * dim, page, h * dim, dim, 1))
    view.copy_(cache)
    m = case["meta"]
    outs = []
    for kv in (cache, view):
        out = poisoned_out(case)
        paged_decode_attention(case["q"], kv, m.block_table_tensor, m.query_start_loc,
                               m.seq_lens, m.num_reqs, case["scale"], out)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("impl", ["kernel", "twin"])
def test_kv_writer_fills_a_strided_view_exactly(kernel_device, impl):
    """The paged KV writer (Triton kernel and twin) writes a block-major strided view exactly
    as a contiguous cache, and never outside the slots' pages."""
    from pagedkv.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

    fn = reshape_and_cache if impl == "kernel" else reshape_and_cache_ref
    g = torch.Generator().manual_seed(1)
    n, bs, h, dim, t = 6, 4, 2, 8, 9
    key = torch.randn(t, h, dim, generator=g).to(kernel_device)
    value = torch.randn(t, h, dim, generator=g).to(kernel_device)
    slots = torch.tensor([5, 6, 7, 12, -1, 13, 20, 21, 3], device=kernel_device)
    flat = torch.zeros(2, n, bs, h, dim, device=kernel_device)
    fn(key, value, flat[0], flat[1], slots)
    page = 2 * bs * h * dim + 8
    raw = torch.full((n * page,), -3.0, device=kernel_device)
    view = raw.as_strided(flat.shape, (bs * h * dim, page, h * dim, dim, 1))
    view.zero_()
    fn(key, value, view[0], view[1], slots)
    assert torch.equal(view, flat)
    pad = raw.view(n, page)[:, 2 * bs * h * dim:]
    assert bool((pad == -3.0).all())  # the page padding is never written
