"""The flat split of paged decode attention (``DecodeConfig.flat_split``): the decode
requests' tiles laid end to end and cut into equal shares, one per program.

The host twin of the partition (``flat_pieces``) by hand; the kernels against the torch
reference on mixed batches (block sizes, GQA, CUDA-graph padding, prefill rows left alone,
sliding windows, soft caps, sinks and log-sum-exps, more requests than one scan chunk), with
the partial rows poisoned so that a stale read shows; the workspace rows the kernel writes
against the twin's pieces; a hypothesis property over random batches and program counts.
Interpreted on CPU (tiny shapes, fp32 / fp16), native on CUDA (bf16, CUDA-graph replay)."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_triton_cases import (
    assert_rows_close,
    assert_rows_untouched,
    capture_graph,
    make_case,
    poisoned_out,
    reference,
    rows_of,
    set_lengths,
)

from pagedkv.attention.triton_decode import (
    DecodeConfig,
    default_decode_config,
    flat_launch,
    flat_pieces,
    flat_programs,
    one_range_if_balanced,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from pagedkv.errors import ConfigError

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
SMS_CPU = 132  # num_sms() of a CPU device


def flat_cfg(programs: int, num_kv_heads: int, min_tokens: int = 16, **kw) -> DecodeConfig:
    """An interpreter-sized flat-split launch with ``programs`` programs per KV head."""
    per_sm = (programs * num_kv_heads + 0.5) / SMS_CPU
    cfg = DecodeConfig(tile_n=16, num_warps=1, num_stages=1, flat_split=True,
                       flat_programs_per_sm=per_sm, flat_min_split_tokens=min_tokens,
                       **{"flat_min_programs_per_sm": 0.0, **kw})
    assert flat_programs(num_kv_heads, SMS_CPU, cfg) == programs
    return cfg


def poisoned_workspace(case, programs: int) -> dict:
    """Partial rows full of NaN / inf: a merge that reads a row no program wrote shows."""
    m, dev = case["meta"], case["q"].device
    rows = (programs + m.num_reqs) * case["q"].shape[1]
    return {"decode_flat_partials": (torch.full((rows,), float("nan"), device=dev),
                                     torch.full((rows,), float("inf"), device=dev),
                                     torch.full((rows, 16), float("nan"), device=dev))}


def run_flat(case, cfg, workspace=None, **kw):
    m = case["meta"]
    out = poisoned_out(case)
    paged_decode_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                           m.seq_lens, m.num_reqs, case["scale"], out, config=cfg,
                           workspace=workspace, **kw)
    return out


def check(case, out):
    assert_rows_close(out, reference(case), rows_of(case, lambda ql: ql == 1),
                      TOL[case["q"].dtype])
    assert_rows_untouched(out, rows_of(case, lambda ql: ql != 1))


def test_flat_pieces_by_hand():
    """Tiles of 16: lengths 40, 5, 70 hold 3, 1 and 5 tiles, 9 in all; 3 programs take 3
    each: program 0 request 0 whole, program 1 request 1 whole and request 2's tiles 0-1,
    program 2 request 2's tiles 2-4."""
    cfg = flat_cfg(3, 1, min_tokens=16)
    assert flat_pieces([40, 5, 70], 1, SMS_CPU, cfg) == [
        [(0, 0, 3)], [(1, 0, 1), (2, 0, 2)], [(2, 2, 5)]]
    # a share of at least 4 tiles (64 positions): 3 programs, the last one idle
    assert flat_pieces([40, 5, 70], 1, SMS_CPU, flat_cfg(3, 1, min_tokens=64)) == [
        [(0, 0, 3), (1, 0, 1)], [(2, 0, 4)], [(2, 4, 5)]]
    # other requests (length 0 here) hold no tiles; a window of 20 keeps 2 tiles of a
    # 40-long request (positions 20-39: tiles 1-2) and 2 of a 70-long one (50-69: 3-4):
    # 4 tiles, shares of 2, the third program idle
    assert flat_pieces([40, 0, 70], 1, SMS_CPU, cfg, sliding_window=20) == [
        [(0, 0, 2)], [(2, 0, 2)], []]
    assert flat_pieces([], 1, SMS_CPU, cfg) == [[], [], []]


