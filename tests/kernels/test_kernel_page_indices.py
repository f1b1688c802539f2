"""FlashInfer CSR builder (one launch, device-side indptr) vs reference, sec. 15 example."""

import pytest
import torch
from kernel_helpers import POISON_I32, poison, random_table, to

from pagedkv.errors import ConfigError
from pagedkv.kernels.page_indices import (
    build_page_indices,
    build_page_indices_groups,
    build_page_indices_groups_ref,
    build_page_indices_ref,
)

IMPLS = {"kernel": build_page_indices, "ref": build_page_indices_ref}


def _sec15():
    bt = torch.zeros(5, 4, dtype=torch.int32)
    bt[0, :3] = torch.tensor([4, 5, 6])
    bt[1, 0] = 9
    bt[2, :2] = torch.tensor([1, 2])
    return bt, torch.tensor([40, 3, 17], dtype=torch.int32)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_sec15_verified(kernel_device, impl):
    bt, seq = to(kernel_device, *_sec15())
    indptr = poison(4, torch.int32, kernel_device)
    indices = poison(12, torch.int32, kernel_device)  # 3 requests x width 4
    last = poison(3, torch.int32, kernel_device)
    IMPLS[impl](bt, seq, 16, 3, 3, indptr, indices, last)
    assert indptr.cpu().tolist() == [0, 3, 4, 6]
    assert indices.cpu().tolist()[:6] == [4, 5, 6, 9, 1, 2]
    assert indices.cpu().tolist()[6:] == [POISON_I32] * 6  # past indptr[-1]: untouched
    assert last.cpu().tolist() == [8, 3, 1]


@pytest.mark.parametrize("impl", list(IMPLS))
def test_cuda_graph_padding(kernel_device, impl):
    """Padded requests: 0 pages, last_page_len 0, indptr repeats; seq_len 0 likewise."""
    bt, seq = _sec15()
    seq = torch.tensor([40, 0, 17, 99, 99], dtype=torch.int32)  # 99s lie beyond num_reqs
    bt, seq = to(kernel_device, bt, seq)
    indptr = poison(7, torch.int32, kernel_device)
    indices = poison(12, torch.int32, kernel_device)
    last = poison(6, torch.int32, kernel_device)
    IMPLS[impl](bt, seq, 16, 3, 5, indptr, indices, last)
    assert indptr.cpu().tolist() == [0, 3, 3, 5, 5, 5, POISON_I32]
    assert indices.cpu().tolist()[:5] == [4, 5, 6, 1, 2]
    assert last.cpu().tolist() == [8, 0, 1, 0, 0, POISON_I32]
    # An empty batch still writes indptr[0] (and nothing else).
    indptr = poison(3, torch.int32, kernel_device)
    IMPLS[impl](bt, seq, 16, 0, 0, indptr, indices, last)
    assert indptr.cpu().tolist() == [0, POISON_I32, POISON_I32]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("sizes", [(9, 12), (37, 50), (150, 170)],
                         ids=["small", "rows1", "rows16"])
def test_random_matches_reference(kernel_device, seed, page_size, sizes):
    gen = torch.Generator().manual_seed(seed)
    (num_reqs, padded), width = sizes, 6
    table = random_table(gen, padded, width)
    # Some sequences longer than the table (columns past the width -> -1), some empty.
    seq = torch.randint(0, width * page_size + 2 * page_size, (padded,), generator=gen,
                        dtype=torch.int32)
    seq[seed % num_reqs] = 0
    max_pages = 20 * num_reqs
    outs_ref = (poison(padded + 2, torch.int32), poison(max_pages, torch.int32),
                poison(padded + 1, torch.int32))
    build_page_indices_ref(table, seq, page_size, num_reqs, padded, *outs_ref)
    outs = tuple(poison(o.shape, torch.int32, kernel_device) for o in outs_ref)
    d = to(kernel_device, table, seq)
    build_page_indices(*d, page_size, num_reqs, padded, *outs)
    for o, r in zip(outs, outs_ref):
        assert torch.equal(o.cpu(), r)
    indptr, indices, last = outs_ref
    pages = (seq[:num_reqs].long() + page_size - 1) // page_size
    assert indptr[: num_reqs + 1].tolist() == [0] + torch.cumsum(pages, 0).tolist()
    total = int(indptr[num_reqs])
    assert (indptr[num_reqs: padded + 1] == total).all()
    for r in range(num_reqs):
        a, b = int(indptr[r]), int(indptr[r + 1])
        expect = table[r, : b - a].tolist() + [-1] * max(0, (b - a) - width)
        assert indices[a:b].tolist() == expect


