"""Kernel-block subdivision (sec. 11) and sparse top-k translation (sec. 17.2)."""

import pytest
import torch
from kernel_helpers import POISON_I32, poison, random_table, to

from pagedkv.errors import ConfigError
from pagedkv.kernels.kernel_block_table import (
    map_to_kernel_block_table,
    map_to_kernel_block_table_ref,
)
from pagedkv.kernels.sparse_index import (
    convert_req_index_to_global_index,
    convert_req_index_to_global_index_ref,
)

KBT = {"kernel": map_to_kernel_block_table, "ref": map_to_kernel_block_table_ref}
SPARSE = {"kernel": convert_req_index_to_global_index,
          "ref": convert_req_index_to_global_index_ref}


@pytest.mark.parametrize("impl", list(KBT))
def test_kernel_block_table_hand_example(kernel_device, impl):
    bt = torch.tensor([[3, 0, 0], [7, 8, 0], [1, 1, 1]], dtype=torch.int32)
    (bt,) = to(kernel_device, bt)
    out = poison((3, 7), torch.int32, kernel_device)
    KBT[impl](bt, 2, 2, out)
    assert out.cpu().tolist() == [
        [6, 7, 0, 1, 0, 1, POISON_I32],  # null block 0 -> kernel blocks 0, 1
        [14, 15, 16, 17, 0, 1, POISON_I32],
        [POISON_I32] * 7,  # rows >= num_reqs untouched
    ]
    out = poison((2, 12), torch.int32, kernel_device)
    KBT[impl](bt, 1, 4, out, block_stride=5)  # packed layout: b*stride + j
    assert out[0].cpu().tolist() == [15, 16, 17, 18, 0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("ratio,stride", [(1, None), (2, None), (4, None), (3, 8)])
def test_kernel_block_table_random(kernel_device, ratio, stride):
    gen = torch.Generator().manual_seed(ratio)
    wide = random_table(gen, 6, 25, num_blocks=1 << 20)
    view = wide[:, 5:14]  # a strided column view (one group of a multi-group buffer)
    ref = poison((6, 9 * ratio + 1), torch.int32)
    map_to_kernel_block_table_ref(view, 5, ratio, ref, stride)
    (wide_d,) = to(kernel_device, wide)
    out = poison((6, 9 * ratio + 1), torch.int32, kernel_device)
    map_to_kernel_block_table(wide_d[:, 5:14], 5, ratio, out, stride)
    assert torch.equal(out.cpu(), ref)
    s = ratio if stride is None else stride
    assert int(ref[4, 3 * ratio + ratio - 1]) == int(view[4, 3]) * s + ratio - 1


def test_kernel_block_table_int64_product():
    """Products past int32 are computed in int64 (int64 output keeps them)."""
    bt = torch.tensor([[2**30]], dtype=torch.int32)
    for fn in KBT.values():
        out = poison((1, 4), torch.int64)
        fn(bt, 1, 4, out)
        assert out[0].tolist() == [2**32, 2**32 + 1, 2**32 + 2, 2**32 + 3]


@pytest.mark.parametrize("impl", list(SPARSE))
def test_sparse_hand_example(kernel_device, impl):
    bt = torch.tensor([[3, 4, 5], [7, 8, 9]], dtype=torch.int32)
    req = torch.tensor([1, 0, 2, -1], dtype=torch.int32)  # rows 2 and -1 do not exist
    topk = torch.tensor([[0, 5, -1, 11, 12], [3, 4, 100, -1, 8], [0, 1, 2, 3, 4],
                         [0, 1, 2, 3, 4]], dtype=torch.int32)
    bt, req, topk = to(kernel_device, bt, req, topk)
    out = poison((4, 5), torch.int32, kernel_device)
    lens = poison(6, torch.int32, kernel_device)
    SPARSE[impl](req, bt, topk, 4, out, lens)
    assert out.cpu().tolist() == [
        [28, 33, -1, 39, -1],  # idx 12 -> block index 3 >= width 3 -> -1
        [15, 16, -1, -1, 20],
        [-1] * 5,
        [-1] * 5,
    ]
    assert lens.cpu().tolist() == [3, 3, 0, 0, POISON_I32, POISON_I32]  # lens[T:] untouched
    out2 = poison((4, 5), torch.int32, kernel_device)
    SPARSE[impl](req, bt, topk, 4, out2)  # without lens: the same slots
    assert torch.equal(out2, out)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sparse_random(kernel_device, seed):
    gen = torch.Generator().manual_seed(seed)
    T, K, rows, width, bsz = 7, 40, 4, 6, 8
    bt = random_table(gen, rows, width)
    req = torch.randint(-1, rows + 1, (T,), generator=gen, dtype=torch.int32)
    topk_full = torch.randint(-1, width * bsz + 10, (T, 2 * K), generator=gen,
                              dtype=torch.int32)
    topk = topk_full[:, ::2]  # strided view
    ref = poison((T, K), torch.int32)
    ref_lens = poison(T, torch.int32)
    convert_req_index_to_global_index_ref(req, bt, topk, bsz, ref, ref_lens)
    bt_d, req_d, full_d = to(kernel_device, bt, req, topk_full)
    out = poison((T, K), torch.int32, kernel_device)
    lens = poison(T, torch.int32, kernel_device)
    convert_req_index_to_global_index(req_d, bt_d, full_d[:, ::2], bsz, out, lens)
    assert torch.equal(out.cpu(), ref)
    assert torch.equal(lens.cpu(), ref_lens)
    assert not (ref == POISON_I32).any()
    assert ref_lens.tolist() == (ref >= 0).sum(1).tolist()


def test_sparse_rows_longer_than_one_chunk(kernel_device):
    """K > 1024: a program walks its row in chunks; lens counts across chunks."""
    gen = torch.Generator().manual_seed(7)
    T, K, rows, width, bsz = 3, 1500, 2, 100, 16
    bt = random_table(gen, rows, width)
    req = torch.tensor([0, 1, 0], dtype=torch.int32)
    topk = torch.randint(-1, width * bsz, (T, K), generator=gen, dtype=torch.int32)
    ref, ref_lens = poison((T, K), torch.int64), poison(T, torch.int32)
    convert_req_index_to_global_index_ref(req, bt, topk, bsz, ref, ref_lens)
    bt_d, req_d, topk_d = to(kernel_device, bt, req, topk)
    out, lens = poison((T, K), torch.int64, kernel_device), poison(T, torch.int32, kernel_device)
    convert_req_index_to_global_index(req_d, bt_d, topk_d, bsz, out, lens)
    assert torch.equal(out.cpu(), ref) and torch.equal(lens.cpu(), ref_lens)
    assert ref_lens.tolist() == (topk >= 0).sum(1).tolist()


def test_typed_errors():
    bt = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ConfigError, match="columns"):
        map_to_kernel_block_table(bt, 2, 2, torch.empty(2, 5, dtype=torch.int32))
    with pytest.raises(ConfigError, match="num_reqs"):
        map_to_kernel_block_table(bt, 3, 2, torch.empty(3, 6, dtype=torch.int32))
    with pytest.raises(ConfigError, match="ratio"):
        map_to_kernel_block_table(bt, 2, 0, torch.empty(2, 6, dtype=torch.int32))
    topk = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ConfigError, match="shape"):
        convert_req_index_to_global_index(torch.zeros(2, dtype=torch.int32), bt, topk, 4,
                                          torch.empty(2, 3, dtype=torch.int32))
    with pytest.raises(ConfigError, match="req_id_per_token"):
        convert_req_index_to_global_index(torch.zeros(1, dtype=torch.int32), bt, topk, 4,
                                          torch.empty(2, 4, dtype=torch.int32))
    with pytest.raises(ConfigError, match="lens"):
        convert_req_index_to_global_index(torch.zeros(2, dtype=torch.int32), bt, topk, 4,
                                          torch.empty(2, 4, dtype=torch.int32),
                                          torch.empty(1, dtype=torch.int32))