def test_flat_programs_and_config():
    cfg = DecodeConfig(flat_split=True)  # 4 an SM: 528 programs on an H200, over 8 KV heads
    assert flat_programs(8, 132, cfg) == 66
    assert flat_programs(1, 132, cfg) == 528
    assert flat_programs(8, 132, DecodeConfig(flat_split=True, flat_programs_per_sm=5.0)) == 82
    assert flat_programs(1000, 132, cfg) == 1
    # the flat split leaves the balanced one-wave launch as it is
    assert one_range_if_balanced(64, 8, 132, DecodeConfig()) and one_range_if_balanced(64, 8, 132, cfg)
    for bad in (dict(flat_programs_per_sm=0.0), dict(flat_min_split_tokens=0),
                dict(flat_min_programs_per_sm=-1.0)):
        with pytest.raises(ConfigError):
            DecodeConfig(**bad)


def test_flat_launch_by_hand():
    """The flat split replaces split launches of at least ``flat_min_programs_per_sm x S``
    per-request programs (default 1.0: 132 on an H200): with 8 KV heads from 17 requests on
    (136 programs; 16 requests are 128); never a launch of one range; never with the flat split
    off; every split launch with the floor at 0."""
    cfg = DecodeConfig()
    assert cfg.flat_split and cfg.flat_min_programs_per_sm == 1.0
    assert [flat_launch(b, 8, 132, cfg, 4) for b in (1, 8, 16, 17, 64, 256)] == \
        [False, False, False, True, True, True]
    assert not flat_launch(256, 8, 132, cfg, 1)
    assert not flat_launch(256, 8, 132, DecodeConfig(flat_split=False), 4)
    assert flat_launch(1, 8, 132, DecodeConfig(flat_min_programs_per_sm=0.0), 32)
    assert flat_launch(132, 1, 132, cfg, 2) and not flat_launch(131, 1, 132, cfg, 2)


REQS = [(40, 1), (0, 3), (4, 1), (69, 1), (15, 1), (7, 4), (100, 1), (31, 1)]


@pytest.mark.parametrize("block_size,heads,programs,min_tokens", [
    (4, (4, 2), 3, 16), (1, (2, 2), 5, 16), (16, (8, 2), 2, 32), (3, (4, 1), 7, 16),
    (32, (4, 4), 1, 16), (5, (4, 2), 40, 16),
])
def test_flat_matches_reference(kernel_device, block_size, heads, programs, min_tokens):
    """Mixed batch (prefill rows left alone), stale partials poisoned."""
    case = make_case(REQS, block_size=block_size, num_heads=heads[0], num_kv_heads=heads[1],
                     device=kernel_device, write_new=True, seed=block_size + programs)
    cfg = flat_cfg(programs, heads[1], min_tokens)
    check(case, run_flat(case, cfg, workspace=poisoned_workspace(case, programs)))


@pytest.mark.parametrize("block_size,programs,window", [(4, 3, None), (1, 5, None),
                                                       (16, 2, None), (4, 3, 7)])
def test_flat_table_ahead_equals_the_plain_loop(kernel_device, block_size, programs, window):
    """``DecodeConfig.table_ahead`` in the flat kernel: each piece's table entries loaded a
    tile ahead (pieces start mid-request and cross requests; a window's first tile starts
    before it), the same outputs as the plain loop, bitwise, and as the reference."""
    case = make_case(REQS, block_size=block_size, device=kernel_device, write_new=True,
                     seed=block_size + programs, sliding_window=window)
    plain = flat_cfg(programs, 2, table_ahead=False)
    outs = [run_flat(case, cfg, sliding_window=window,
                     workspace=poisoned_workspace(case, programs))
            for cfg in (plain, dataclasses.replace(plain, table_ahead=True))]
    # (the prefill rows stay NaN in both)
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0, equal_nan=True)
    if window is None:
        check(case, outs[1])


