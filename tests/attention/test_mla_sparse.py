"""DeepSeek sparse attention over the paged caches (``pagedkv.attention.mla_sparse``,
``mla_sparse_attention``, ``dsa_index_logits``): both Triton kernels against their torch twins
(interpreter on CPU, natively on a GPU) on random inputs with NaN-poisoned caches and outputs,
shuffled blocks, strided (byte-slot) cache views, padding tokens, lengths 0 .. K, -1 entries,
fp32 / fp16; the twins against float64 loops written from the definitions; the plan's token
rows and the top-k by hand; the DSA backend against dense MLA when the top-k covers each
token's context and against a per-token masked dense MLA when it does not; errors and the
backend mapping. GPU (``@pytest.mark.gpu``): V3.2's shapes in bf16."""

import pytest
import torch
from mla_helpers import MIXED, Batch, dense_mla

from pagedkv.attention.dsa_index_logits import indexer_logits, indexer_logits_ref
from pagedkv.attention.metadata import build_attention_metadata
from pagedkv.attention.mla_sparse import DSABackend, DSAPlan, dsa_backend_for
from pagedkv.attention.mla_sparse_attention import (
    SparseMLAConfig,
    sparse_mla_attention,
    sparse_mla_attention_ref,
)
from pagedkv.attention.mla_torch_ref import TorchRefMLABackend, mla_attention_ref
from pagedkv.attention.torch_ref import TorchRefBackend
from pagedkv.attention.triton_backend import TritonAttentionBackend
from pagedkv.errors import ConfigError, InvariantError

NAN = float("nan")


def _strided(cache: torch.Tensor, pad: int) -> torch.Tensor:
    """The same values in a block-major view whose block stride is ``pad`` elements larger
    (as the shared byte-slot allocator lays out a smaller page), padding NaN."""
    n, b, d = cache.shape
    raw = torch.full((n * (b * d + pad),), NAN, dtype=cache.dtype, device=cache.device)
    view = raw.as_strided((n, b, d), (b * d + pad, d, 1))
    view.copy_(cache)
    return view


# ---- sparse MLA attention


def _sparse_inputs(t, heads, rank, rope, k, block_size, dtype, device, seed=0, num_blocks=9):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=gen)
    cache[0] = NAN  # the null block: never read
    q = torch.randn(t, heads, rank + rope, generator=gen)
    # distinct valid slots outside block 0, some -1 inside the prefix, NaN past lens
    slots = torch.full((t, k), -1, dtype=torch.int32)
    lens = torch.zeros(t, dtype=torch.int32)
    for i in range(t):
        n = [0, 1, k, k - 3, 5, 2][i % 6] if k >= 5 else i % (k + 1)
        cand = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:n] + block_size
        slots[i, :n] = cand.to(torch.int32)
        if n > 3:
            slots[i, 1] = -1  # skipped
        slots[i, n:] = torch.randint(0, block_size, (k - n,), generator=gen)  # past lens: unread
        lens[i] = n
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), cache.to(dtype=dtype, **to), slots.to(**to), lens.to(**to))


