"""The persistent decode layer (``pagedkv.kernels.persistent_layer``: o_proj, gate/up + SiLU,
down_proj and the next QKV projection, plain or with q/k norms + RoPE + the K/V write, in one
launch, grid barriers between them) against its torch twin: interpreted on the CPU (one program through every phase, so the barriers and
the barrier reset run; several programs one phase a launch), natively on the GPU at the
Qwen3-0.6B shape with one program an SM, the L2 prefetch on and off, and in CUDA-graph
replays. Scratch outputs start as NaN, so a tile no program writes shows."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.kernels.persistent_layer import persistent_layer, persistent_layer_ref


def _inputs(m, hd, ho, inter, nqkv, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    return dict(h=r(m, hd), attn=r(m, ho, scale=0.5), wo=r(hd, ho, scale=ho ** -0.5),
                g1=(1 + r(hd, scale=0.1)), wgu=r(2 * inter, hd, scale=hd ** -0.5),
                wd=r(hd, inter, scale=inter ** -0.5), g2=(1 + r(hd, scale=0.1)),
                wqkv=r(nqkv, hd, scale=hd ** -0.5), eps=1e-6)


def _nan_scratch(m, hd, nqkv, inter, dtype, device):
    return {name: torch.full((m, cols), float("nan"), dtype=dtype, device=device)
            for name, cols in (("h2", hd), ("qkv", nqkv), ("h1", hd), ("act", inter))}


SMALL = dict(hd=64, ho=64, inter=128, nqkv=96)
SMALL_TILES = dict(BM=16, BN_O=32, BN_GU=16, BN_D=32, BN_QKV=32, BK=32)  # 40 rows: 3 row tiles


def _check(got, want, tol):
    for name, a, b in zip(("h2", "qkv", "h1", "act"), got, want):
        assert not torch.isnan(a).any(), name
        torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=tol, rtol=tol,
                                   msg=lambda s, name=name: f"{name}: {s}")


@pytest.mark.parametrize("m", [1, 5, 16, 40])
@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize("splits", [(1, 1), (2, 4)])
def test_persistent_layer_matches_twin_interpreted(kernel_device, m, one_launch, splits):
    """o / down unsplit, and split in 2 / 4 inner chunks (partials summed by the last split
    to arrive)."""
    if kernel_device != "cpu":
        pytest.skip("interpreter shapes; the GPU case is test_persistent_layer_gpu")
    dt = torch.float16  # bf16 arithmetic is broken in the interpreter
    x = _inputs(m, **SMALL, dtype=dt, device="cpu", seed=m)
    scratch = _nan_scratch(m, SMALL["hd"], SMALL["nqkv"], SMALL["inter"], dt, "cpu")
    bar = torch.zeros(64, dtype=torch.int32)
    tiles = dict(SMALL_TILES, SPLITS_O=splits[0], SPLITS_D=splits[1])
    if one_launch:  # one program: every barrier passes on its own arrival
        got = persistent_layer(**x, num_programs=1, scratch=scratch, bar=bar, tiles=tiles)
    else:  # three programs, one phase a launch (the interpreter cannot run a barrier of 3)
        for k in range(4):
            got = persistent_layer(**x, num_programs=3, phases=(k, k), scratch=scratch, bar=bar,
                                   tiles=tiles)
    assert not bar.any(), "the last program out resets the barrier, the last split its tile's"
    _check(got, persistent_layer_ref(**x), 2e-2)


def _rope_case(m, heads, kv_heads, dim, nb, bs, dtype, device, seed, splits):
    """q/k norm weights, cos / sin, distinct slots (one row unmapped), NaN caches and q."""
    import math

    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(m, dim // 2, generator=g) * 2 * math.pi
    slots = torch.randperm(nb * bs, generator=g)[:m]
    slots[m // 2] = -1
    return dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                q_norm_weight=(torch.rand(dim, generator=g) + 0.5).to(dtype).to(device),
                k_norm_weight=(torch.rand(dim, generator=g) + 0.5).to(dtype).to(device),
                eps=1e-6, cos=angles.cos().to(device), sin=angles.sin().to(device),
                slot_mapping=slots.to(device),
                key_cache=torch.full((nb, bs, kv_heads, dim), float("nan"), dtype=dtype,
                                     device=device),
                value_cache=torch.full((nb, bs, kv_heads, dim), float("nan"), dtype=dtype,
                                       device=device),
                q_out=torch.full((m, heads, dim), float("nan"), dtype=dtype, device=device),
                splits=splits)


def _rope_want(x, rope):
    """The twin: ``persistent_layer_ref``'s h2, then ``qkv_rope_cache_ref`` with the input norm."""
    from pagedkv.kernels.qkv_rope_cache import qkv_rope_cache_ref

    h2, _, h1, act = persistent_layer_ref(**x)
    r = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in rope.items()}
    kc = torch.full_like(r["key_cache"], float("nan"))
    vc = torch.full_like(r["value_cache"], float("nan"))
    q = qkv_rope_cache_ref(h2.cpu(), x["wqkv"].cpu(), None, r["num_heads"], r["num_kv_heads"],
                           r["head_dim"], r["q_norm_weight"], r["k_norm_weight"], r["eps"],
                           r["cos"], r["sin"], r["slot_mapping"], kc, vc,
                           ln_weight=x["g2"].cpu(), ln_eps=x["eps"])
    return h2, q, h1, act, kc, vc