def test_flat_kernel_writes_the_twins_pieces(kernel_device):
    """The partial rows the kernel writes are those of the host twin's pieces of requests
    cut in several: row ``(p + r) H + h`` for each such piece, every other row untouched."""
    reqs = [(40, 1), (4, 1), (69, 1), (100, 1), (15, 1)]
    case = make_case(reqs, block_size=4, num_heads=4, num_kv_heads=2, device=kernel_device,
                     write_new=True, seed=3)
    cfg = flat_cfg(4, 2)
    ws = poisoned_workspace(case, 4)
    check(case, run_flat(case, cfg, workspace=ws))
    lens = case["meta"].seq_lens_cpu[:len(reqs)].tolist()
    pieces = flat_pieces(lens, 2, SMS_CPU, cfg)
    whole = {r for prog in pieces for r, t0, t1 in prog
             if t0 == 0 and t1 == -(-lens[r] // 16)}
    want = torch.zeros((4 + len(reqs)) * 4, dtype=torch.bool)
    for p, prog in enumerate(pieces):
        for r, _, _ in prog:
            if r not in whole:
                want[(p + r) * 4:(p + r + 1) * 4] = True
    assert want.any() and whole
    written = ~torch.isnan(ws["decode_flat_partials"][0].cpu())
    assert torch.equal(written, want)


def test_flat_zero_padded_rows(kernel_device):
    """CUDA-graph padding: the reduce launch zeroes the padded requests' rows past the last
    request's row; decode rows exact; rows past num_reqs never touched."""
    case = make_case([(9, 1), (20, 1), (3, 1)], block_size=4, device=kernel_device,
                     write_new=True, pad_tokens=3, padded_reqs=3, seed=8)
    m = case["meta"]
    out = poisoned_out(case)
    extra = torch.full((2,) + tuple(out.shape[1:]), float("nan"), dtype=out.dtype, device=out.device)
    out = torch.cat([out, extra])
    q = torch.cat([case["q"], torch.zeros_like(extra)])
    paged_decode_attention(q, case["cache"], m.block_table_tensor, m.query_start_loc,
                           m.seq_lens, m.num_reqs, case["scale"], out, zero_padded_rows=True,
                           config=flat_cfg(2, 2))
    check(case, out[: case["q"].shape[0]])
    assert (out[3:6].cpu() == 0).all()
    assert torch.isnan(out[6:].cpu()).all()


def test_flat_more_requests_than_a_scan_chunk(kernel_device):
    """The interpreter scans 16 requests an iteration: 37 requests take three."""
    reqs = [((7 * i) % 53, 1) for i in range(37)]
    case = make_case(reqs, block_size=8, num_heads=2, num_kv_heads=1, device=kernel_device,
                     write_new=True, seed=37)
    check(case, run_flat(case, flat_cfg(6, 1), workspace=poisoned_workspace(case, 6)))


@pytest.mark.parametrize("window,cap", [(7, None), (20, 4.0), (None, 3.0), (1, None)])
def test_flat_window_and_soft_cap(kernel_device, window, cap):
    """A sliding window counts only the tiles holding its positions (the null block, NaN,
    stays unread); the soft cap passes through."""
    case = make_case(REQS, block_size=4, device=kernel_device, write_new=True, seed=5,
                     sliding_window=window)
    out = run_flat(case, flat_cfg(3, 2), sliding_window=window, logits_soft_cap=cap)
    m = case["meta"]
    want = paged_decode_attention_ref(case["q"], case["cache"], m.block_table_tensor,
                                      m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"],
                                      poisoned_out(case), sliding_window=window,
                                      logits_soft_cap=cap)
    dec = rows_of(case, lambda ql: ql == 1)
    torch.testing.assert_close(out.cpu()[dec], want.cpu()[dec], atol=1e-4, rtol=1e-4)
    assert_rows_untouched(out, rows_of(case, lambda ql: ql != 1))


def test_flat_sinks_and_lse(kernel_device):
    """Sinks and log-sum-exps both on the direct write and through the reduce; 6 heads with
    4 a reduce program (the last program's heads past 6 masked)."""
    case = make_case(REQS, block_size=4, num_heads=6, num_kv_heads=3, device=kernel_device,
                     write_new=True, seed=31)
    m = case["meta"]
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(5)).to(kernel_device)
    rows = case["q"].shape[0]
    lse = torch.full((rows, 6), float("nan"), device=kernel_device)
    out = run_flat(case, flat_cfg(4, 3), sinks=sinks, lse=lse)
    want_lse = torch.full((rows, 6), float("nan"), device=kernel_device)
    want = paged_decode_attention_ref(case["q"], case["cache"], m.block_table_tensor,
                                      m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"],
                                      poisoned_out(case), sinks=sinks, lse=want_lse)
    dec = rows_of(case, lambda ql: ql == 1)
    torch.testing.assert_close(out.cpu()[dec], want.cpu()[dec], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu()[dec], want_lse.cpu()[dec], atol=1e-5, rtol=1e-5)
    assert torch.isnan(lse.cpu()[rows_of(case, lambda ql: ql != 1)]).all()


def test_flat_fp16(kernel_device):
    case = make_case([(40, 1), (2, 1), (70, 1), (0, 2)], block_size=16, dtype=torch.float16,
                     device=kernel_device, write_new=True, seed=3)
    check(case, run_flat(case, flat_cfg(3, 2)))


def test_flat_replaces_split_launches_only(kernel_device):
    """A forced ``num_splits``, a one-range launch (``balanced``) and a launch whose contexts
    are too short to split are the per-request launch (its workspace keys, or none); a launch
    that would split is flat."""
    case = make_case([(40, 1), (70, 1)], block_size=4, device=kernel_device, write_new=True,
                     seed=2)
    flat = flat_cfg(3, 2)
    ws = {}
    check(case, run_flat(case, flat, workspace=ws, num_splits=3))
    # (12 programs: one wave, so the per-request launch merges its own ranges by default)
    assert sorted(ws) == ["decode_counters", "decode_partials"]
    ws = {}
    check(case, run_flat(case, flat, workspace=ws))
    assert list(ws) == ["decode_flat_partials"]
    # one range a request: balanced within one wave (2 requests x 2 KV heads = 4 programs
    # <= 1 an SM), and contexts shorter than the split minimum (71 < 512 positions)
    one_wave = dataclasses.replace(flat, balanced_min_programs_per_sm=0.0, wave_programs_per_sm=1.0)
    short = dataclasses.replace(flat, min_split_tokens=512)
    for cfg, kw in ((one_wave, dict(balanced=True)), (short, dict(max_seq_len=71))):
        ws = {}
        check(case, run_flat(case, cfg, workspace=ws, **kw))
        assert ws == {}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.tuples(st.integers(0, 90), st.sampled_from([1, 1, 1, 2])), min_size=1,
                     max_size=9),
       programs=st.integers(1, 9), min_tokens=st.sampled_from([16, 32, 48]),
       block_size=st.sampled_from([1, 3, 4, 16]), seed=st.integers(0, 1000))
