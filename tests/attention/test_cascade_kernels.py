"""Cascade attention's kernel pieces against their torch twins and a float64 computation,
through the interpreter on CPU (tiny shapes, fp32/fp16) and natively on CUDA:

* the log-sum-exp output of the decode kernel (one range: the direct write; several: the
  reduce kernel) and of the prefill kernel, served rows only (others stay NaN);
* the prefill kernel's non-causal mode (every query row against all keys of its request,
  fewer keys than rows too): the shared-prefix part of cascade attention;
* the merge of two partial results by their log-sum-exps (``merge_attention_states``) equals
  attention over the union of their keys; ``end`` zeroes padding rows; a part without keys
  (``lse = -inf``, NaN output) adds nothing.
"""

import math

import pytest
import torch
from test_triton_cases import make_case, poisoned_out, rows_of

from pagedkv.attention import SimpleAttentionMetadata, build_attention_metadata, paged_attention_ref
from pagedkv.attention.merge_states import merge_attention_states, merge_attention_states_ref
from pagedkv.attention.triton_decode import paged_decode_attention, paged_decode_attention_ref
from pagedkv.attention.triton_prefill import paged_prefill_attention, paged_prefill_attention_ref
from pagedkv.errors import ConfigError

TOL = {torch.float32: 1e-4, torch.float16: 1e-2}