@pytest.mark.parametrize("impl", list(IMPLS))
def test_indices_capacity(kernel_device, impl):
    """An indices buffer smaller than the table can need (num_reqs x width) is refused; with
    exactly that size, pages that only an out-of-contract seq_len gives are dropped."""
    bt, seq = to(kernel_device, *_sec15())
    indptr = poison(4, torch.int32, kernel_device)
    last = poison(3, torch.int32, kernel_device)
    with pytest.raises(ConfigError, match="indices_out has 4 entries.*3 x 4 = 12"):
        IMPLS[impl](bt, seq, 16, 3, 3, indptr, poison(4, torch.int32, kernel_device), last)
    long = torch.tensor([40, 3, 90], dtype=torch.int32, device=kernel_device)  # 6 pages > width
    indices = poison(12, torch.int32, kernel_device)
    IMPLS[impl](bt, long, 16, 3, 3, indptr, indices, last)
    assert indptr.cpu().tolist() == [0, 3, 4, 10]
    assert indices.cpu().tolist()[:10] == [4, 5, 6, 9, 1, 2, 0, 0, -1, -1]


@pytest.mark.parametrize("impl", list(IMPLS))
def test_zero_size_inputs(kernel_device, impl):
    """Empty batches and width-0 tables, including tensors made from empty numpy arrays."""
    import numpy as np

    def z(*shape):
        return torch.from_numpy(np.zeros(shape, dtype=np.int32)).to(kernel_device)

    indptr = poison(5, torch.int32, kernel_device)
    last = poison(4, torch.int32, kernel_device)
    IMPLS[impl](z(0, 4), z(0), 16, 0, 4, indptr, z(0), last)  # empty batch padded to 4
    assert indptr.cpu().tolist() == [0] * 5 and last.cpu().tolist() == [0] * 4
    indptr = poison(3, torch.int32, kernel_device)
    IMPLS[impl](z(2, 0), z(2), 16, 2, 2, indptr, z(0), last)  # zero-length requests
    assert indptr.cpu().tolist() == [0, 0, 0]
    indptr = poison(2, torch.int32, kernel_device)
    IMPLS[impl](z(0, 0), z(0), 16, 0, 1, indptr, z(0), last)
    assert indptr.cpu().tolist() == [0, 0]
    groups = dict(group_col_start=torch.tensor([0], dtype=torch.int32, device=kernel_device),
                  group_width=torch.tensor([4], dtype=torch.int32, device=kernel_device),
                  group_page_size=torch.tensor([16], dtype=torch.int32, device=kernel_device))
    gi = poison((1, 3), torch.int32, kernel_device)
    fn = build_page_indices_groups if impl == "kernel" else build_page_indices_groups_ref
    fn(z(0, 4), groups["group_col_start"], groups["group_width"], groups["group_page_size"],
       z(0), 0, 2, gi, z(1, 0), z(1, 2))
    assert gi.cpu().tolist() == [[0, 0, 0]]


def test_typed_errors():
    bt, seq = _sec15()
    i4, i8 = torch.empty(4, dtype=torch.int32), torch.empty(8, dtype=torch.int32)
    with pytest.raises(ConfigError, match="num_reqs_padded"):
        build_page_indices(bt, seq, 16, 3, 2, i4, i8, i4)
    with pytest.raises(ConfigError, match="indptr_out"):
        build_page_indices(bt, seq, 16, 3, 4, i4, i8, i4)
    with pytest.raises(ConfigError, match="page_size"):
        build_page_indices(bt, seq, 0, 3, 3, i4, i8, i4)
    with pytest.raises(ConfigError, match="dtype"):
        build_page_indices(bt, seq.float(), 16, 3, 3, i4, i8, i4)


