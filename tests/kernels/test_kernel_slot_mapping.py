"""Slot mapping kernel (one launch for all groups) vs its torch reference, plus sec. 12 examples."""

import pytest
import torch
from kernel_helpers import POISON_I64, poison, random_batch, random_table, to

from pagedkv.errors import ConfigError
from pagedkv.kernels.slot_mapping import (
    compute_slot_mapping,
    compute_slot_mapping_ref,
    compute_slot_mappings,
    compute_slot_mappings_ref,
)

# Sec. 12 verified table: rows [6,7] and [1,2,3,4], B=16, qsl=[0,3,5], pos=[0,1,2,16,17].
SEC12 = [
    ((1, 0, 1), [96, 97, 98, 32, 33, -1, -1, -1]),
    ((2, 0, 1), [96, -1, 97, 24, -1, -1, -1, -1]),
    ((2, 1, 1), [-1, 96, -1, -1, 24, -1, -1, -1]),
    ((2, 0, 4), [96, 97, 98, 24, 25, -1, -1, -1]),
]


def _sec12_inputs():
    bt = torch.zeros(2, 4, dtype=torch.int32)
    bt[0, :2] = torch.tensor([6, 7])
    bt[1] = torch.tensor([1, 2, 3, 4])
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    pos = torch.tensor([0, 1, 2, 16, 17], dtype=torch.int64)
    return bt, qsl, pos


def _groups(device, col_start, width, block_size, mode):
    return tuple(torch.tensor(v, dtype=torch.int32, device=device)
                 for v in (col_start, width, block_size, mode))


@pytest.mark.parametrize("cp,expected", SEC12, ids=["nocp", "cp2r0", "cp2r1", "cp2r0i4"])
@pytest.mark.parametrize("impl", ["kernel", "ref"])
def test_sec12_verified_single_group(kernel_device, impl, cp, expected):
    bt, qsl, pos = to(kernel_device, *_sec12_inputs())
    out = poison(8, torch.int64, kernel_device)
    fn = compute_slot_mapping if impl == "kernel" else compute_slot_mapping_ref
    fn(bt, qsl, pos, out, 2, 5, 16, *cp)
    assert out.cpu().tolist() == expected


@pytest.mark.parametrize("cp,expected", SEC12, ids=["nocp", "cp2r0", "cp2r1", "cp2r0i4"])
def test_sec12_verified_multi_group(kernel_device, cp, expected):
    """The same table as group 1 of three (group 0: other columns, group 2: mode NONE)."""
    bt, qsl, pos = _sec12_inputs()
    wide = torch.cat([torch.full((2, 3), 500, dtype=torch.int32), bt,
                      torch.full((2, 2), 900, dtype=torch.int32)], dim=1)
    wide, qsl, pos = to(kernel_device, wide, qsl, pos)
    groups = _groups(kernel_device, [0, 3, 7], [3, 4, 2], [8, 16, 16], [1, 1, 0])
    out = poison((3, 8), torch.int64, kernel_device)
    compute_slot_mappings(wide, *groups, qsl, pos, out, 2, 5, *cp)
    assert out[1].cpu().tolist() == expected
    assert out[2].cpu().tolist() == [-1] * 8


def _random_case(seed, num_reqs=5, max_q=7, max_model_len=120):
    gen = torch.Generator().manual_seed(seed)
    qsl, pos, _, num_tokens = random_batch(gen, num_reqs, max_q, max_prefix=max_model_len)
    # Three groups: B=16 width 4 (positions past 64 fall off the table -> -1), B=8 width 20,
    # and a mode-NONE group; laid side by side with a spare column at the end.
    col_start, width, bsz, mode = [0, 4, 24], [4, 20, 3], [16, 8, 16], [1, 1, 0]
    rows = num_reqs + 2
    table = random_table(gen, rows, 28)
    max_num_tokens = num_tokens + 9
    return table, (col_start, width, bsz, mode), qsl, pos, num_tokens, max_num_tokens