def test_flat_property_random_batches(kernel_device, lens, programs, min_tokens, block_size, seed):
    """Any batch, program count and minimum share: exact against the reference, stale
    partial rows never read, non-decode rows untouched."""
    case = make_case(lens, block_size=block_size, num_heads=2, num_kv_heads=1,
                     device=kernel_device, write_new=True, seed=seed)
    cfg = flat_cfg(programs, 1, min_tokens)
    check(case, run_flat(case, cfg, workspace=poisoned_workspace(case, programs)))


# ---- the fused reduce (DecodeConfig.fused_reduce): the last piece's program merges


def run_both(case, programs, heads_kv, cfg_kw=None, **kw):
    """The flat launch with the reduce kernel and with the fused reduce (twice on one
    workspace, its partials stale the second time): outputs and log-sum-exps, and the
    fused workspace. ``cfg_kw``: more ``DecodeConfig`` fields."""
    m = case["meta"]
    heads = case["q"].shape[1]
    got = []
    ws_fused: dict = {}
    for fused in (False, True, True):
        cfg = flat_cfg(programs, heads_kv, fused_reduce=fused, **(cfg_kw or {}))
        lse = torch.full((case["q"].shape[0], heads), float("nan"), device=case["q"].device)
        ws = ws_fused if fused else poisoned_workspace(case, programs)
        out = run_flat(case, cfg, workspace=ws, lse=lse, **kw)
        if fused:
            assert int(ws["decode_counters"].abs().sum()) == 0  # left at zero
        got.append((out.cpu(), lse.cpu()))
    return got, ws_fused, m


@pytest.mark.parametrize("block_size,heads,programs", [(4, (4, 2), 3), (3, (6, 3), 7),
                                                       (1, (2, 2), 5), (16, (4, 1), 40)])
def test_flat_fused_reduce_equals_the_reduce_launch(kernel_device, block_size, heads, programs):
    """Bit for bit the flat split + reduce launches (outputs, log-sum-exps, sinks; requests
    cut in several pieces and held whole; a prefill row left alone), a second launch on the
    same workspace the same; the counters left at zero."""
    case = make_case(REQS, block_size=block_size, num_heads=heads[0], num_kv_heads=heads[1],
                     device=kernel_device, write_new=True, seed=block_size * 7 + programs)
    sinks = torch.randn(heads[0], generator=torch.Generator().manual_seed(2)).to(kernel_device)
    got, _, _ = run_both(case, programs, heads[1], sinks=sinks)
    (plain, plain_lse), *fused = got
    for out, lse in fused:
        assert torch.equal(out.nan_to_num(7.0), plain.nan_to_num(7.0))
        assert torch.equal(lse.nan_to_num(7.0), plain_lse.nan_to_num(7.0))
    m = case["meta"]
    want = paged_decode_attention_ref(case["q"], case["cache"], m.block_table_tensor,
                                      m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"],
                                      poisoned_out(case), sinks=sinks)
    dec = rows_of(case, lambda ql: ql == 1)
    torch.testing.assert_close(fused[0][0][dec], want.cpu()[dec], atol=1e-4, rtol=1e-4)
    assert_rows_untouched(fused[0][0], rows_of(case, lambda ql: ql != 1))


