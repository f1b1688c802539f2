"""Compressed (DSV4) slot mapping kernel vs reference, and the sec. 17.1 verified examples."""

import pytest
import torch
from kernel_helpers import POISON_I64, poison, random_batch, random_table, to

from pagedkv.errors import ConfigError
from pagedkv.kernels.compressed_slot_mapping import (
    compute_compressed_slot_mapping,
    compute_compressed_slot_mapping_ref,
)
from pagedkv.kernels.slot_mapping import compute_slot_mapping_ref

IMPLS = {"kernel": compute_compressed_slot_mapping, "ref": compute_compressed_slot_mapping_ref}


@pytest.mark.parametrize("impl", list(IMPLS))
def test_sec17_verified_two_requests(kernel_device, impl):
    # C=4, S=4, tables [5,6,7,8] and [2,3]; req0 at positions 0..9, req1 at 17..19.
    bt = torch.zeros(2, 4, dtype=torch.int32)
    bt[0] = torch.tensor([5, 6, 7, 8])
    bt[1, :2] = torch.tensor([2, 3])
    qsl = torch.tensor([0, 10, 13], dtype=torch.int32)
    seq = torch.tensor([10, 20], dtype=torch.int32)
    bt, qsl, seq = to(kernel_device, bt, qsl, seq)
    out = poison(20, torch.int64, kernel_device)
    IMPLS[impl](bt, qsl, seq, out, 2, 13, 4, 4)
    expected = [-1, -1, -1, 20, -1, -1, -1, 21, -1, -1, -1, -1, 12] + [-1] * 7
    assert out.cpu().tolist() == expected


@pytest.mark.parametrize("impl", list(IMPLS))
def test_sec17_verified_vllm_case(kernel_device, impl):
    # B=256, C=4 (S=64), seq 260, 8 new tokens, table [5,7].
    bt = torch.tensor([[5, 7]], dtype=torch.int32)
    qsl = torch.tensor([0, 8], dtype=torch.int32)
    seq = torch.tensor([260], dtype=torch.int32)
    bt, qsl, seq = to(kernel_device, bt, qsl, seq)
    out = poison(12, torch.int64, kernel_device)
    IMPLS[impl](bt, qsl, seq, out, 1, 8, 64, 4)
    out = out.cpu().tolist()
    assert out[3] == 5 * 64 + 63
    assert out[7] == 7 * 64 + 0
    assert all(v == -1 for i, v in enumerate(out) if i not in (3, 7))


def _case(seed, num_reqs=5):
    gen = torch.Generator().manual_seed(seed)
    qsl, _, seq_lens, num_tokens = random_batch(gen, num_reqs, 12, max_prefix=90)
    table = random_table(gen, num_reqs + 1, 3)  # S*C = 16 tokens a block: 48 tokens fit
    return gen, table, qsl, seq_lens, num_tokens


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("use_own", [False, True])
def test_random_matches_reference(kernel_device, seed, use_own):
    gen, table, qsl, seq_lens, num_tokens = _case(seed)
    num_reqs = qsl.numel() - 1
    own = None
    if use_own:
        own = torch.randint(-1, 50, (num_tokens,), generator=gen, dtype=torch.int64)
    ref = poison(num_tokens + 7, torch.int64)
    compute_compressed_slot_mapping_ref(table, qsl, seq_lens, ref, num_reqs, num_tokens, 4, 4,
                                        own)
    out = poison(num_tokens + 7, torch.int64, kernel_device)
    d = to(kernel_device, table, qsl, seq_lens, own)
    compute_compressed_slot_mapping(d[0], d[1], d[2], out, num_reqs, num_tokens, 4, 4, d[3])
    assert torch.equal(out.cpu(), ref)
    assert not (ref == POISON_I64).any()
    if use_own:
        assert (ref[:num_tokens][own < 0] == -1).all()


@pytest.mark.parametrize("cp,rank,inter", [(2, 0, 1), (2, 1, 1), (2, 1, 2), (4, 3, 1)])
def test_cp_ownership_matches_own_slot_mapping(kernel_device, cp, rank, inter):
    """Without own_slot_mapping, ownership follows the regular DCP slot mapping's rule."""
    gen, table, qsl, seq_lens, num_tokens = _case(11)
    num_reqs = qsl.numel() - 1
    q = qsl[1:] - qsl[:-1]
    pos = torch.cat([torch.arange(int(s) - int(n), int(s)) for s, n in zip(seq_lens, q)])
    own = poison(num_tokens, torch.int64)
    S, C = 4, 4
    compute_slot_mapping_ref(table, qsl, pos, own, num_reqs, num_tokens, S * C, cp, rank, inter)
    derived = poison(num_tokens, torch.int64)
    compute_compressed_slot_mapping_ref(table, qsl, seq_lens, derived, num_reqs, num_tokens, S,
                                        C, None, cp, rank, inter)
    given = poison(num_tokens, torch.int64)
    compute_compressed_slot_mapping_ref(table, qsl, seq_lens, given, num_reqs, num_tokens, S, C,
                                        own, cp, rank, inter)
    assert torch.equal(derived, given)
    out = poison(num_tokens, torch.int64, kernel_device)
    d = to(kernel_device, table, qsl, seq_lens)
    compute_compressed_slot_mapping(*d, out, num_reqs, num_tokens, S, C, None, cp, rank, inter)
    assert torch.equal(out.cpu(), derived)


def test_typed_errors():
    bt = torch.zeros(2, 4, dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    seq = torch.tensor([1, 1], dtype=torch.int32)
    out = torch.empty(4, dtype=torch.int64)
    with pytest.raises(ConfigError, match="compress_ratio"):
        compute_compressed_slot_mapping(bt, qsl, seq, out, 2, 2, 4, 0)
    with pytest.raises(ConfigError, match="own_slot_mapping"):
        compute_compressed_slot_mapping(bt, qsl, seq, out, 2, 2, 4, 4,
                                        torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ConfigError, match="seq_lens"):
        compute_compressed_slot_mapping(bt, qsl, seq[:1], out, 2, 2, 4, 4)


def test_split_requests_and_several_padding_programs(kernel_device):
    q = [2500, 5, 600]
    num_tokens, length = sum(q), 19000
    qsl = torch.zeros(4, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q), 0)
    seq = torch.tensor([2600, 9, 4000], dtype=torch.int32)
    table = random_table(torch.Generator().manual_seed(1), 3, 80, num_blocks=1 << 20)
    ref = poison(length, torch.int64)
    compute_compressed_slot_mapping_ref(table, qsl, seq, ref, 3, num_tokens, 16, 4)
    out = poison(length, torch.int64, kernel_device)
    compute_compressed_slot_mapping(*to(kernel_device, table, qsl, seq), out, 3, num_tokens, 16,
                                    4)
    assert torch.equal(out.cpu(), ref)
    assert not (ref == POISON_I64).any()
    assert int((ref >= 0).sum()) > 700