def _sparse_loop(q, cache, slots, lens, scale, rank):
    """float64, token by token, head by head, from the definition."""
    t, h, _ = q.shape
    out = torch.zeros(t, h, rank, dtype=torch.float64)
    b = cache.shape[1]
    for i in range(t):
        rows = [cache[s // b, s % b].double().cpu() for s in slots[i, : int(lens[i])].tolist() if s >= 0]
        if not rows:
            continue
        lat = torch.stack(rows)
        for j in range(h):
            p = torch.softmax(lat @ q[i, j].double().cpu() * scale, dim=0)
            out[i, j] = p @ lat[:, :rank]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,rank,rope,k,block_size", [(4, 32, 8, 24, 16), (20, 32, 16, 40, 12)])
def test_sparse_attention_kernel_matches_twin(kernel_device, dtype, heads, rank, rope, k, block_size):
    q, cache, slots, lens = _sparse_inputs(13, heads, rank, rope, k, block_size, dtype,
                                           kernel_device, seed=heads + k)
    cache = _strided(cache, 8)
    scale = 0.3
    outs = []
    for fn in (sparse_mla_attention, sparse_mla_attention_ref):
        out = torch.full((13, heads, rank), NAN, dtype=dtype, device=kernel_device)
        fn(q, cache, slots, lens, scale, out, kv_lora_rank=rank)
        outs.append(out.float().cpu())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(outs[0], outs[1], **tol)
    want = _sparse_loop(q, cache, slots, lens, scale, rank)
    torch.testing.assert_close(outs[1].double(), want, **tol)
    assert torch.equal(outs[0][lens.cpu() == 0], torch.zeros_like(outs[0][lens.cpu() == 0]))
    assert (lens.cpu() == 0).any() and not torch.isnan(outs[0]).any()


@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
def test_sparse_attention_tiles_splits_and_launch_config(kernel_device, num_splits):
    """A K spanning several tiles (forced small tiles), head blocks, split-K (chosen and
    forced: tokens of 0, 1, K, K - 3, 5 and 2 rows; ranges merged by the decode reduce
    kernel); the partials workspace is kept and reused."""
    q, cache, slots, lens = _sparse_inputs(6, 40, 32, 8, 70, 16, torch.float32, kernel_device,
                                           seed=3, num_blocks=12)
    want = _sparse_loop(q, cache, slots, lens, 0.2, 32)
    ws: dict = {}
    for _ in range(2):
        out = torch.full((6, 40, 32), NAN, device=kernel_device)
        sparse_mla_attention(q, cache, slots, lens, 0.2, out, kv_lora_rank=32,
                             config=SparseMLAConfig(block_h=16, tile_k=16, num_warps=1,
                                                    num_stages=1),
                             num_splits=num_splits, workspace=ws)
        torch.testing.assert_close(out.double().cpu(), want, atol=1e-5, rtol=1e-5)
    # 6 tokens x 3 head tiles are few programs: the policy splits them (None) too
    assert ("sparse_mla_partials" in ws) == (num_splits != 1)


def test_sparse_attention_errors():
    q, cache, slots, lens = _sparse_inputs(3, 4, 32, 8, 8, 16, torch.float32, "cpu")
    out = torch.empty(3, 4, 32)
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        sparse_mla_attention_ref(q, cache, slots, lens, 1.0, out, kv_lora_rank=40)
    with pytest.raises(ConfigError, match="out"):
        sparse_mla_attention_ref(q, cache, slots, lens, 1.0, out[:, :, :8], kv_lora_rank=32)
    with pytest.raises(ConfigError, match="a row per query token"):
        sparse_mla_attention_ref(q, cache, slots[:2], lens, 1.0, out, kv_lora_rank=32)
    with pytest.raises(ConfigError, match="lens"):
        sparse_mla_attention_ref(q, cache, slots, lens.long(), 1.0, out, kv_lora_rank=32)
    with pytest.raises(ConfigError, match="power of two"):
        SparseMLAConfig(tile_k=24)
    with pytest.raises(ConfigError, match="num_splits"):
        sparse_mla_attention(q, cache, slots, lens, 1.0, out, kv_lora_rank=32, num_splits=65)


# ---- indexer scores


def _index_inputs(device, dtype, heads=5, dim=24, block_size=8, seed=0):
    """Three requests of 13, 30 and 1 positions (shuffled blocks, NaN elsewhere), tokens at
    various positions, a padding token (request -1) and a request row past the table."""
    gen = torch.Generator().manual_seed(seed)
    lens = [13, 30, 1]
    nb = sum(-(-s // block_size) for s in lens) + 3
    perm = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    width = max(-(-s // block_size) for s in lens)
    table = torch.zeros(3, width, dtype=torch.int32)
    cache = torch.full((nb, block_size, dim), NAN)
    for r, s in enumerate(lens):
        for j in range(-(-s // block_size)):
            table[r, j] = perm.pop()
        for p in range(s):
            cache[table[r, p // block_size], p % block_size] = torch.randn(dim, generator=gen)
    req = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, -1, 5], dtype=torch.int32)
    pos = torch.tensor([0, 7, 12, 3, 16, 28, 29, 0, 0, 4], dtype=torch.int32)
    t = req.shape[0]
    q = torch.randn(t, heads, dim, generator=gen)
    w = torch.randn(t, heads, generator=gen)
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), w.to(**to), cache.to(dtype=dtype, **to), table.to(**to),
            req.to(**to), pos.to(**to), max(lens))


def _index_loop(q, w, cache, table, req, pos, scale, num_s):
    t = q.shape[0]
    b = cache.shape[1]
    out = torch.full((t, num_s), float("-inf"), dtype=torch.float64)
    for i in range(t):
        r, p = int(req[i]), int(pos[i])
        if not 0 <= r < table.shape[0]:
            continue
        for j in range(min(p + 1, num_s)):
            k = cache[int(table[r, j // b]), j % b].double().cpu()
            out[i, j] = sum(float(w[i, h]) * max(0.0, scale * float(q[i, h].double().cpu() @ k))
                            for h in range(q.shape[1]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,dim,block_size", [(5, 24, 8), (70, 16, 12)])
def test_indexer_logits_kernel_matches_twin(kernel_device, dtype, heads, dim, block_size):
    q, w, cache, table, req, pos, num_s = _index_inputs(kernel_device, dtype, heads, dim, block_size,
                                                        seed=heads)
    cache = _strided(cache, 5)
    outs = []
    for fn in (indexer_logits, indexer_logits_ref):
        out = torch.full((q.shape[0], num_s), NAN, device=kernel_device)
        fn(q, w, cache, table, req, pos, 0.25, out)
        outs.append(out.cpu())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(outs[0], outs[1], **tol)
    want = _index_loop(q, w, cache, table, req, pos, 0.25, num_s)
    torch.testing.assert_close(outs[1].double(), want, **tol)
    finite = torch.isfinite(outs[0])
    # exactly the causal positions of real requests are scored
    assert finite.sum(1).tolist() == [1, 8, 13, 4, 17, 29, 30, 1, 0, 0]


def test_indexer_logits_errors():
    q, w, cache, table, req, pos, num_s = _index_inputs("cpu", torch.float32)
    out = torch.empty(q.shape[0], num_s)
    with pytest.raises(ConfigError, match="same head size"):
        indexer_logits_ref(q[..., :8], w, cache, table, req, pos, 1.0, out)
    with pytest.raises(ConfigError, match="weights"):
        indexer_logits_ref(q, w[:, :2], cache, table, req, pos, 1.0, out)
    with pytest.raises(ConfigError, match="weights must have dtype"):
        indexer_logits_ref(q, w.half(), cache, table, req, pos, 1.0, out)
    with pytest.raises(ConfigError, match="a row per token"):
        indexer_logits_ref(q, w, cache, table, req, pos, 1.0, out[:3])


# ---- the plan and the top-k


def _metadata(query_lens, seq_lens, table, slots):
    return build_attention_metadata(query_lens, seq_lens, table, slots)


def test_token_rows_by_hand():
    # requests: 3 new of 5 (positions 2, 3, 4), 1 decode at position 9, a padded request
    # (no tokens), then 2 padding tokens
    md = _metadata([3, 1, 0], [5, 10, 0], torch.zeros(3, 2, dtype=torch.int32),
                   torch.full((6,), -1, dtype=torch.int64))
    plan = DSABackend().plan(md, None)
    req, pos = plan.token_rows(6)
    assert req.tolist() == [0, 0, 0, 1, -1, -1] and pos.tolist() == [2, 3, 4, 9, -1, -1]
    assert req.dtype == pos.dtype == torch.int32
    assert plan.token_rows(6)[0] is req  # computed once per row count
    empty = DSABackend().plan(_metadata([], [], torch.zeros(0, 1, dtype=torch.int32),
                                        torch.zeros(2, dtype=torch.int64)), None)
    assert empty.token_rows(2)[0].tolist() == [-1, -1]


def test_index_topk_by_hand():
    """One head, 2-D keys, block size 4: request 0's keys at positions 0..4 score (q = [1, 0],
    w = 1, scale 1) relu(k_x) = 3, 0 (negative), 5, 1, 4; request 1 (its own blocks) is a
    decode at position 2."""
    bs = 4
    table = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    keys0 = torch.tensor([[3.0, 9], [-2, 9], [5, 9], [1, 9], [4, 9]])
    keys1 = torch.tensor([[1.0, 0], [2, 0], [0.5, 0]])
    cache = torch.full((4, bs, 2), NAN)
    for p, k in enumerate(keys0):
        cache[table[0, p // bs], p % bs] = k
    for p, k in enumerate(keys1[:2]):
        cache[table[1, p // bs], p % bs] = k
    # this step: request 0's tokens at positions 3 and 4 (keys already cached, slots -1),
    # request 1 writes its position-2 key through the slot mapping; one padding row
    slot_new = int(table[1, 0]) * bs + 2
    md = _metadata([2, 1], [5, 3], table, torch.tensor([-1, -1, slot_new, -1]))
    q = torch.tensor([[[1.0, 0]], [[1.0, 0]], [[1.0, 0]], [[1.0, 0]]])
    w = torch.ones(4, 1)
    new_keys = torch.stack([torch.zeros(2), torch.zeros(2), keys1[2], torch.full((2,), 7.0)])
    for kernels in ("ref", "kernel"):
        c = cache.clone()
        backend = DSABackend(kernels, writer="ref")
        out = backend.index_topk(q, w, new_keys, c, backend.plan(md, None), 3, 1.0)
        # positions 3 -> scores [3, 0, 5, 1]: 2, 0, 3; position 4 -> 2, 4, 0;
        # request 1 at position 2 -> scores [1, 2, .5]: 1, 0, 2; padding row: none
        assert out.tolist() == [[2, 0, 3], [2, 4, 0], [1, 0, 2], [-1, -1, -1]], kernels
        assert c[table[1, 0], 2].tolist() == [0.5, 0.0]  # written; the padding row was not
        assert not (c == 7.0).any()
        # a top-k wider than the longest request: width max_seq_len, -1 past p + 1
        out = backend.index_topk(q, w, None, c, backend.plan(md, None), 9, 1.0)
        assert out.shape == (4, 5) and out[2].tolist() == [1, 0, 2, -1, -1]


# ---- the backend against dense MLA


def _forward(backend, b: Batch, topk_rows):
    plan = backend.plan(b.metadata, None)
    topk = torch.tensor(topk_rows, dtype=torch.int32)
    return backend.forward(0, b.q_all, b.new_latent, b.cache, plan, b.scale, b.weights, topk)


@pytest.mark.parametrize("kernels", ["ref", "kernel"])
def test_full_topk_is_dense_mla(kernels):
    """Each token selecting its whole causal context (in shuffled order, -1 padded) gives
    MLA; padding rows stay zero; the latents are written."""
    b = Batch(MIXED, 16, pad=2, seed=4)
    n = b.metadata.num_actual_tokens
    width = max(b.lens)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for (ctx, new), s in zip(b.reqs, b.lens):
        for i in range(new):
            p = s - new + i
            sel = torch.randperm(p + 1, generator=gen).tolist()
            rows.append(sel + [-1] * (width - p - 1))
    rows += [[-1] * width] * 2
    out = _forward(DSABackend(kernels, writer="ref"), b, rows)
    torch.testing.assert_close(out[:n].double(), b.expected(), atol=2e-5, rtol=1e-5)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    ref = mla_attention_ref(b.q_all, b.cache, b.metadata, b.scale, b.weights)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_sparse_selection_is_masked_dense_mla():
    """A proper subset per token equals dense MLA of that token over just those positions."""
    b = Batch([(20, 3), (0, 6), (9, 1)], 16, seed=7)
    gen = torch.Generator().manual_seed(1)
    rows, want = [], []
    for r, ((ctx, new), s) in enumerate(zip(b.reqs, b.lens)):
        for i in range(new):
            p = s - new + i
            k = min(4, p + 1)
            sel = torch.randperm(p + 1, generator=gen)[:k]
            rows.append(sel.tolist() + [-1] * (4 - k))
            # dense MLA of this one query row over the selected positions (the last one is the
            # "query position" of dense_mla's causal mask: put the chosen set in order)
            order = sel.sort().values
            q1 = b.q[r][i:i + 1]
            want.append(dense_mla(q1, b.c[r][order], b.k_pe[r][order], b.kv_b, b.scale)[0])
    out = _forward(DSABackend("ref", writer="ref"), b, rows)
    torch.testing.assert_close(out.double(), torch.stack(want), atol=2e-5, rtol=1e-5)


def test_backend_errors_and_mapping():
    b = Batch([(4, 2)], 16)
    backend = DSABackend()
    plan = backend.plan(b.metadata, None)
    assert isinstance(plan, DSAPlan) and not plan.kernels
    with pytest.raises(InvariantError, match="topk_indices"):
        backend.forward(0, b.q_all, None, b.cache, plan, b.scale, b.weights,
                        torch.zeros(1, 3, dtype=torch.int32))
    with pytest.raises(ConfigError, match="topk"):
        backend.index_topk(torch.zeros(2, 1, 8), torch.zeros(2, 1), None,
                           torch.zeros(3, 16, 8), plan, 0, 1.0)
    with pytest.raises(ConfigError, match="kernel mode"):
        DSABackend("fast")
    with pytest.raises(ConfigError, match="writer"):
        DSABackend(writer="x")
    assert DSABackend("kernel").plan(b.metadata, None).kernels
    assert dsa_backend_for(backend) is backend
    mapped = dsa_backend_for(TorchRefBackend(writer="ref"))
    assert mapped.kernels == "ref" and mapped.writer == "ref"
    assert dsa_backend_for(TorchRefMLABackend()).kernels == "ref"
    assert dsa_backend_for(TritonAttentionBackend()).kernels == "auto"
    with pytest.raises(ConfigError, match="has no DeepSeek sparse attention"):
        dsa_backend_for(object())


# ---- GPU: V3.2's shapes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_v32_shapes_on_gpu(dtype):
    """128 heads x (512 + 64) latents, top-k 2048 of contexts up to 5000; 64 indexer heads x
    128; kernels vs twins."""
    t, k = 24, 2048
    q, cache, slots, lens = _sparse_inputs(t, 128, 512, 64, k, 64, dtype, "cuda", seed=1,
                                           num_blocks=80)
    outs = []
    for fn in (sparse_mla_attention, sparse_mla_attention_ref):
        out = torch.full((t, 128, 512), NAN, dtype=dtype, device="cuda")
        fn(q, cache, slots, lens, 192 ** -0.5, out, kv_lora_rank=512)
        outs.append(out.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
    gen = torch.Generator().manual_seed(2)
    nb, bs = 90, 64
    kc = torch.randn(nb, bs, 128, generator=gen).to(dtype).cuda()
    table = (torch.randperm(nb - 1, generator=gen)[:80] + 1).view(1, 80).to(torch.int32).cuda()
    qi = torch.randn(t, 64, 128, generator=gen).to(dtype).cuda()
    wi = torch.randn(t, 64, generator=gen).cuda()
    req = torch.zeros(t, dtype=torch.int32, device="cuda")
    pos = torch.randint(0, 5000, (t,), generator=gen).to(torch.int32).cuda()
    got = indexer_logits(qi, wi, kc, table, req, pos, 128 ** -0.5, torch.empty(t, 5000, device="cuda"))
    ref = indexer_logits_ref(qi, wi, kc, table, req, pos, 128 ** -0.5, torch.empty(t, 5000, device="cuda"))
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), fin)
    torch.testing.assert_close(got[fin], ref[fin], atol=tol * 10, rtol=tol)