def _check_rope(got, rope, want, tol):
    h2, q, h1, act, kc, vc = want
    _check(got, (h2, q, h1, act), tol)
    for name, a, b in (("key_cache", rope["key_cache"], kc), ("value_cache", rope["value_cache"], vc)):
        a = a.float().cpu()
        assert torch.equal(torch.isnan(a), torch.isnan(b.float())), f"{name}: written slots"
        torch.testing.assert_close(a.nan_to_num(), b.float().nan_to_num(), atol=tol, rtol=tol)


@pytest.mark.parametrize("m,splits", [(1, 1), (5, 2), (40, 2)])
@pytest.mark.parametrize("one_launch", [True, False])
def test_persistent_layer_rope_matches_twin_interpreted(kernel_device, m, splits, one_launch):
    """Phase 3 as qkv_rope_cache's tiles: q out, K / V in the pages of mapped rows only."""
    if kernel_device != "cpu":
        pytest.skip("interpreter shapes; the GPU case is test_persistent_layer_rope_gpu")
    dt = torch.float16
    shape = dict(hd=64, ho=64, inter=128, nqkv=(2 + 2 * 1) * 32)
    x = _inputs(m, **shape, dtype=dt, device="cpu", seed=m + 7)
    rope = _rope_case(m, 2, 1, 32, 16, 4, dt, "cpu", m, splits)
    want = _rope_want(x, rope)
    scratch = _nan_scratch(m, shape["hd"], shape["nqkv"], shape["inter"], dt, "cpu")
    bar = torch.zeros(64, dtype=torch.int32)  # barrier, then heads x row tiles
    tiles = dict(SMALL_TILES, SPLITS_O=splits, SPLITS_D=splits)
    if one_launch:
        got = persistent_layer(**x, num_programs=1, scratch=scratch, bar=bar, tiles=tiles,
                               rope=rope)
    else:
        for k in range(4):
            got = persistent_layer(**x, num_programs=3, phases=(k, k), scratch=scratch,
                                   bar=bar, tiles=tiles, rope=rope)
    assert got[1] is rope["q_out"]
    assert not bar.any(), "the barrier and the split counters are back at zero"
    _check_rope(got, rope, want, 2e-2)


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_property_persistent_layer_any_tiling(data):
    """Random rows, row / column tiles, inner splits, phase groupings over launches (one
    program for a multi-phase launch, 1-4 programs for one phase) and the fused QKV phase on
    or off: the same outputs as the twin, counters back at zero (interpreter, fp32)."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    m = data.draw(st.integers(1, 40), label="rows")
    tiles = dict(BM=data.draw(st.sampled_from([16, 32, 64])),
                 BN_O=data.draw(st.sampled_from([32, 64])),
                 BN_GU=data.draw(st.sampled_from([16, 32, 64])),
                 BN_D=data.draw(st.sampled_from([32, 64])),
                 BN_QKV=32, BK=data.draw(st.sampled_from([16, 32])),
                 SPLITS_O=data.draw(st.integers(1, 4)), SPLITS_D=data.draw(st.integers(1, 4)))
    cuts = sorted(data.draw(st.sets(st.integers(1, 3), max_size=3), label="launch cuts"))
    groups = [(lo, hi - 1) for lo, hi in zip([0] + cuts, cuts + [4])]
    fused = data.draw(st.booleans(), label="fused QKV")
    dt = torch.float32
    shape = dict(hd=64, ho=64, inter=128, nqkv=128)
    x = _inputs(m, **shape, dtype=dt, device="cpu", seed=m)
    rope = _rope_case(m, 2, 1, 32, 16, 4, dt, "cpu", m, data.draw(st.integers(1, 2))) \
        if fused else None
    scratch = _nan_scratch(m, shape["hd"], shape["nqkv"], shape["inter"], dt, "cpu")
    bar = torch.zeros(256, dtype=torch.int32)
    for lo, hi in groups:
        programs = 1 if hi > lo else data.draw(st.integers(1, 4))
        got = persistent_layer(**x, num_programs=programs, phases=(lo, hi), scratch=scratch,
                               bar=bar, tiles=tiles, rope=rope)
    assert not bar.any()
    if fused:
        _check_rope(got, rope, _rope_want(x, rope), 1e-4)
    else:
        _check(got, persistent_layer_ref(**x), 1e-4)


def test_persistent_layer_errors():
    """Typed errors for shapes, phases, a bias without the fused QKV phase, too few counters,
    and a barrier launch of several interpreted programs (it would spin forever)."""
    from pagedkv.errors import ConfigError

    x = _inputs(4, **SMALL, dtype=torch.float32, device="cpu", seed=0)
    bad = dict(x, wo=x["wo"][:, :32].contiguous())
    with pytest.raises(ConfigError, match="wo must have shape"):
        persistent_layer(**bad, tiles=SMALL_TILES)
    with pytest.raises(ConfigError, match="contiguous"):
        persistent_layer(**dict(x, wd=x["wd"].T.contiguous().T), tiles=SMALL_TILES)
    with pytest.raises(ConfigError, match="phases"):
        persistent_layer(**x, phases=(2, 1), tiles=SMALL_TILES)
    with pytest.raises(ConfigError, match="qkv_bias"):
        persistent_layer(**x, qkv_bias=torch.zeros(SMALL["nqkv"]), tiles=SMALL_TILES)
    import os
    if os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.raises(ConfigError, match="num_programs=1"):
            persistent_layer(**x, num_programs=2, tiles=SMALL_TILES)
    rope = _rope_case(4, 2, 1, 32, 16, 4, torch.float32, "cpu", 0, 2)
    xr = _inputs(4, hd=64, ho=64, inter=128, nqkv=128, dtype=torch.float32, device="cpu", seed=0)
    with pytest.raises(ConfigError, match="counters"):
        persistent_layer(**xr, rope=rope, bar=torch.zeros(4, dtype=torch.int32),
                         tiles=SMALL_TILES)
    with pytest.raises(ConfigError, match="no column tile"):
        from pagedkv.kernels.persistent_layer import layer_tiles
        layer_tiles(4, 132, 48, 128, 96)


def test_persistent_layer_twin_by_hand():
    """The twin at one row, one column a projection, worked by hand: h 1 x 2."""
    f = torch.float32
    h = torch.tensor([[1.0, -1.0]], dtype=f)
    attn = torch.tensor([[2.0]], dtype=f)
    wo = torch.tensor([[1.0], [0.5]], dtype=f)          # h1 = [1 + 2, -1 + 1] = [3, 0]
    g1 = torch.tensor([1.0, 1.0], dtype=f)              # rms(h1) = sqrt(4.5)
    wgu = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=f)  # I = 1: gate row, up row
    wgu[1] = torch.tensor([2.0, 1.0])
    wd = torch.tensor([[1.0], [-1.0]], dtype=f)         # down: 2 x 1
    g2 = torch.tensor([1.0, 1.0], dtype=f)
    wqkv = torch.tensor([[1.0, 1.0]], dtype=f)
    h2, qkv, h1, act = persistent_layer_ref(h, attn, wo, g1, wgu, wd, g2, wqkv, 0.0)
    assert h1.tolist() == [[3.0, 0.0]]
    r = 4.5 ** -0.5
    gate, up = 3.0 * r, 6.0 * r
    a = gate / (1 + torch.exp(torch.tensor(-gate))) * up
    torch.testing.assert_close(act, a.reshape(1, 1))
    torch.testing.assert_close(h2, torch.tensor([[3.0 + a, -a]]))
    r2 = torch.rsqrt((h2 ** 2).mean())
    torch.testing.assert_close(qkv, ((h2[0, 0] + h2[0, 1]) * r2).reshape(1, 1))


def test_barrier_probe_interpreted(kernel_device):
    """One program passes its barriers alone and resets the counters."""
    if kernel_device != "cpu":
        pytest.skip("interpreter; the GPU case is test_barrier_probe_gpu")
    from pagedkv.kernels.persistent_layer import barrier_probe

    bar, count = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    barrier_probe(5, bar, count, 1, seen=torch.zeros(1, dtype=torch.int32))
    assert count.tolist() == [5, 0] and bar.tolist() == [0, 0]


@pytest.mark.gpu
def test_barrier_probe_gpu():
    """One program an SM through 1,000 barriers, twice: after each barrier every program sees
    every other's count of barriers reached at least at its own (none passed early), none
    hangs, the counters reset."""
    from pagedkv.kernels.persistent_layer import barrier_probe

    bar = torch.zeros(2, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for _ in range(2):
        count = torch.zeros(2, dtype=torch.int32, device="cuda")
        barrier_probe(1000, bar, count, sms, seen=torch.zeros(sms, dtype=torch.int32,
                                                              device="cuda"))
        torch.cuda.synchronize()
        assert count.tolist() == [1000, 0] and bar.tolist() == [0, 0]


def test_layer_tiles():
    """Row tiles of at most 64 (several for larger batches); each phase's column tile the
    one whose busiest program loads the fewest bytes, by hand at 132 programs."""
    from pagedkv.kernels.persistent_layer import layer_tiles

    t = layer_tiles(1)
    # o_proj (two halves of at least 16 rows): 32 -> 32 items, 1 each, 16 + 32 = 48; 64 -> 80
    # gate/up (two weight rows a column): 16 -> 192 items, 2 each x (16 + 32) = 96;
    # 32 -> 96 items x (16 + 64) = 80: 32 wins; 64 -> 48 items x 144
    assert (t["BM"], t["BN_O"], t["BN_GU"], t["BN_D"], t["BN_QKV"]) == (16, 32, 32, 32, 32)
    t = layer_tiles(256)  # 4 row tiles of 64
    # o_proj: 16 -> 256 items, 2 each x 80 = 160; 32 -> 128 items x 96 = 96; 64 -> 64 x 128
    # QKV: 64 -> 256 items, 2 x 128 = 256; 128 -> 128 items x 192 = 192
    assert (t["BM"], t["BN_O"], t["BN_D"], t["BN_QKV"]) == (64, 32, 32, 128)
    assert layer_tiles(33)["BM"] == 64 and layer_tiles(17)["BM"] == 32


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 33, 128, 256])
@pytest.mark.parametrize("splits", [1, 4])
def test_persistent_layer_rope_gpu(m, splits):
    """The Qwen3-0.6B shape with phase 3 fused (q/k norms, RoPE, K / V write), the L2
    prefetch on, one program an SM."""
    dev, dt = "cuda", torch.bfloat16
    shape = dict(hd=1024, ho=2048, inter=3072, nqkv=(16 + 2 * 8) * 128)
    x = _inputs(m, **shape, dtype=dt, device=dev, seed=m)
    rope = _rope_case(m, 16, 8, 128, 64, 16, dt, dev, m, splits)
    want = _rope_want(x, rope)
    for _ in range(2):
        got = persistent_layer(**x, prefetch=True, rope=rope)
        torch.cuda.synchronize()
        _check_rope(got, rope, want, 3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 33, 64, 128, 200, 256])
@pytest.mark.parametrize("prefetch", [False, True])
def test_persistent_layer_gpu(m, prefetch):
    """One program an SM, the Qwen3-0.6B shape (o / down split at 1-128 rows by default),
    three launches, then 10 replays of a graph of 4 launches on the same buffers."""
    dev = "cuda"
    dt = torch.bfloat16
    shape = dict(hd=1024, ho=2048, inter=3072, nqkv=4096)
    x = _inputs(m, **shape, dtype=dt, device=dev, seed=m)
    want = persistent_layer_ref(**x)
    bar = torch.zeros(1024, dtype=torch.int32, device=dev)  # barrier + o / down split tiles
    for _ in range(3):  # the barrier resets itself between launches
        scratch = _nan_scratch(m, shape["hd"], shape["nqkv"], shape["inter"], dt, dev)
        got = persistent_layer(**x, prefetch=prefetch, scratch=scratch, bar=bar)
        torch.cuda.synchronize()
        assert not bar.any()
        _check(got, want, 3e-2)
    # 10 replays of a graph of 4 launches on the same buffers: stale reads would show
    scratch = _nan_scratch(m, shape["hd"], shape["nqkv"], shape["inter"], dt, dev)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        persistent_layer(**x, prefetch=prefetch, scratch=scratch, bar=bar)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(4):
            persistent_layer(**x, prefetch=prefetch, scratch=scratch, bar=bar)
    for _ in range(10):
        for t in scratch.values():
            t.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    assert not bar.any()
    _check((scratch["h2"], scratch["qkv"], scratch["h1"], scratch["act"]), want, 3e-2)