def dense(case, causal=True):
    """Float64 attention and natural-log LSE of every query row, from the cache through the
    table: ``(out [T, H, D], lse [T, H])`` (rows of no request: NaN)."""
    q, cache, meta = case["q"].double().cpu(), case["cache"].double().cpu(), case["meta"]
    T, H, D = q.shape
    hkv, bs = cache.shape[3], cache.shape[2]
    out = torch.full((T, H, D), float("nan"), dtype=torch.float64)
    lse = torch.full((T, H), float("nan"), dtype=torch.float64)
    qsl = meta.query_start_loc_cpu.tolist()
    for r in range(meta.num_reqs):
        s, e, L = qsl[r], qsl[r + 1], int(meta.seq_lens_cpu[r])
        if e == s:
            continue
        pos = torch.arange(L)
        slots = meta.block_table_tensor.cpu()[r, pos // bs].long() * bs + pos % bs
        k = cache[0].reshape(-1, hkv, D)[slots]
        v = cache[1].reshape(-1, hkv, D)[slots]
        for i in range(e - s):
            qpos = L - (e - s) + i
            n = L if not causal else qpos + 1
            for h in range(H):
                kv = h // (H // hkv)
                sc = (k[:n, kv] @ q[s + i, h]) * case["scale"]
                lse[s + i, h] = torch.logsumexp(sc, 0)
                out[s + i, h] = torch.softmax(sc, 0) @ v[:n, kv]
    return out, lse


def poisoned_lse(case):
    return torch.full(case["q"].shape[:2], float("nan"), dtype=torch.float32,
                      device=case["q"].device)


def assert_close_rows(got, want, rows, tol):
    idx = torch.tensor(rows, dtype=torch.int64)
    g = got.float().cpu()[idx]
    assert not torch.isnan(g).any(), "a served row was not written"
    torch.testing.assert_close(g, want.float()[idx], atol=tol, rtol=tol)


def assert_nan_rows(t, rows):
    if rows:
        assert torch.isnan(t.float().cpu()[torch.tensor(rows)]).all(), "another row was written"


# ----- a hand-computed log-sum-exp


def test_reference_lse_by_hand():
    """One query (1, 0) over keys (1, 0), (0, 1), (2, 0) at scale 1: scores 1, 0, 2 (causal
    query at position 2 sees all); lse = log(e + 1 + e^2); non-causal the same here; a query
    at position 1 of a 2-row request sees scores 1, 0 only."""
    cache = torch.zeros(2, 2, 4, 1, 2)  # 2 blocks of 4, 1 KV head, dim 2; block 1 is used
    cache[0, 1, :3, 0] = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]])
    cache[1, 1, :3, 0] = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    table = torch.tensor([[1]], dtype=torch.int32)
    q = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])
    md = build_attention_metadata([2], [3], table, torch.tensor([-1, -1]))
    lse = torch.full((2, 1), float("nan"))
    out = paged_attention_ref(q, cache, md, 1.0, lse=lse)
    assert lse[1, 0].item() == pytest.approx(math.log(math.e + 1 + math.e ** 2))
    assert lse[0, 0].item() == pytest.approx(math.log(math.e + 1))
    w = torch.tensor([math.e, 1.0]) / (math.e + 1)
    torch.testing.assert_close(out[0, 0], w @ torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    lse_nc = torch.full((2, 1), float("nan"))
    paged_attention_ref(q, cache, md, 1.0, causal=False, lse=lse_nc)
    assert lse_nc[0, 0].item() == pytest.approx(lse[1, 0].item())


# ----- decode kernel: lse from the direct write and from the reduce kernel

DECODES = [(0, 1), (9, 1), (16, 1), (33, 1), (63, 1)]


@pytest.mark.parametrize("dtype,block_size,num_splits", [
    (torch.float32, 3, 1), (torch.float32, 16, 3), (torch.float16, 16, 1),
    (torch.float16, 5, 4),
])
def test_decode_lse(kernel_device, dtype, block_size, num_splits):
    reqs = DECODES + [(5, 3)]  # a 3-token request: not the decode kernel's, its rows stay NaN
    case = make_case(reqs, block_size=block_size, num_heads=4, num_kv_heads=2, dtype=dtype,
                     device=kernel_device, write_new=True, seed=block_size + num_splits)
    m = case["meta"]
    out, lse = poisoned_out(case), poisoned_lse(case)
    paged_decode_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                           m.seq_lens, m.num_reqs, case["scale"], out, num_splits=num_splits,
                           lse=lse)
    want_out, want_lse = dense(case)
    rows = rows_of(case, lambda ql: ql == 1)
    assert_close_rows(out, want_out, rows, TOL[dtype])
    assert_close_rows(lse, want_lse, rows, TOL[dtype])
    assert_nan_rows(lse, rows_of(case, lambda ql: ql != 1))
    # the twin writes the same
    out2, lse2 = poisoned_out(case), poisoned_lse(case)
    paged_decode_attention_ref(case["q"], case["cache"], m.block_table_tensor,
                               m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"], out2,
                               lse=lse2)
    assert_close_rows(lse2, want_lse, rows, TOL[dtype])
    assert_nan_rows(lse2, rows_of(case, lambda ql: ql != 1))


def test_lse_argument_errors(kernel_device):
    case = make_case([(4, 1)], block_size=4, device=kernel_device, write_new=True)
    m = case["meta"]
    args = (case["q"], case["cache"], m.block_table_tensor, m.query_start_loc, m.seq_lens,
            m.num_reqs, case["scale"], poisoned_out(case))
    T, H = case["q"].shape[:2]
    for bad in (torch.zeros(T, H, dtype=torch.float16, device=kernel_device),
                torch.zeros(T + 1, H, device=kernel_device),
                torch.zeros(T, 2 * H, device=kernel_device)[:, ::2]):
        with pytest.raises(ConfigError, match="lse"):
            paged_decode_attention(*args, lse=bad)
        with pytest.raises(ConfigError, match="lse"):
            paged_prefill_attention(*args, lse=bad)


# ----- prefill kernel: lse, causal and non-causal

MIXED = [(0, 20), (13, 5), (4, 1), (30, 17), (0, 2)]


