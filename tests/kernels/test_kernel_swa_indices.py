"""DSV4 SWA index lists: kernel vs reference, the sec. 17.3 verified example, padding rows."""

import pytest
import torch
from kernel_helpers import POISON_I32, poison, random_batch, random_table, to

from pagedkv.errors import ConfigError
from pagedkv.kernels.swa_indices import compute_swa_indices, compute_swa_indices_ref

IMPLS = {"kernel": compute_swa_indices, "ref": compute_swa_indices_ref}


@pytest.mark.parametrize("impl", list(IMPLS))
def test_sec17_verified_w4(kernel_device, impl):
    # W=4, B=4, table [9,3,5], 3 query tokens at positions 7..9.
    bt = torch.tensor([[9, 3, 5]], dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    seq = torch.tensor([10], dtype=torch.int32)
    slots = torch.tensor([37, 38, 39], dtype=torch.int64)
    bt, qsl, seq, slots = to(kernel_device, bt, qsl, seq, slots)
    ind = poison((5, 4), torch.int32, kernel_device)
    lens = poison(5, torch.int32, kernel_device)
    IMPLS[impl](bt, qsl, seq, slots, ind, lens, 1, 3, 4, 4)
    assert ind.cpu().tolist() == [[12, 13, 14, 15], [13, 14, 15, 20], [14, 15, 20, 21],
                                  [-1] * 4, [-1] * 4]
    assert lens.cpu().tolist() == [4, 4, 4, 0, 0]


@pytest.mark.parametrize("impl", list(IMPLS))
def test_invalid_token_and_short_prefix(kernel_device, impl):
    bt = torch.tensor([[9, 3, 5], [4, 0, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    seq = torch.tensor([10, 2], dtype=torch.int32)
    slots = torch.tensor([5, -1, 7, 8], dtype=torch.int64)  # token 1 is PAD
    d = to(kernel_device, bt, qsl, seq, slots)
    ind = poison((4, 6), torch.int32, kernel_device)
    lens = poison(4, torch.int32, kernel_device)
    IMPLS[impl](*d, ind, lens, 2, 4, 4, 4)
    assert lens.cpu().tolist() == [4, 0, 1, 2]
    assert ind.cpu().tolist() == [
        [13, 14, 15, 20, -1, -1],
        [-1] * 6,
        [16, -1, -1, -1, -1, -1],
        [16, 17, -1, -1, -1, -1],
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("extras", ["none", "replay", "image"])
def test_random_matches_reference(kernel_device, seed, extras):
    gen = torch.Generator().manual_seed(seed)
    num_reqs, window, bsz = 4, 8, 4
    qsl, _, seq_lens, num_tokens = random_batch(gen, num_reqs, 6, max_prefix=40)
    table = random_table(gen, num_reqs + 2, 10)  # 40 tokens: late positions fall off -> -1
    slots = torch.randint(-1, 100, (num_tokens,), generator=gen, dtype=torch.int64)
    replay = left = right = None
    if extras == "replay":
        replay = torch.randint(0, 30, (num_reqs,), generator=gen, dtype=torch.int32)
    if extras == "image":
        left = torch.randint(0, 14, (num_tokens,), generator=gen, dtype=torch.int32)
        right = torch.randint(0, 5, (num_tokens,), generator=gen, dtype=torch.int32)
    rows, width = num_tokens + 3, window + 6
    ref_ind, ref_len = poison((rows, width), torch.int32), poison(rows, torch.int32)
    compute_swa_indices_ref(table, qsl, seq_lens, slots, ref_ind, ref_len, num_reqs,
                            num_tokens, window, bsz, replay, left, right)
    ind = poison((rows, width), torch.int32, kernel_device)
    lens = poison(rows, torch.int32, kernel_device)
    d = to(kernel_device, table, qsl, seq_lens, slots, replay, left, right)
    compute_swa_indices(*d[:4], ind, lens, num_reqs, num_tokens, window, bsz, *d[4:])
    assert torch.equal(ind.cpu(), ref_ind)
    assert torch.equal(lens.cpu(), ref_len)
    assert not (ref_ind == POISON_I32).any() and not (ref_len == POISON_I32).any()
    assert (ref_len[num_tokens:] == 0).all() and (ref_ind[num_tokens:] == -1).all()
    assert (ref_len <= width).all()
    if extras == "none":
        assert (ref_len <= window).all()


def test_int64_indices_output(kernel_device):
    bt = torch.tensor([[9, 3, 5]], dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    seq = torch.tensor([10], dtype=torch.int32)
    slots = torch.tensor([1, 1, 1], dtype=torch.int64)
    d = to(kernel_device, bt, qsl, seq, slots)
    ind = poison((3, 4), torch.int64, kernel_device)
    lens = poison(3, torch.int32, kernel_device)
    compute_swa_indices(*d, ind, lens, 1, 3, 4, 4)
    assert ind[2].cpu().tolist() == [14, 15, 20, 21]


def test_typed_errors():
    bt = torch.zeros(1, 3, dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    seq = torch.tensor([10], dtype=torch.int32)
    slots = torch.zeros(3, dtype=torch.int64)
    ind, lens = torch.empty(3, 4, dtype=torch.int32), torch.empty(3, dtype=torch.int32)
    with pytest.raises(ConfigError, match="num_tokens"):
        compute_swa_indices(bt, qsl, seq, slots, ind, lens, 1, 4, 4, 4)
    with pytest.raises(ConfigError, match="window"):
        compute_swa_indices(bt, qsl, seq, slots, ind, lens, 1, 3, 0, 4)
    with pytest.raises(ConfigError, match="lens_out"):
        compute_swa_indices(bt, qsl, seq, slots, ind, lens[:2], 1, 3, 4, 4)
    with pytest.raises(ConfigError, match="left"):
        compute_swa_indices(bt, qsl, seq, slots, ind, lens, 1, 3, 4, 4,
                            left=torch.zeros(1, dtype=torch.int32))