@pytest.mark.gpu
def test_cuda_graph_replay_large_batch():
    """CSR for 1024 requests captured in a CUDA graph; new seq_lens replayed; == reference."""
    dev = "cuda"
    gen = torch.Generator().manual_seed(8)
    rows, width, padded, num_reqs, page = 1024, 256, 1024, 1000, 16
    table = random_table(gen, rows, width, num_blocks=1 << 22).to(dev)
    seq = torch.zeros(rows, dtype=torch.int32, device=dev)
    outs = (torch.empty(padded + 1, dtype=torch.int32, device=dev),
            torch.empty(rows * width, dtype=torch.int32, device=dev),
            torch.empty(padded, dtype=torch.int32, device=dev))

    def step():
        build_page_indices(table, seq, page, num_reqs, padded, *outs)

    seq.copy_(torch.randint(0, width * page, (rows,), generator=gen, dtype=torch.int32))
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        seq.copy_(torch.randint(0, width * page, (rows,), generator=gen, dtype=torch.int32))
        for o in outs:
            o.fill_(POISON_I32)
        graph.replay()
        torch.cuda.synchronize()
        ref = tuple(poison(o.shape, torch.int32) for o in outs)
        build_page_indices_ref(table.cpu(), seq.cpu(), page, num_reqs, padded, *ref)
        for o, r in zip(outs, ref):
            assert torch.equal(o.cpu(), r)


GROUPS = {"kernel": build_page_indices_groups, "ref": build_page_indices_groups_ref}


@pytest.mark.parametrize("impl", list(GROUPS))
def test_groups_one_launch_sec15_as_middle_group(kernel_device, impl):
    bt, seq = _sec15()
    wide = torch.cat([torch.full((5, 2), 70, dtype=torch.int32), bt,
                      torch.full((5, 3), 80, dtype=torch.int32)], dim=1)
    g = [torch.tensor(v, dtype=torch.int32) for v in ([0, 2, 6], [2, 4, 3], [32, 16, 8])]
    d = to(kernel_device, wide, seq, *g)
    indptr = poison((3, 5), torch.int32, kernel_device)
    indices = poison((3, 9), torch.int32, kernel_device)
    last = poison((3, 4), torch.int32, kernel_device)
    GROUPS[impl](d[0], *d[2:], d[1], 3, 4, indptr, indices, last)
    indptr, indices, last = indptr.cpu(), indices.cpu(), last.cpu()
    assert indptr[1].tolist() == [0, 3, 4, 6, 6]
    assert indices[1, :6].tolist() == [4, 5, 6, 9, 1, 2]
    assert last[1].tolist() == [8, 3, 1, 0]
    # page 32, width 2: seq 40 -> 2 pages, 3 -> 1, 17 -> 1.
    assert indptr[0].tolist() == [0, 2, 3, 4, 4] and indices[0, :4].tolist() == [70] * 4
    # page 8, width 3: seq 40 -> 5 pages, two of them past the width -> -1.
    assert indptr[2].tolist() == [0, 5, 6, 9, 9]
    assert indices[2, :9].tolist() == [80, 80, 80, -1, -1, 80, 80, 80, 80]


@pytest.mark.parametrize("seed", [0, 1])
def test_groups_match_single_group_builder(kernel_device, seed):
    gen = torch.Generator().manual_seed(seed)
    num_reqs, padded = (7, 9) if seed == 0 else (140, 150)  # 1 and 16 rows per program
    widths, pages = [5, 9, 3], [16, 4, 64]
    starts = [0, 5, 14]
    table = random_table(gen, padded, sum(widths))
    seq = torch.randint(0, 60, (padded,), generator=gen, dtype=torch.int32)
    g = [torch.tensor(v, dtype=torch.int32) for v in (starts, widths, pages)]
    shapes = ((3, padded + 2), (3, 20 * num_reqs), (3, padded + 1))
    out = tuple(poison(s, torch.int32, kernel_device) for s in shapes)
    d = to(kernel_device, table, seq, *g)
    build_page_indices_groups(d[0], *d[2:], d[1], num_reqs, padded, *out)
    for gi in range(3):
        ref = tuple(poison(s[1], torch.int32) for s in shapes)
        build_page_indices_ref(table[:, starts[gi]: starts[gi] + widths[gi]], seq, pages[gi],
                               num_reqs, padded, *ref)
        for o, r in zip(out, ref):
            assert torch.equal(o[gi].cpu(), r)