@pytest.mark.parametrize("dtype,block_size", [(torch.float32, 3), (torch.float16, 16)])
def test_prefill_lse_causal(kernel_device, dtype, block_size):
    case = make_case(MIXED, block_size=block_size, dtype=dtype, device=kernel_device,
                     write_new=True, pad_tokens=2, seed=block_size)
    m = case["meta"]
    out, lse = poisoned_out(case), poisoned_lse(case)
    paged_prefill_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                            m.seq_lens, m.num_reqs, case["scale"], out, lse=lse)
    want_out, want_lse = dense(case)
    rows = rows_of(case, lambda ql: ql > 0)
    assert_close_rows(out, want_out, rows, TOL[dtype])
    assert_close_rows(lse, want_lse, rows, TOL[dtype])
    assert torch.isnan(lse[-2:].cpu()).all(), "padding rows are no request's"


def shared_prefix_case(num_rows, prefix_len, *, block_size, dtype, device, seed, heads=(4, 2)):
    """``num_rows`` query rows as one request whose ``prefix_len`` keys they all see
    (non-causal), spread over shuffled blocks; every other slot NaN."""
    case = make_case([(prefix_len, 0)], block_size=block_size, num_heads=heads[0],
                     num_kv_heads=heads[1], dtype=dtype, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(num_rows + 3, heads[0], 16, generator=gen).to(dtype).to(device)
    qsl = torch.tensor([0, num_rows], dtype=torch.int32)
    lens = torch.tensor([prefix_len], dtype=torch.int32)
    # more rows than keys is no causal request: build the metadata by hand
    md = SimpleAttentionMetadata(qsl.to(device), qsl, lens.to(device), lens, 1, num_rows,
                                 num_rows, prefix_len, case["meta"].block_table_tensor,
                                 torch.full((num_rows,), -1, dtype=torch.int64, device=device))
    case.update(q=q, meta=md)
    return case


@pytest.mark.parametrize("num_rows,prefix_len,block_size,dtype", [
    (40, 24, 4, torch.float32),   # more rows than keys, keys across a partial key tile
    (5, 48, 16, torch.float32),   # fewer rows than keys, whole key tiles
    (17, 33, 3, torch.float16),
    (1, 7, 16, torch.float16),
])
def test_prefill_non_causal(kernel_device, num_rows, prefix_len, block_size, dtype):
    case = shared_prefix_case(num_rows, prefix_len, block_size=block_size, dtype=dtype,
                              device=kernel_device, seed=num_rows)
    m = case["meta"]
    out, lse = poisoned_out(case), poisoned_lse(case)
    paged_prefill_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                            m.seq_lens, 1, case["scale"], out, num_tokens=num_rows,
                            causal=False, lse=lse)
    want_out, want_lse = dense(case, causal=False)
    rows = list(range(num_rows))
    assert_close_rows(out, want_out, rows, TOL[dtype])
    assert_close_rows(lse, want_lse, rows, TOL[dtype])
    assert torch.isnan(out[num_rows:].cpu()).all() and torch.isnan(lse[num_rows:].cpu()).all()
    # the twin agrees
    out2, lse2 = poisoned_out(case), poisoned_lse(case)
    paged_prefill_attention_ref(case["q"], case["cache"], m.block_table_tensor,
                                m.query_start_loc, m.seq_lens, 1, case["scale"], out2,
                                causal=False, lse=lse2)
    assert_close_rows(out2, want_out, rows, TOL[dtype])
    assert_close_rows(lse2, want_lse, rows, TOL[dtype])


