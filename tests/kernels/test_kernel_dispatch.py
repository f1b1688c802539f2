"""Launcher dispatch: Triton on CUDA or under the interpreter, the torch twin otherwise (the CPU
engine path), plus a property test of the slot-mapping invariants."""

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_helpers import POISON_I64, poison

from pagedkv.kernels._common import use_triton
from pagedkv.kernels.slot_mapping import compute_slot_mappings, compute_slot_mappings_ref

MODULES = [
    "slot_mapping",
    "compressed_slot_mapping",
    "swa_indices",
    "page_indices",
    "kernel_block_table",
    "sparse_index",
    "reshape_and_cache",
    "step_indices",
]


def test_use_triton_rule():
    cpu = torch.zeros(1)
    assert use_triton(object(), cpu) is False  # compiled kernel + CPU tensors -> reference
    from pagedkv.kernels.slot_mapping import _slot_mappings_kernel

    interpreted = type(_slot_mappings_kernel).__name__ == "InterpretedFunction"
    assert use_triton(_slot_mappings_kernel, cpu) is interpreted
    if torch.cuda.is_available():
        assert use_triton(object(), torch.zeros(1, device="cuda")) is True


@pytest.mark.parametrize("name", MODULES)
def test_every_module_has_launcher_and_same_signature_twin(name):
    import inspect

    mod = importlib.import_module(f"pagedkv.kernels.{name}")
    launchers = [n for n in dir(mod) if not n.startswith("_") and f"{n}_ref" in dir(mod)]
    assert launchers, f"{name}: no launcher/_ref pair"
    for n in launchers:
        assert inspect.signature(getattr(mod, n)) == inspect.signature(getattr(mod, f"{n}_ref"))


def _sec12():
    bt = torch.zeros(2, 4, dtype=torch.int32)
    bt[0, :2] = torch.tensor([6, 7])
    bt[1] = torch.tensor([1, 2, 3, 4])
    g = [torch.tensor([v], dtype=torch.int32) for v in (0, 4, 16, 1)]
    return bt, g, torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 1, 2, 16, 17])


def test_cpu_fallback_path(monkeypatch):
    """With a compiled (non-interpreted) kernel and CPU tensors the launchers use the twin."""
    mods = {n: importlib.import_module(f"pagedkv.kernels.{n}") for n in MODULES}
    for mod in mods.values():
        monkeypatch.setattr(mod, "use_triton", lambda *a: False)
    bt, g, qsl, pos = _sec12()
    out = poison((1, 8), torch.int64)
    mods["slot_mapping"].compute_slot_mappings(bt, *g, qsl, pos, out, 2, 5)
    assert out[0].tolist() == [96, 97, 98, 32, 33, -1, -1, -1]
    out1 = poison(8, torch.int64)
    mods["slot_mapping"].compute_slot_mapping(bt, qsl, pos, out1, 2, 5, 16, 2, 1, 1)
    assert out1.tolist() == [-1, 96, -1, -1, 24, -1, -1, -1]
    comp = poison(10, torch.int64)
    mods["compressed_slot_mapping"].compute_compressed_slot_mapping(
        torch.tensor([[5, 7]], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32),
        torch.tensor([260], dtype=torch.int32), comp, 1, 8, 64, 4)
    assert comp.tolist() == [-1, -1, -1, 383, -1, -1, -1, 448, -1, -1]
    ind, lens = poison((3, 4), torch.int32), poison(3, torch.int32)
    mods["swa_indices"].compute_swa_indices(
        torch.tensor([[9, 3, 5]], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
        torch.tensor([10], dtype=torch.int32), torch.ones(3, dtype=torch.int64), ind, lens, 1,
        3, 4, 4)
    assert ind[2].tolist() == [14, 15, 20, 21]
    indptr, indices, last = poison(3, torch.int32), poison(8, torch.int32), poison(2, torch.int32)
    mods["page_indices"].build_page_indices(bt, torch.tensor([20, 33], dtype=torch.int32), 16,
                                            2, 2, indptr, indices, last)
    assert indptr.tolist() == [0, 2, 5] and last.tolist() == [4, 1]
    kbt = poison((2, 8), torch.int32)
    mods["kernel_block_table"].map_to_kernel_block_table(bt, 2, 2, kbt)
    assert kbt[1].tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    sp = poison((1, 2), torch.int32)
    mods["sparse_index"].convert_req_index_to_global_index(
        torch.tensor([1], dtype=torch.int32), bt, torch.tensor([[17, -1]], dtype=torch.int32),
        16, sp)
    assert sp.tolist() == [[33, -1]]
    slot2 = poison((1, 6), torch.int64)
    csr = (poison((1, 3), torch.int32), poison((1, 4), torch.int32), poison((1, 2), torch.int32))
    seq = torch.tensor([3, 18], dtype=torch.int32)
    mods["step_indices"].build_step_indices(bt, *g, qsl, pos, seq, slot2, *csr, 2, 5, 2)
    assert slot2[0].tolist() == [96, 97, 98, 32, 33, -1]
    assert csr[0].tolist() == [[0, 1, 3]] and csr[2].tolist() == [[3, 2]]
    kc = poison((2, 2, 1, 2), torch.float32)
    mods["reshape_and_cache"].reshape_and_cache(torch.ones(2, 1, 2), None, kc, None,
                                                torch.tensor([-1, 3]))
    assert kc[1, 1, 0].tolist() == [1.0, 1.0]


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6)), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 4, 16]),
    extra=st.integers(0, 5),
)
def test_property_distinct_slots_outside_null_block(kernel_device, lens, block_size, extra):
    """Each request owns distinct blocks: no two tokens share a slot, none lands in block 0,
    each slot lies in a block of the token's own row; kernel == twin."""
    num_reqs = len(lens)
    width = (46 + block_size - 1) // block_size
    table = (torch.arange(num_reqs * width, dtype=torch.int32).reshape(num_reqs, width) + 1)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    pos = []
    for r, (prefix, q) in enumerate(lens):
        qsl[r + 1] = qsl[r] + q
        pos += list(range(prefix, prefix + q))
    num_tokens = int(qsl[-1])
    pos = torch.tensor(pos, dtype=torch.int64)
    groups = [torch.tensor([v], dtype=torch.int32) for v in (0, width, block_size, 1)]
    ref = poison((1, num_tokens + extra), torch.int64)
    compute_slot_mappings_ref(table, *groups, qsl, pos, ref, num_reqs, num_tokens)
    out = poison((1, num_tokens + extra), torch.int64, kernel_device)
    dev = [t.to(kernel_device) for t in (table, *groups, qsl, pos)]
    compute_slot_mappings(*dev, out, num_reqs, num_tokens)
    assert torch.equal(out.cpu(), ref)
    s = ref[0, :num_tokens]
    assert not (ref == POISON_I64).any()
    assert (s >= block_size).all()  # never the null block
    assert s.unique().numel() == num_tokens
    owner = torch.searchsorted(qsl[1:].long(), torch.arange(num_tokens), right=True)
    for t in range(num_tokens):
        assert int(s[t]) // block_size in table[owner[t]].tolist()
    assert (ref[0, num_tokens:] == -1).all()