@pytest.mark.parametrize("merge_chunk", [2, 16])
def test_flat_merge_chunk(kernel_device, merge_chunk):
    """``DecodeConfig.merge_chunk`` in the flat split's merges: 40 programs of one-tile shares
    cut the 101-position request in 7 pieces (4 iterations of 2, one of 16); the reduce
    launch and the fused merge equal each other bit for bit, and the reference."""
    case = make_case(REQS, block_size=16, num_heads=4, num_kv_heads=1, device=kernel_device,
                     write_new=True, seed=merge_chunk)
    got, _, _ = run_both(case, 40, 1, cfg_kw={"merge_chunk": merge_chunk})
    (plain, plain_lse), *fused = got
    for out, lse in fused:
        assert torch.equal(out.nan_to_num(7.0), plain.nan_to_num(7.0))
        assert torch.equal(lse.nan_to_num(7.0), plain_lse.nan_to_num(7.0))
    check(case, fused[0][0])


def test_flat_fused_reduce_zero_padded_rows(kernel_device):
    """Without the reduce launch the flat kernel zeroes the padded requests' rows past the
    last request's row (programs stride over the requests); rows past num_reqs untouched."""
    case = make_case([(9, 1), (20, 1), (3, 1)], block_size=4, device=kernel_device,
                     write_new=True, pad_tokens=3, padded_reqs=3, seed=8)
    m = case["meta"]
    out = poisoned_out(case)
    extra = torch.full((2,) + tuple(out.shape[1:]), float("nan"), dtype=out.dtype,
                       device=out.device)
    out = torch.cat([out, extra])
    q = torch.cat([case["q"], torch.zeros_like(extra)])
    ws: dict = {}
    paged_decode_attention(q, case["cache"], m.block_table_tensor, m.query_start_loc,
                           m.seq_lens, m.num_reqs, case["scale"], out, zero_padded_rows=True,
                           config=flat_cfg(2, 2, fused_reduce=True), workspace=ws)
    check(case, out[: case["q"].shape[0]])
    assert (out[3:6].cpu() == 0).all()
    assert torch.isnan(out[6:].cpu()).all()
    assert "decode_flat_partials" in ws and int(ws["decode_counters"].abs().sum()) == 0


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.tuples(st.integers(0, 90), st.sampled_from([1, 1, 1, 2])), min_size=1,
                     max_size=9),
       programs=st.integers(1, 9), block_size=st.sampled_from([1, 3, 16]),
       seed=st.integers(0, 1000))
def test_flat_fused_reduce_property(kernel_device, lens, programs, block_size, seed):
    """Any batch and program count: the fused reduce equals the reduce launch bit for bit."""
    case = make_case(lens, block_size=block_size, num_heads=2, num_kv_heads=1,
                     device=kernel_device, write_new=True, seed=seed)
    got, _, _ = run_both(case, programs, 1)
    (plain, plain_lse), *fused = got
    for out, lse in fused:
        assert torch.equal(out.nan_to_num(7.0), plain.nan_to_num(7.0))
        assert torch.equal(lse.nan_to_num(7.0), plain_lse.nan_to_num(7.0))


def test_flat_fused_reduce_register_cap():
    """The fused flat kernel's register cap fits ``flat_programs_per_sm`` programs an SM
    (its merge would otherwise take it to 3 an SM on sm_90); an explicit cap wins; none
    without the fused reduce."""
    assert DecodeConfig().flat_registers() is None
    assert DecodeConfig(fused_reduce=True).flat_registers() == 128
    assert DecodeConfig(fused_reduce=True, flat_programs_per_sm=5.0).flat_registers() == 96
    assert DecodeConfig(fused_reduce=True, flat_max_registers=112).flat_registers() == 112
    assert DecodeConfig(flat_max_registers=96).flat_registers() == 96


# ---- native GPU