@pytest.mark.parametrize("cp", [(1, 0, 1), (2, 1, 1), (4, 2, 2), (3, 0, 4)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_multi_group_matches_reference(kernel_device, seed, cp):
    table, groups, qsl, pos, num_tokens, max_tok = _random_case(seed)
    num_reqs = qsl.numel() - 1
    ref_out = poison((3, max_tok), torch.int64)
    compute_slot_mappings_ref(table, *_groups("cpu", *groups), qsl, pos, ref_out, num_reqs,
                              num_tokens, *cp)
    dev_args = to(kernel_device, table, qsl, pos)
    out = poison((3, max_tok), torch.int64, kernel_device)
    compute_slot_mappings(dev_args[0], *_groups(kernel_device, *groups), dev_args[1],
                          dev_args[2], out, num_reqs, num_tokens, *cp)
    out = out.cpu()
    assert torch.equal(out, ref_out)
    assert not (out == POISON_I64).any(), "every entry of the buffer must be written"
    assert (out[:, num_tokens:] == -1).all()
    assert (out[2] == -1).all()  # mode NONE
    # Each written slot lies in a block of the token's own row, inside the group's columns.
    owner = torch.searchsorted(qsl[1:].long(), torch.arange(num_tokens), right=True)
    for g, (cs, w, b) in enumerate(zip(*groups[:3])):
        if g == 2:
            continue
        for t in range(num_tokens):
            s = int(out[g, t])
            if s >= 0:
                blocks = table[owner[t], cs: cs + w].tolist()
                assert s // b in blocks


def test_single_group_on_strided_column_view(kernel_device):
    gen = torch.Generator().manual_seed(7)
    qsl, pos, _, num_tokens = random_batch(gen, 4, 6, max_prefix=60, allow_empty=False)
    wide = random_table(gen, 6, 30)
    view_cpu = wide[:, 10:18]  # 8 columns of a 30-wide row-major buffer, B=16 -> 128 tokens
    assert not view_cpu.is_contiguous()
    ref_out = poison(num_tokens + 4, torch.int64)
    compute_slot_mapping_ref(view_cpu, qsl, pos, ref_out, 4, num_tokens, 16)
    wide_d, qsl_d, pos_d = to(kernel_device, wide, qsl, pos)
    out = poison(num_tokens + 4, torch.int64, kernel_device)
    compute_slot_mapping(wide_d[:, 10:18], qsl_d, pos_d, out, 4, num_tokens, 16)
    assert torch.equal(out.cpu(), ref_out)
    # Spot check against the formula.
    t = 0
    assert int(ref_out[t]) == int(view_cpu[0, int(pos[t]) // 16]) * 16 + int(pos[t]) % 16


@pytest.mark.parametrize("impl", ["kernel", "ref"])
def test_padding_rules(kernel_device, impl):
    """num_tokens beyond the last request (CUDA-graph padding) and an empty batch."""
    fn = compute_slot_mappings if impl == "kernel" else compute_slot_mappings_ref
    bt, qsl, pos = _sec12_inputs()
    bt, qsl, pos = to(kernel_device, bt, qsl, pos)
    pos_padded = torch.cat([pos, torch.tensor([3, 3, 3], device=kernel_device)])
    groups = _groups(kernel_device, [0], [4], [16], [1])
    out = poison((1, 10), torch.int64, kernel_device)
    fn(bt, *groups, qsl, pos_padded, out, 2, 8)  # 8 tokens counted, requests own 5
    assert out[0].cpu().tolist() == [96, 97, 98, 32, 33] + [-1] * 5
    out = poison((1, 10), torch.int64, kernel_device)
    fn(bt, *groups, qsl, pos, out, 0, 0)
    assert out[0].cpu().tolist() == [-1] * 10


def test_out_of_range_column_and_negative_position(kernel_device):
    bt = torch.tensor([[5, 6], [7, 8]], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    pos = torch.tensor([31, 32, -1, 3], dtype=torch.int64)  # 32 // 16 = 2 >= width 2
    bt, qsl, pos = to(kernel_device, bt, qsl, pos)
    for fn in (compute_slot_mapping, compute_slot_mapping_ref):
        out = poison(4, torch.int64, kernel_device)
        fn(bt, qsl, pos, out, 2, 4, 16)
        assert out.cpu().tolist() == [6 * 16 + 15, -1, -1, 7 * 16 + 3]


def test_typed_errors():
    bt, qsl, pos = _sec12_inputs()
    groups = _groups("cpu", [0], [4], [16], [1])
    out = torch.empty(1, 8, dtype=torch.int64)
    with pytest.raises(ConfigError, match="num_reqs"):
        compute_slot_mappings(bt, *groups, qsl, pos, out, 3, 5)
    with pytest.raises(ConfigError, match="cp_rank"):
        compute_slot_mappings(bt, *groups, qsl, pos, out, 2, 5, 2, 2)
    with pytest.raises(ConfigError, match="dtype"):
        compute_slot_mappings(bt, *groups, qsl, pos, out.to(torch.int32), 2, 5)
    with pytest.raises(ConfigError, match="slot_mapping must be"):
        compute_slot_mappings(bt, *groups, qsl, pos, torch.empty(2, 8, dtype=torch.int64), 2, 5)
    with pytest.raises(ConfigError, match="num_tokens"):
        compute_slot_mappings(bt, *groups, qsl, pos, out, 2, 9)
    with pytest.raises(ConfigError, match="group_width"):
        compute_slot_mappings(bt, groups[0], torch.tensor([4, 4], dtype=torch.int32),
                              *groups[2:], qsl, pos, out, 2, 5)
    with pytest.raises(ConfigError, match="block_size"):
        compute_slot_mapping(bt, qsl, pos, out[0], 2, 5, 0)
    with pytest.raises(ConfigError, match="host int"):
        compute_slot_mapping(bt, qsl, pos, out[0], torch.tensor(2), 5, 16)


@pytest.mark.gpu
def test_cuda_graph_replay_and_large_batches():
    """Capture the one-launch slot mapping in a CUDA graph, change inputs, replay."""
    dev = "cuda"
    gen = torch.Generator().manual_seed(3)
    num_reqs, max_tok = 256, 4096
    table = random_table(gen, 512, 64, num_blocks=100000).to(dev)
    groups = _groups(dev, [0, 16, 48], [16, 32, 16], [16, 8, 16], [1, 1, 0])
    qsl_buf = torch.zeros(num_reqs + 1, dtype=torch.int32, device=dev)
    pos_buf = torch.zeros(max_tok, dtype=torch.int64, device=dev)
    out = torch.empty(3, max_tok, dtype=torch.int64, device=dev)
    num_tokens = 2048

    def step():
        compute_slot_mappings(table, *groups, qsl_buf, pos_buf, out, num_reqs, num_tokens)

    def fill(seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.multinomial(torch.ones(num_reqs), num_tokens, replacement=True,
                              generator=g).bincount(minlength=num_reqs)
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(q, 0)
        start = torch.randint(0, 200, (num_reqs,), generator=g)
        pos = torch.cat([torch.arange(int(s), int(s) + int(n)) for s, n in zip(start, q)])
        qsl_buf.copy_(qsl)
        pos_buf[:num_tokens].copy_(pos)
        return qsl, pos

    fill(0)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (1, 2):
        qsl, pos = fill(seed)
        out.fill_(POISON_I64)
        graph.replay()
        torch.cuda.synchronize()
        ref = poison((3, max_tok), torch.int64)
        compute_slot_mappings_ref(table.cpu(), *(g.cpu() for g in groups), qsl, pos, ref,
                                  num_reqs, num_tokens)
        assert torch.equal(out.cpu(), ref)


def test_token_launch_geometry_by_hand():
    """Lanes per chunk come in three levels (each level is a compiled kernel variant): 32 up
    to 32 tokens, 256 up to 256, else 1024; warps 1, 1, 4; a request longer than two chunks is
    split (only past 2048 tokens: two chunks of 1024); padding programs cover the buffer in ~4 chunks of 1024 per worker."""
    from pagedkv.kernels._common import token_launch_geometry

    assert token_launch_geometry(4, 4, 4096, 1) == (32, 1, 1, 1)
    assert token_launch_geometry(3, 96, 4096, 32) == (32, 1, 1, 1)
    assert token_launch_geometry(3, 96, 4096, 33) == (256, 1, 1, 1)
    assert token_launch_geometry(2, 300, 4096, 256) == (256, 1, 1, 1)
    assert token_launch_geometry(2, 300, 4096, 257) == (1024, 4, 1, 1)
    assert token_launch_geometry(1, 8192, 8192, None) == (1024, 4, 4, 1)
    assert token_launch_geometry(1, 8192, 65536, 8192) == (1024, 4, 4, 4)
    assert token_launch_geometry(5, 40, 4096, None) == (256, 1, 1, 1)  # num_tokens bounds it


def test_split_requests_and_several_padding_programs(kernel_device):
    """Long requests dealt over S > 1 programs and a buffer needing P > 1 padding programs."""
    from pagedkv.kernels._common import token_launch_geometry

    q = [2100, 3, 700, 0, 300]
    num_tokens, max_tok = sum(q), 20000
    _, _, splits, pads = token_launch_geometry(len(q), num_tokens, max_tok, None)
    assert splits > 1 and pads > 1
    gen = torch.Generator().manual_seed(5)
    qsl = torch.zeros(len(q) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q), 0)
    pos = torch.cat([torch.arange(n) + 17 for n in q]).to(torch.int64)
    table = random_table(gen, 6, 200, num_blocks=1 << 20)
    groups = ([0, 150], [150, 50], [16, 64], [1, 1])
    ref = poison((2, max_tok), torch.int64)
    compute_slot_mappings_ref(table, *_groups("cpu", *groups), qsl, pos, ref, len(q), num_tokens)
    out = poison((2, max_tok), torch.int64, kernel_device)
    d = to(kernel_device, table, qsl, pos)
    compute_slot_mappings(d[0], *_groups(kernel_device, *groups), d[1], d[2], out, len(q),
                          num_tokens)
    assert torch.equal(out.cpu(), ref)
    assert not (ref == POISON_I64).any() and (ref[:, num_tokens:] == -1).all()
    assert (ref[:, :num_tokens] >= 0).all()


@pytest.mark.parametrize("hint", ["exact", "too_small", "decode"])
def test_max_query_len_hint_only_sizes_the_launch(kernel_device, hint):
    """The optional max_query_len hint picks lanes per program; results never depend on it,
    even when the hint is wrong."""
    if hint == "decode":
        q = [1] * 9
    else:
        q = [1, 1, 300, 1, 0, 37]
    max_q = {"exact": max(q), "too_small": 1, "decode": 1}[hint]
    qsl = torch.zeros(len(q) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q), 0)
    num_tokens = int(qsl[-1])
    pos = torch.cat([torch.arange(n) + 5 * i for i, n in enumerate(q)]).to(torch.int64)
    table = random_table(torch.Generator().manual_seed(2), len(q), 40)
    groups = ([0, 20], [20, 20], [16, 32], [1, 1])
    ref = poison((2, num_tokens + 50), torch.int64)
    compute_slot_mappings_ref(table, *_groups("cpu", *groups), qsl, pos, ref, len(q), num_tokens)
    out = poison((2, num_tokens + 50), torch.int64, kernel_device)
    d = to(kernel_device, table, qsl, pos)
    compute_slot_mappings(d[0], *_groups(kernel_device, *groups), d[1], d[2], out, len(q),
                          num_tokens, max_query_len=max_q)
    assert torch.equal(out.cpu(), ref)
    single = poison(num_tokens + 50, torch.int64, kernel_device)
    compute_slot_mapping(d[0][:, 20:40], d[1], d[2], single, len(q), num_tokens, 32,
                         max_query_len=max_q)
    assert torch.equal(single.cpu(), ref[1])