@pytest.mark.parametrize("num_rows,prefix_len,splits,dtype", [
    (9, 50, 2, torch.float32), (20, 70, 3, torch.float32), (4, 33, 5, torch.float16),
    (3, 10, 4, torch.float32),  # one range holds every key, three are empty
])
def test_prefill_non_causal_key_splits(kernel_device, num_rows, prefix_len, splits, dtype):
    """Keys dealt into ranges of ceil(ceil(L / 16) / S) x 16: each range's output and lse
    equal the twin's (empty ranges: 0 and -inf), and the ranges merged equal one pass."""
    case = shared_prefix_case(num_rows, prefix_len, block_size=3, dtype=dtype,
                              device=kernel_device, seed=splits)
    m, q = case["meta"], case["q"]
    T, H, D = q.shape
    results = []
    for fn in (paged_prefill_attention, paged_prefill_attention_ref):
        out = torch.full((splits, T, H, D), float("nan"), dtype=dtype, device=kernel_device)
        lse = torch.full((splits, T, H), float("nan"), device=kernel_device)
        fn(q, case["cache"], m.block_table_tensor, m.query_start_loc, m.seq_lens, 1,
           case["scale"], out, num_tokens=num_rows, causal=False, lse=lse, kv_splits=splits)
        assert torch.isnan(out[:, num_rows:].float().cpu()).all()
        results.append((out[:, :num_rows].float().cpu(), lse[:, :num_rows].cpu()))
    (ko, kl), (to, tl_) = results
    torch.testing.assert_close(ko, to, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(kl, tl_, atol=TOL[dtype], rtol=TOL[dtype])
    # by hand: L 50 / S 2 -> ranges of 32: [0, 32) [32, 50); 70 / 3 -> 32: three hold keys;
    # 33 / 5 -> 16: [0, 16) [16, 32) [32, 33), two empty; 10 / 4 -> 16: three empty
    want_empty = {(50, 2): 0, (70, 3): 0, (33, 5): 2, (10, 4): 3}[(prefix_len, splits)]
    empty = [s for s in range(splits) if torch.isneginf(kl[s]).all()]
    assert empty == list(range(splits - want_empty, splits))
    for s in empty:
        assert torch.all(ko[s] == 0)
    # merged (the ranges as the first part, nothing as the second) == one pass, float64
    dev = kernel_device
    merged = torch.full((num_rows, H, D), float("nan"), device=dev)
    none_out = torch.full((num_rows, H, D), float("nan"), device=dev)
    none_lse = torch.full((num_rows, H), float("-inf"), device=dev)
    merge_attention_states(merged, ko.to(dev), kl.to(dev), none_out, none_lse, num_rows)
    want_out, _ = dense(case, causal=False)
    torch.testing.assert_close(merged.cpu().double(), want_out[:num_rows], atol=TOL[dtype],
                               rtol=TOL[dtype])


def test_key_splits_argument_errors(kernel_device):
    case = shared_prefix_case(4, 20, block_size=4, dtype=torch.float32, device=kernel_device,
                              seed=0)
    m, q = case["meta"], case["q"]
    T, H, D = q.shape
    args = (q, case["cache"], m.block_table_tensor, m.query_start_loc, m.seq_lens, 1,
            case["scale"])
    out2, lse2 = torch.zeros(2, T, H, D), torch.zeros(2, T, H)
    with pytest.raises(ConfigError, match="causal=False"):
        paged_prefill_attention(*args, out2, lse=lse2, kv_splits=2)
    with pytest.raises(ConfigError, match="kv_splits"):
        paged_prefill_attention(*args, out2, causal=False, lse=lse2, kv_splits=0)
    with pytest.raises(ConfigError, match=r"\[S, T, H, D\]"):
        paged_prefill_attention(*args, out2, causal=False, lse=lse2, kv_splits=3)


def test_non_causal_differs_from_causal(kernel_device):
    """The mode bites: the same rows causally see fewer keys (a sanity check of the test)."""
    case = shared_prefix_case(6, 20, block_size=4, dtype=torch.float32, device=kernel_device,
                              seed=3)
    m = case["meta"]
    outs = []
    for causal in (True, False):
        out = poisoned_out(case)
        paged_prefill_attention(case["q"], case["cache"], m.block_table_tensor,
                                m.query_start_loc, m.seq_lens, 1, case["scale"], out,
                                num_tokens=6, causal=causal)
        outs.append(out[:6].cpu())
    assert (outs[0] - outs[1]).abs().max() > 1e-2
    with pytest.raises(ConfigError, match="sliding window"):
        paged_prefill_attention(case["q"], case["cache"], m.block_table_tensor,
                                m.query_start_loc, m.seq_lens, 1, case["scale"],
                                poisoned_out(case), causal=False, sliding_window=4)


# ----- the merge


def _partials(T, H, D, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    parts = []
    for _ in range(2):
        o = torch.randn(T, H, D, generator=g).to(dtype).to(device)
        lse = (torch.randn(T, H, generator=g) * 3).to(device)
        parts.append((o, lse))
    return parts


@pytest.mark.parametrize("impl", ["kernel", "twin"])
@pytest.mark.parametrize("dtype,H,D", [(torch.float32, 4, 16), (torch.float16, 20, 24)])
def test_merge_equals_attention_over_the_union(kernel_device, impl, dtype, H, D):
    """Split a float64 attention problem's keys in two; each half's (output, lse) merged
    equals attention over all keys."""
    g = torch.Generator().manual_seed(H)
    T, nk = 7, 11
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(nk, H, D, generator=g, dtype=torch.float64)
    v = torch.randn(nk, H, D, generator=g, dtype=torch.float64)
    sc = torch.einsum("thd,khd->thk", q, k) / math.sqrt(D)

    def part(sl):
        s = sc[..., sl]
        return (torch.einsum("thk,khd->thd", torch.softmax(s, -1), v[sl]),
                torch.logsumexp(s, -1))

    (oa, la), (ob, lb) = part(slice(0, 4)), part(slice(4, nk))
    want = torch.einsum("thk,khd->thd", torch.softmax(sc, -1), v)
    dev = kernel_device
    out = torch.full((T + 2, H, D), float("nan"), dtype=dtype, device=dev)
    pad = lambda x: torch.cat((x, torch.zeros(2, *x.shape[1:], dtype=x.dtype)))  # noqa: E731
    fn = merge_attention_states if impl == "kernel" else merge_attention_states_ref
    fn(out, pad(oa).float().to(dev), pad(la).float().to(dev), pad(ob).to(dtype).to(dev),
       pad(lb).float().to(dev), T)
    torch.testing.assert_close(out[:T].double().cpu(), want, atol=TOL[dtype] * 2,
                               rtol=TOL[dtype] * 2)
    assert torch.isnan(out[T:].float().cpu()).all(), "rows past num_rows are left alone"


def test_merge_kernel_matches_twin_in_place_with_end(kernel_device):
    """In place (out is the second part), ``end`` zeroes rows [end, num_rows); a part of
    lse -inf with NaN output contributes nothing; kernel == twin."""
    T, H, D = 9, 3, 20
    results = []
    for fn in (merge_attention_states, merge_attention_states_ref):
        (oa, la), (ob, lb) = _partials(T, H, D, torch.float32, kernel_device, seed=5)
        la[2, 1] = float("-inf")
        oa[2, 1] = float("nan")
        lb[3, :] = float("-inf")
        ob[3, :] = float("nan")
        end = torch.tensor([7], dtype=torch.int32, device=kernel_device)
        keep_b = ob.clone()
        fn(ob, oa, la, ob, lb, 8, end)
        assert torch.all(ob[7:8] == 0), "rows [end, num_rows) must be zero"
        torch.testing.assert_close(ob[8:], keep_b[8:], equal_nan=True)
        torch.testing.assert_close(ob[2, 1], keep_b[2, 1])
        torch.testing.assert_close(ob[3], oa[3])
        results.append(ob[:7].cpu())
    torch.testing.assert_close(results[0], results[1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("offset", [4, 5, 6, 7])
def test_merge_end_read_from_a_query_start_loc_view_at_any_offset(kernel_device, offset):
    """The cascade path passes ``end`` as ``query_start_loc[n:n + 1]``: a view at any offset
    (4-byte steps: 16-byte aligned for one n in four); kernel == twin for each."""
    T, H, D = 9, 3, 20
    qsl = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], dtype=torch.int32, device=kernel_device)
    end = qsl[offset:offset + 1]
    got = []
    for fn in (merge_attention_states, merge_attention_states_ref):
        (oa, la), (ob, lb) = _partials(T, H, D, torch.float32, kernel_device, seed=offset)
        out = torch.full((T, H, D), float("nan"), device=kernel_device)
        fn(out, oa, la, ob, lb, T, end)
        assert torch.all(out[offset:] == 0)
        got.append(out.cpu())
    torch.testing.assert_close(got[0], got[1], atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
def test_merge_kernel_compiles_once_for_any_end_alignment():
    """One compiled variant of the merge kernel for ``end`` views at every offset (else a
    workload meets a new alignment mid-run and compiles then)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pagedkv.attention.merge_states import _merge_kernel
    T, H, D = 11, 5, 24  # a shape no other test here uses: its variants are this test's
    qsl = torch.arange(16, dtype=torch.int32, device="cuda")
    (oa, la), (ob, lb) = _partials(T, H, D, torch.float32, "cuda", seed=0)
    out = torch.empty(T, H, D, device="cuda")
    kernels = _merge_kernel.device_caches[torch.cuda.current_device()][0]
    before = set(kernels)
    for offset in (4, 5, 6, 7, 9, 10):
        merge_attention_states(out, oa, la, ob, lb, T, qsl[offset:offset + 1])
    torch.cuda.synchronize()
    assert len(set(kernels) - before) == 1, sorted(set(kernels) - before)


@pytest.mark.parametrize("impl", ["kernel", "twin"])
def test_merge_of_several_parts_equals_attention_over_the_union(kernel_device, impl):
    """The first part in 3 pieces (key ranges of different sizes, one of them empty) plus the
    second part: attention over every key."""
    g = torch.Generator().manual_seed(4)
    T, H, D = 5, 6, 16
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(13, H, D, generator=g, dtype=torch.float64)
    v = torch.randn(13, H, D, generator=g, dtype=torch.float64)
    sc = torch.einsum("thd,khd->thk", q, k) / 4.0

    def part(lo, hi):
        if lo == hi:
            return torch.zeros(T, H, D, dtype=torch.float64), torch.full((T, H), float("-inf"),
                                                                         dtype=torch.float64)
        s = sc[..., lo:hi]
        return torch.einsum("thk,khd->thd", torch.softmax(s, -1), v[lo:hi]), torch.logsumexp(s, -1)

    pieces = [part(0, 2), part(2, 2), part(2, 9)]
    ob, lb = part(9, 13)
    dev = kernel_device
    oa = torch.stack([p[0] for p in pieces]).float().to(dev)
    la = torch.stack([p[1] for p in pieces]).float().to(dev)
    out = torch.full((T, H, D), float("nan"), device=dev)
    fn = merge_attention_states if impl == "kernel" else merge_attention_states_ref
    fn(out, oa, la, ob.float().to(dev), lb.float().to(dev), T)
    want = torch.einsum("thk,khd->thd", torch.softmax(sc, -1), v)
    torch.testing.assert_close(out.double().cpu(), want, atol=1e-5, rtol=1e-5)


def test_merge_argument_errors(kernel_device):
    (oa, la), (ob, lb) = _partials(4, 2, 16, torch.float32, kernel_device, seed=1)
    out = torch.empty_like(oa)
    with pytest.raises(ConfigError, match="lse"):
        merge_attention_states(out, oa, la[:3], ob, lb, 4)
    with pytest.raises(ConfigError, match="num_rows"):
        merge_attention_states(out, oa, la, ob, lb, 5)
    with pytest.raises(ConfigError, match="shape"):
        merge_attention_states(out, oa[:, :1], la, ob, lb, 4)
    with pytest.raises(ConfigError):
        merge_attention_states(out, oa, la.half(), ob, lb, 4)
