"""The per-layer-cache decode bench (``bench/bench_decode_layers_gpu.py``): its block tables
hold each request's blocks once, in the placement asked for, and its layers' launches equal
the torch reference on the CPU (interpreted kernels, float32)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench"))

from bench_decode_layers_gpu import BS, LayerSetup, block_tables  # noqa: E402


def _blocks(table: torch.Tensor, lens: torch.Tensor) -> list[list[int]]:
    return [table[i, :-(-int(n) // BS)].tolist() for i, n in enumerate(lens)]


@pytest.mark.parametrize("placement", ["contig", "dense", "scatter"])
def test_block_tables_by_placement(placement):
    lens = torch.tensor([1, 16, 17, 50], dtype=torch.int32)  # 1 + 1 + 2 + 4 = 8 blocks
    table = block_tables(lens, 1000, placement, torch.Generator().manual_seed(0))
    rows = _blocks(table, lens)
    assert [len(r) for r in rows] == [1, 1, 2, 4] and table.shape == (4, 4)
    ids = [b for r in rows for b in r]
    assert len(set(ids)) == 8 and 0 not in ids and max(ids) < 1000
    assert (table == 0).sum() == 4 * 4 - 8  # the tail columns: the null block
    if placement == "contig":
        assert ids == list(range(1, 9))
    elif placement == "dense":
        assert sorted(ids) == list(range(1, 9))
    else:
        assert max(ids) > 8  # over the whole cache (8 ids below 9 by chance: ~1e-17)


def test_block_tables_refuse_a_cache_too_small():
    with pytest.raises(SystemExit, match="raise --pool-gib"):
        block_tables(torch.tensor([64, 64], dtype=torch.int32), 8, "dense",
                     torch.Generator().manual_seed(0))


@pytest.mark.parametrize("distinct", [False, True])
def test_layer_launches_match_the_reference(distinct):
    lens = torch.tensor([5, 40, 33], dtype=torch.int32)
    s = LayerSetup(lens, 2, 64, "scatter", distinct, torch.device("cpu"), dtype=torch.float32)
    assert len(s.caches) == (2 if distinct else 1)
    assert s.check() < 1e-5
    s.call(1)()  # the second layer reads its own cache (or the shared one)
    assert not torch.isnan(s.outs[1]).any()
