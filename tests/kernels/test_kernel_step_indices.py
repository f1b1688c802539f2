"""The fused one-launch step index build == slot mapping + multi-group CSR (and their twins)."""

import pytest
import torch
from kernel_helpers import POISON_I32, POISON_I64, poison, random_batch, random_table, to

from pagedkv.errors import ConfigError
from pagedkv.kernels.page_indices import build_page_indices_ref
from pagedkv.kernels.slot_mapping import compute_slot_mappings_ref
from pagedkv.kernels.step_indices import build_step_indices, build_step_indices_ref

IMPLS = {"kernel": build_step_indices, "ref": build_step_indices_ref}


def _groups(device, *cols):
    return [torch.tensor(v, dtype=torch.int32, device=device) for v in cols]


@pytest.mark.parametrize("impl", list(IMPLS))
def test_sec12_and_sec15_examples_in_one_launch(kernel_device, impl):
    bt = torch.zeros(4, 4, dtype=torch.int32)
    bt[0, :2] = torch.tensor([6, 7])
    bt[1] = torch.tensor([1, 2, 3, 4])
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    pos = torch.tensor([0, 1, 2, 16, 17], dtype=torch.int64)
    seq = torch.tensor([3, 18], dtype=torch.int32)
    d = to(kernel_device, bt, qsl, pos, seq)
    g = _groups(kernel_device, [0], [4], [16], [1])
    slot = poison((1, 8), torch.int64, kernel_device)
    indptr = poison((1, 5), torch.int32, kernel_device)
    indices = poison((1, 6), torch.int32, kernel_device)
    last = poison((1, 4), torch.int32, kernel_device)
    IMPLS[impl](d[0], *g, d[1], d[2], d[3], slot, indptr, indices, last, 2, 5, 4)
    assert slot.cpu().tolist() == [[96, 97, 98, 32, 33, -1, -1, -1]]
    assert indptr.cpu().tolist() == [[0, 1, 3, 3, 3]]
    assert indices.cpu().tolist()[0][:3] == [6, 1, 2]
    assert last.cpu().tolist() == [[3, 2, 0, 0]]


@pytest.mark.parametrize("cp", [(1, 0, 1), (2, 1, 2)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_equals_separate_builders(kernel_device, seed, cp):
    gen = torch.Generator().manual_seed(seed)
    # 1 request row per CSR program up to 128 padded requests, 16 above.
    num_reqs, padded = [(5, 7), (15, 20), (130, 140)][seed]
    qsl, pos, seq, num_tokens = random_batch(gen, num_reqs, 6, max_prefix=60)
    starts, widths, bsz, modes = [0, 6, 14], [6, 8, 3], [16, 8, 32], [1, 1, 0]
    table = random_table(gen, padded + 1, 17)
    slot_len, pages = num_tokens + 5, 12 * num_reqs
    out = (poison((3, slot_len), torch.int64, kernel_device),
           poison((3, padded + 2), torch.int32, kernel_device),
           poison((3, pages), torch.int32, kernel_device),
           poison((3, padded + 1), torch.int32, kernel_device))
    d = to(kernel_device, table, qsl, pos, seq)
    build_step_indices(d[0], *_groups(kernel_device, starts, widths, bsz, modes), d[1], d[2],
                       d[3], *out, num_reqs, num_tokens, padded, *cp)
    out = [o.cpu() for o in out]
    ref_slot = poison((3, slot_len), torch.int64)
    compute_slot_mappings_ref(table, *_groups("cpu", starts, widths, bsz, modes), qsl, pos,
                              ref_slot, num_reqs, num_tokens, *cp)
    assert torch.equal(out[0], ref_slot)
    assert not (out[0] == POISON_I64).any()
    for g in range(3):
        ref = (poison(padded + 2, torch.int32), poison(pages, torch.int32),
               poison(padded + 1, torch.int32))
        build_page_indices_ref(table[:, starts[g]: starts[g] + widths[g]], seq, bsz[g],
                               num_reqs, padded, *ref)
        for o, r in zip(out[1:], ref):
            assert torch.equal(o[g], r)
    assert int(out[1][0, padded + 1]) == POISON_I32  # past num_reqs_padded + 1: untouched


def test_split_prefill_and_ref_twin_agree(kernel_device):
    q = [2300, 1, 0, 40]
    qsl = torch.zeros(5, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q), 0)
    num_tokens = sum(q)
    pos = torch.cat([torch.arange(n) + 3 for n in q]).to(torch.int64)
    seq = torch.tensor([n + 3 for n in q], dtype=torch.int32)
    table = random_table(torch.Generator().manual_seed(3), 4, 300, num_blocks=1 << 20)
    g = ([0, 200], [200, 100], [16, 32], [1, 1])
    shapes = ((2, num_tokens + 9000), (2, 6), (2, 400), (2, 5))
    got = [poison(s, t, kernel_device) for s, t in zip(shapes, (torch.int64,) + (torch.int32,) * 3)]
    d = to(kernel_device, table, qsl, pos, seq)
    build_step_indices(d[0], *_groups(kernel_device, *g), d[1], d[2], d[3], *got, 4, num_tokens,
                       5, max_query_len=max(q))
    want = [poison(s, t) for s, t in zip(shapes, (torch.int64,) + (torch.int32,) * 3)]
    build_step_indices_ref(table, *_groups("cpu", *g), qsl, pos, seq, *want, 4, num_tokens, 5)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)


def test_typed_errors():
    bt = torch.zeros(2, 4, dtype=torch.int32)
    g = _groups("cpu", [0], [4], [16], [1])
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    pos = torch.zeros(2, dtype=torch.int64)
    seq = torch.ones(2, dtype=torch.int32)
    slot = torch.empty(1, 4, dtype=torch.int64)
    i2 = torch.empty(1, 3, dtype=torch.int32)
    with pytest.raises(ConfigError, match="num_reqs_padded"):
        build_step_indices(bt, *g, qsl, pos, seq, slot, i2, i2, i2, 2, 2, 1)
    with pytest.raises(ConfigError, match="indptr_out"):
        build_step_indices(bt, *g, qsl, pos, seq, slot, i2, i2, i2, 2, 2, 3)
    with pytest.raises(ConfigError, match="slot_mapping"):
        build_step_indices(bt, *g, qsl, pos, seq, slot[:, :1], i2, i2, i2, 2, 2, 2)