def gpu_flat() -> DecodeConfig:
    return dataclasses.replace(default_decode_config(torch.device("cuda")), flat_split=True,
                               flat_min_programs_per_sm=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 1, 48])
def test_flat_gpu_bf16(block_size):
    torch.manual_seed(block_size)
    ctx = [int(x) for x in torch.randint(1, 3000, (150,))] + [8191, 1, 15, 16, 17]
    case = make_case([(c, 1) for c in ctx], block_size=block_size, num_heads=16,
                     num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda",
                     write_new=True, seed=block_size)
    check(case, run_flat(case, gpu_flat()))
    one = make_case([(8191, 1)], block_size=block_size, num_heads=16, num_kv_heads=8,
                    head_dim=128, dtype=torch.bfloat16, device="cuda", write_new=True, seed=1)
    check(one, run_flat(one, gpu_flat()))


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [3, 4])
def test_flat_gpu_table_ahead(stages):
    """The flat kernel with the table a tile ahead, compiled: bf16, 155 mixed lengths, pages of
    16 and 64; equal to the reference and bitwise to the plain loop at the same stages."""
    ctx = [int(x) for x in torch.randint(1, 3000, (150,), generator=torch.Generator().manual_seed(
        stages))] + [8191, 1, 15, 16, 17]
    for bs in (16, 64):
        case = make_case([(c, 1) for c in ctx], block_size=bs, num_heads=16, num_kv_heads=8,
                         head_dim=128, dtype=torch.bfloat16, device="cuda", write_new=True,
                         seed=bs + stages)
        plain = dataclasses.replace(gpu_flat(), num_stages=stages, table_ahead=False)
        out = run_flat(case, dataclasses.replace(plain, table_ahead=True,
                                                 table_ahead_stages=stages))
        check(case, out)
        torch.testing.assert_close(out, run_flat(case, plain), atol=0, rtol=0)


@pytest.mark.gpu
def test_flat_gpu_cuda_graph_replay_matches_per_request_launch():
    """Captured once, replayed with other lengths written in place: equal to the reference, and within bf16 rounding of the per-request launch."""
    case = make_case([(4000, 1), (100, 1), (2500, 1)], block_size=16, num_heads=16, num_kv_heads=8, head_dim=128,
                     dtype=torch.bfloat16, device="cuda", write_new=True, seed=11)
    m = case["meta"]
    out = torch.zeros_like(case["q"])
    cfg = gpu_flat()

    def call():
        paged_decode_attention(case["q"], case["cache"], m.block_table_tensor,
                               m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"], out,
                               config=cfg, zero_padded_rows=True, workspace=ws)

    ws = {}
    graph = capture_graph(call)
    for lens in ([3000, 1, 2000], [17, 101, 2501], [4001, 101, 2501]):
        set_lengths(case, lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(case, out)
        plain = run_flat(case, default_decode_config(torch.device("cuda")))
        torch.testing.assert_close(out.float(), plain.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_flat_gpu_fused_reduce():
    """The fused reduce on the H200 (bf16, 16 / 8 heads, 150 mixed lengths and B1/L8192):
    close to the reduce launch and the reference, 30 launches on one workspace bitwise equal
    to the first (the counters reset every launch), then a CUDA-graph replay with new
    lengths."""
    fused = dataclasses.replace(gpu_flat(), fused_reduce=True)
    torch.manual_seed(4)
    for ctx in ([int(x) for x in torch.randint(1, 3000, (150,))], [8191]):
        case = make_case([(c, 1) for c in ctx], block_size=16, num_heads=16, num_kv_heads=8,
                         head_dim=128, dtype=torch.bfloat16, device="cuda", write_new=True,
                         seed=len(ctx))
        ws: dict = {}
        first = run_flat(case, fused, workspace=ws)
        check(case, first)
        torch.testing.assert_close(first, run_flat(case, gpu_flat()), atol=2e-3, rtol=2e-3)
        for _ in range(30):
            assert torch.equal(run_flat(case, fused, workspace=ws), first)
        assert int(ws["decode_counters"].abs().sum()) == 0
    m = case["meta"]
    out = torch.zeros_like(case["q"])
    ws = {}

    def call():
        paged_decode_attention(case["q"], case["cache"], m.block_table_tensor,
                               m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"], out,
                               config=fused, zero_padded_rows=True, workspace=ws)

    graph = capture_graph(call)
    for lens in ([5000], [17], [8192]):
        set_lengths(case, lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(case, out)
