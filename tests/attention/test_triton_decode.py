"""Paged decode kernel vs the torch reference: interpreted on CPU (tiny shapes, fp32/fp16), and
natively on CUDA (bf16, model-sized shapes, CUDA-graph replay)."""

import dataclasses

import numpy as np
import pytest
import torch
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
    FP8_DECODE_CONFIG,
    INTERPRET_DECODE_CONFIG,
    DecodeConfig,
    default_decode_config,
    choose_num_splits,
    choose_split,
    busiest_sm_excess_fits,
    lengths_balanced,
    longest_first_order,
    lpt_fits,
    one_range_for,
    one_range_if_balanced,
    one_range_possible,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from pagedkv.errors import ConfigError

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def run_decode(case, **kw):
    m = case["meta"]
    out = poisoned_out(case)
    paged_decode_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                           m.seq_lens, m.num_reqs, case["scale"], out, **kw)
    return out


def check(case, out):
    ref = reference(case)
    assert_rows_close(out, ref, rows_of(case, lambda ql: ql == 1),
                      TOL[case["q"].dtype])
    assert_rows_untouched(out, rows_of(case, lambda ql: ql != 1))


# contexts crossing block boundaries (block sizes 1, 3, 16, 32), 1 .. 4 tiles of 16
DECODES = [(0, 1), (4, 1), (15, 1), (16, 1), (31, 1), (47, 1), (63, 1)]


@pytest.mark.parametrize("block_size,heads,num_splits", [
    (1, (2, 2), None), (3, (4, 2), 3), (16, (8, 2), 1), (32, (4, 1), 4), (3, (4, 4), 1),
    (16, (4, 2), 7),
])
def test_decode_matches_reference(kernel_device, block_size, heads, num_splits):
    case = make_case(DECODES, block_size=block_size, num_heads=heads[0], num_kv_heads=heads[1],
                     seed=block_size, device=kernel_device, write_new=True)
    check(case, run_decode(case, num_splits=num_splits))


@pytest.mark.parametrize("block_size,num_splits,window", [
    (1, None, None), (3, 3, None), (16, 1, None), (16, 2, None), (4, 2, 5), (16, None, 20),
])
def test_decode_table_ahead_matches_reference(kernel_device, block_size, num_splits, window):
    """``DecodeConfig.table_ahead``: each tile's block-table entries loaded one iteration
    ahead (the loop's last load reads past the range: masked at the sequence end, in bounds of
    the table); ranges starting mid-request, one tile and several, a sliding window whose
    first tile starts before it (null entries ahead of ``lo``)."""
    cfg = dataclasses.replace(default_decode_config(torch.device(kernel_device)),
                              table_ahead=True, flat_split=False)  # the per-request kernel
    reqs = DECODES + [(100, 1), (37, 1)]
    case = make_case(reqs, block_size=block_size, num_heads=4, num_kv_heads=2,
                     seed=block_size + (window or 0), device=kernel_device, write_new=True,
                     sliding_window=window)
    out = run_decode(case, num_splits=num_splits, config=cfg, sliding_window=window)
    ref = paged_decode_attention_ref(case["q"], case["cache"], case["meta"].block_table_tensor,
                                     case["meta"].query_start_loc, case["meta"].seq_lens,
                                     case["meta"].num_reqs, case["scale"], poisoned_out(case),
                                     sliding_window=window)
    assert_rows_close(out, ref, rows_of(case, lambda ql: ql == 1), TOL[case["q"].dtype])
    plain = run_decode(case, num_splits=num_splits, sliding_window=window,
                       config=dataclasses.replace(cfg, table_ahead=False))
    torch.testing.assert_close(out, plain, atol=0, rtol=0)  # the same products, in order


def test_decode_fp16_split(kernel_device):
    case = make_case([(40, 1), (2, 1), (70, 1)], block_size=16, dtype=torch.float16,
                     device=kernel_device, write_new=True, seed=3)
    check(case, run_decode(case, num_splits=4))


def test_decode_skips_other_rows_in_mixed_batch(kernel_device):
    """Prefill / chunk rows and padding rows stay as they were (poison)."""
    case = make_case([(0, 3), (9, 1), (5, 4), (20, 1)], block_size=3, device=kernel_device,
                     write_new=True, pad_tokens=2, padded_reqs=1, seed=4)
    out = run_decode(case, num_splits=2)
    check(case, out)
    assert torch.isnan(out[-2:].cpu()).all()


@pytest.mark.parametrize("impl", ["kernel", "twin"])
def test_decode_zero_padded_rows(kernel_device, impl):
    """CUDA-graph padding (decode-only, rows == requests): padded requests own no rows; with
    zero_padded_rows each zeroes row r (past query_start_loc[num_reqs]) inside the kernel;
    decode rows are exact and rows >= num_reqs are never touched."""
    case = make_case([(9, 1), (20, 1), (3, 1)], block_size=4, device=kernel_device,
                     write_new=True, pad_tokens=3, padded_reqs=3, seed=8)
    m = case["meta"]
    out = poisoned_out(case)
    extra = torch.full((2,) + tuple(out.shape[1:]), float("nan"), dtype=out.dtype, device=out.device)
    out = torch.cat([out, extra])  # rows beyond the padded requests: must stay poisoned
    q = torch.cat([case["q"], torch.zeros_like(extra)])
    fn = paged_decode_attention if impl == "kernel" else paged_decode_attention_ref
    fn(q, case["cache"], m.block_table_tensor, m.query_start_loc, m.seq_lens, m.num_reqs,
       case["scale"], out, num_splits=2, zero_padded_rows=True)
    assert m.num_reqs == 6 and int(m.query_start_loc[6]) == 3
    check(case, out[: case["q"].shape[0]])  # decode rows exact
    assert (out[3:6].cpu() == 0).all()
    assert torch.isnan(out[6:].cpu()).all()


def test_decode_head_dim_not_power_of_two(kernel_device):
    case = make_case([(18, 1), (3, 1)], block_size=5, head_dim=24, device=kernel_device,
                     write_new=True, seed=5)
    check(case, run_decode(case, num_splits=2))


def test_decode_twin_agrees(kernel_device):
    case = make_case([(11, 1), (0, 2), (33, 1)], block_size=4, device=kernel_device,
                     write_new=True, seed=6)
    m = case["meta"]
    a = run_decode(case, num_splits=3)
    b = poisoned_out(case)
    paged_decode_attention_ref(case["q"], case["cache"], m.block_table_tensor,
                               m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"], b)
    torch.testing.assert_close(a.nan_to_num(7.0), b.nan_to_num(7.0), atol=1e-4, rtol=1e-4)


def ordered(device) -> DecodeConfig:
    """The device's default launch with ``use_order`` on (the default, except for FP8 caches)."""
    return dataclasses.replace(default_decode_config(torch.device(device)), use_order=True)


def unordered(device) -> DecodeConfig:
    """The device's default launch with ``use_order`` (and the one-range policy that needs it)
    off."""
    return dataclasses.replace(default_decode_config(torch.device(device)), use_order=False,
                               lpt_one_range=False)


def test_longest_first_order_by_hand():
    """Decreasing length, ties in index order; int32."""
    o = longest_first_order([5, 70, 5, 0, 70, 12])
    assert o.dtype == np.int32 and o.tolist() == [1, 4, 5, 0, 2, 3]
    assert longest_first_order([]).tolist() == []
    assert longest_first_order(np.array([[3], [9]])).tolist() == [1, 0]


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_longest_first_order_exact(kernel_device, num_splits):
    """Programs launched request by request in ``order`` (grid (splits, heads, requests)):
    every decode row equals the reference and equals the unordered launch bit for bit;
    prefill and padding rows stay untouched; zero_padded_rows still zeroes the padding rows
    past the last request's row (the padded requests are in the order too)."""
    reqs = [(9, 1), (0, 3), (63, 1), (20, 1), (33, 1), (4, 2)]
    case = make_case(reqs, block_size=3, num_heads=4, num_kv_heads=2, device=kernel_device,
                     write_new=True, pad_tokens=2, padded_reqs=1, seed=41)
    m = case["meta"]
    order = torch.from_numpy(longest_first_order(m.seq_lens_cpu[:m.num_reqs].numpy()))
    assert order.tolist()[:2] == [2, 4]
    got = run_decode(case, num_splits=num_splits, order=order.to(kernel_device),
                     config=ordered(kernel_device))
    plain = run_decode(case, num_splits=num_splits)
    check(case, got)
    dec = rows_of(case, lambda ql: ql == 1)
    assert torch.equal(got.cpu()[dec], plain.cpu()[dec])
    assert torch.isnan(got[-2:].cpu()).all()


def test_decode_order_zero_padded_rows(kernel_device):
    """CUDA-graph padding with an order: padded requests (length 0) come last in it and
    zero their rows, exactly as without an order."""
    case = make_case([(9, 1), (20, 1), (3, 1)], block_size=4, device=kernel_device,
                     write_new=True, pad_tokens=3, padded_reqs=3, seed=8)
    m = case["meta"]
    order = torch.from_numpy(longest_first_order(m.seq_lens_cpu[:m.num_reqs].numpy()))
    assert order.tolist() == [1, 0, 2, 3, 4, 5]
    outs = []
    for o in (order.to(kernel_device), None):
        out = poisoned_out(case)
        paged_decode_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                               m.seq_lens, m.num_reqs, case["scale"], out, num_splits=2,
                               zero_padded_rows=True, order=o, config=ordered(kernel_device))
        outs.append(out.cpu())
    check(case, outs[0].to(kernel_device))
    assert torch.equal(outs[0].nan_to_num(7.0), outs[1].nan_to_num(7.0))
    assert (outs[0][3:6] == 0).all()


def test_decode_order_is_read(kernel_device):
    """The kernel maps its programs to requests through ``order``: an order naming request 2
    only (not a permutation: outside the contract, for this test alone) writes request 2's
    row and leaves the others poisoned."""
    case = make_case([(9, 1), (20, 1), (30, 1)], block_size=4, device=kernel_device,
                     write_new=True, seed=12)
    out = run_decode(case, num_splits=1,  # one range: no reduce launch (it reads no order)
                     order=torch.full((3,), 2, dtype=torch.int32, device=kernel_device),
                     config=ordered(kernel_device))
    # use_order off: the order is not read, every row is computed
    check(case, run_decode(case, num_splits=1,
                           order=torch.full((3,), 2, dtype=torch.int32, device=kernel_device),
                           config=unordered(kernel_device)))
    ref = reference(case)
    assert_rows_close(out, ref, [2], TOL[case["q"].dtype])
    assert torch.isnan(out[:2].cpu()).all()


def test_decode_order_argument_errors(kernel_device):
    case = make_case([(9, 1), (20, 1)], block_size=4, device=kernel_device, write_new=True,
                     seed=2)
    for bad in (torch.tensor([1, 0], dtype=torch.int64), torch.tensor([0], dtype=torch.int32),
                torch.zeros((2, 1), dtype=torch.int32), [1, 0]):
        if isinstance(bad, torch.Tensor):
            bad = bad.to(kernel_device)
        with pytest.raises(ConfigError, match="order"):
            run_decode(case, order=bad)


def test_choose_split_regimes():
    cfg = DecodeConfig()  # H200 policy, 132 multiprocessors, 8 KV heads
    # the fewest programs (<= 0.5 x 132 = 66): ceil(4 x 132 / programs) splits of >= 32
    # positions, <= 32
    assert choose_split(1, 8, 8192, 132, cfg) == (32, 32)  # 528 / 8 -> 66, capped at 32
    assert choose_split(1, 8, 512, 132, cfg) == (16, 32)  # capped: 512 / 32
    assert choose_split(1, 8, None, 132, cfg) == (32, 32)
    assert choose_split(2, 8, None, 132, cfg) == (32, 32)  # 528 / 16 = 33, capped
    assert choose_split(3, 8, None, 132, cfg) == (22, 32)  # 528 / 24 = 22: 528 programs
    assert choose_split(4, 8, None, 132, cfg) == (17, 32)  # 528 / 32 = 16.5
    assert choose_split(8, 8, None, 132, cfg) == (9, 32)  # 528 / 64 = 8.25
    assert choose_split(0, 8, 8192, 132, cfg) == (32, 32)
    # few programs (66 < programs < 2 x 132): ceil(8 x 132 / programs)
    assert choose_split(9, 8, None, 132, cfg) == (15, 32)  # 1056 / 72 = 14.7
    assert choose_split(16, 8, None, 132, cfg) == (9, 32)  # 1056 / 128 = 8.25
    assert choose_split(32, 8, None, 132, cfg) == (5, 32)  # 256 programs
    # without the fewest-programs rule (FP8 caches, MLA): ceil(8 x 132 / programs) from 1 up
    old = DecodeConfig(few_waves=None)
    assert choose_split(3, 8, None, 132, old) == (32, 32)  # 1056 / 24 = 44, capped
    assert choose_split(8, 8, None, 132, old) == (17, 32)  # 1056 / 64 = 16.5
    assert choose_split(8, 8, None, 132, DecodeConfig(few_max_programs_per_sm=0.4)) == (17, 32)
    assert choose_split(3, 8, None, 132, DecodeConfig(few_waves=2.0)) == (11, 32)
    # 2 x 132 <= programs < 4 x 132: 8 splits of >= 256 positions
    assert choose_split(33, 8, None, 132, cfg) == (8, 256)
    assert choose_split(64, 8, None, 132, cfg) == (8, 256)
    assert choose_split(64, 8, 1000, 132, cfg) == (4, 256)  # capped: ceil(1000 / 256)
    # >= 4 x 132 programs: 4 splits of >= 512 positions
    assert choose_split(66, 8, None, 132, cfg) == (4, 512)
    assert choose_split(256, 8, 8192, 132, cfg) == (4, 512)
    assert choose_split(256, 8, 600, 132, cfg) == (2, 512)
    assert choose_split(1024, 8, 100, 132, cfg) == (1, 512)
    # an explicit minimum overrides every regime's; choose_num_splits is the count alone
    forced = DecodeConfig(min_split_tokens=256, max_splits=8)
    assert choose_split(1, 8, 8192, 132, forced) == (8, 256)
    assert choose_split(1, 8, 512, 132, forced) == (2, 256)
    assert choose_num_splits(256, 8, 8192, 132, cfg) == 4


def test_choose_split_balanced_lengths():
    # one range when balanced and 2 x 132 <= programs <= 5 x 132 (without the longest-first
    # one-range policy, which also allows it past one wave)
    cfg = DecodeConfig(use_order=False, lpt_one_range=False)
    # B64 x 8 KV heads = 512 programs: the mid regime's 8 splits, one range when balanced
    assert choose_split(64, 8, 2048, 132, cfg) == (8, 256)
    assert choose_split(64, 8, 2048, 132, cfg, balanced=True)[0] == 1
    assert choose_split(64, 8, None, 132, cfg, balanced=True)[0] == 1  # as a graph: no max
    # the bounds: 264 and 660 programs
    assert choose_split(33, 8, None, 132, cfg, balanced=True)[0] == 1  # 264
    assert choose_split(32, 8, None, 132, cfg, balanced=True) == (5, 32)  # 256: small regime
    assert choose_split(82, 8, None, 132, cfg, balanced=True)[0] == 1  # 656
    assert choose_split(83, 8, None, 132, cfg, balanced=True) == (4, 512)  # 664: past one wave
    assert choose_num_splits(64, 8, None, 132, cfg, True) == 1
    assert [one_range_if_balanced(b, 8, 132, cfg) for b in (0, 32, 33, 82, 83)] == \
        [False, False, True, True, False]
    wide = DecodeConfig(balanced_min_programs_per_sm=0.0, wave_programs_per_sm=1.0)
    assert [one_range_if_balanced(b, 2, 132, wide) for b in (0, 1, 66, 67)] == [False, True, True, False]


def test_longest_first_one_range_policy_by_hand():
    """``lpt_one_range``: one range per request where the positions per program slot of one
    wave (5 x 132 = 660 slots, 8 KV heads) reach 0.75 of the longest length; from 2 x 132
    programs on (33 requests of 8 KV heads)."""
    cfg = DecodeConfig(use_order=True, lpt_one_range=True)
    # 153 requests: 157,408 positions x 8 / 660 = 1,908 per slot against 2,048: 0.93
    lens = [1029] * 152 + [2048]
    assert lpt_fits(lens, 8, 132, cfg)
    assert one_range_for(lens, 153, 8, 132, cfg)
    off = DecodeConfig(use_order=False, lpt_one_range=False)
    assert cfg == DecodeConfig()  # the default
    assert not one_range_for(lens, 153, 8, 132, off)
    assert choose_split(153, 8, None, 132, cfg, balanced=True)[0] == 1
    assert choose_split(153, 8, None, 132, cfg) == (4, 512)
    # the bound: sum x 8 >= 0.75 x 660 x max; 64 requests of 1,000 and one of 2,048:
    # 66,048 x 8 = 528,384 against 0.75 x 660 x 2,048 = 1,013,760: no
    short = [1000] * 64 + [2048]
    assert not lpt_fits(short, 8, 132, cfg) and not one_range_for(short, 65, 8, 132, cfg)
    # exactly at the bound (sum x 8 == 495 x max) it fits, one position less does not
    assert lpt_fits([495, 495, 495, 495, 495, 495, 495, 495], 1, 132, DecodeConfig(
        use_order=True, lpt_one_range=True, lpt_load_fraction=8 / 660))
    assert not lpt_fits([495] * 7 + [494], 1, 132, DecodeConfig(
        use_order=True, lpt_one_range=True, lpt_load_fraction=8 * 495 / (660 * 495) + 1e-9))
    # padding (length 0) left out; nothing: no
    assert lpt_fits(lens + [0] * 20, 8, 132, cfg) and not lpt_fits([0, 0], 8, 132, cfg)
    # where a launch can change: the balanced one-wave sizes, and with the policy >= 264
    # programs (33 requests of 8 KV heads) at any size
    assert [one_range_possible(b, 8, 132, cfg) for b in (32, 33, 82, 83, 256, 1024)] == \
        [False, True, True, True, True, True]
    assert [one_range_possible(b, 8, 132, off) for b in (32, 33, 82, 83)] == \
        [False, True, True, False]
    # balanced lengths still take one range within one wave, with or without the policy
    assert one_range_for([2048] * 64, 64, 8, 132, off)
    assert one_range_for([2048] * 64, 64, 8, 132, cfg)
    with pytest.raises(ConfigError, match="use_order"):
        DecodeConfig(use_order=False, lpt_one_range=True)
    with pytest.raises(ConfigError, match="lpt_load_fraction"):
        DecodeConfig(lpt_load_fraction=0.0)


def test_decode_longest_first_one_range_exact(kernel_device):
    """The policy's launch (one range per request, longest first) through
    ``paged_decode_attention(balanced=True)``: exact against the reference, no partials
    written (the workspace stays empty), prefill rows untouched."""
    reqs = [(9, 1), (0, 3), (63, 1), (20, 1), (33, 1), (4, 2), (47, 1)]
    case = make_case(reqs, block_size=3, num_heads=4, num_kv_heads=2, device=kernel_device,
                     write_new=True, seed=43)
    m = case["meta"]
    cfg = dataclasses.replace(default_decode_config(torch.device(kernel_device)), use_order=True,
                              lpt_one_range=True, balanced_min_programs_per_sm=0.0,
                              lpt_load_fraction=0.001)
    lens = m.seq_lens_cpu[:m.num_reqs].numpy()
    assert one_range_for(lens, m.num_reqs, 2, 132, cfg)
    order = torch.from_numpy(longest_first_order(lens)).to(kernel_device)
    ws = {}
    got = run_decode(case, balanced=True, order=order, config=cfg, workspace=ws)
    check(case, got)
    assert ws == {}


def test_lengths_balanced():
    cfg = DecodeConfig(balanced_max_excess=None)  # mean >= 0.8 x max
    assert lengths_balanced([2048] * 64, cfg, 8, 132)
    assert lengths_balanced([100, 100, 100, 100, 80], cfg, 8, 132)  # mean 96 >= 80
    assert lengths_balanced([100, 60], cfg, 8, 132)  # mean 80 = 0.8 x 100: the bound is inclusive
    assert not lengths_balanced([100, 59], cfg, 8, 132)  # 79.5
    assert not lengths_balanced(list(range(100, 2049)), cfg, 8, 132)  # U[100, 2048]: 0.52
    assert not lengths_balanced([], cfg, 8, 132) and not lengths_balanced([0, 0], cfg, 8, 132)
    assert lengths_balanced(np.array([5, 4], dtype=np.int32), cfg, 8, 132)  # 4.5 >= 4
    assert lengths_balanced([5, 4, 0, 0], cfg, 8, 132)  # padding requests (length 0) left out
    assert not lengths_balanced([100, 60], dataclasses.replace(cfg, balanced_fraction=0.81), 8, 132)


def test_lengths_balanced_excess_bound_by_hand():
    """``balanced_max_excess`` (default 1,024 positions an SM): ``ceil(P / S) x max - Hkv x sum
    / S`` with ``P = requests x Hkv`` programs on ``S`` SMs.

    * 48 requests of 2,048 on 132 SMs, 8 KV heads: 384 programs, 3 on the busiest SM;
      3 x 2,048 - 8 x 98,304 / 132 = 6,144 - 5,957.8 = 186.2 -> balanced.
    * 40 requests of 2,048: 320 programs, 3 on the busiest SM (2.42 on average): 6,144 -
      8 x 81,920 / 132 = 1,179.2 > 1,024 -> not balanced, though the lengths are equal.
    * 64 requests, 32 of 2,048 and 32 of 1,792 (mean 0.94 of the maximum): 512 programs, 4 on
      the busiest; 8,192 - 8 x 122,880 / 132 = 744.7 -> balanced; 32 of 8,192 and 32 of
      7,168 (the same fraction at 4x the length): 32,768 - 8 x 491,520 / 132 = 2,978.9 -> not.
    """
    cfg = DecodeConfig()
    assert cfg.balanced_max_excess == 1024
    assert lengths_balanced([2048] * 48, cfg, 8, 132)
    assert not lengths_balanced([2048] * 40, cfg, 8, 132)
    assert lengths_balanced([2048] * 40, DecodeConfig(balanced_max_excess=None), 8, 132)
    mixed = [2048] * 32 + [1792] * 32
    long = [8192] * 32 + [7168] * 32
    assert lengths_balanced(mixed, cfg, 8, 132) and not lengths_balanced(long, cfg, 8, 132)
    assert lengths_balanced(long, DecodeConfig(balanced_max_excess=None), 8, 132)
    # the bound is inclusive, in integers: 132 x 4 x 8,192 - 8 x 491,520 = 393,216 = 132 x
    # 2,978.9...: 2,979 admits it, 2,978 does not
    assert lengths_balanced(long, DecodeConfig(balanced_max_excess=2979), 8, 132)
    assert not lengths_balanced(long, DecodeConfig(balanced_max_excess=2978), 8, 132)
    # padding requests do not count as programs or lengths; no SMs: never balanced
    assert lengths_balanced(mixed + [0] * 16, cfg, 8, 132)
    assert not lengths_balanced(mixed, cfg, 8, 0)
    # through the launch decision: the longest-first bound is not met for these (491,520 x 8
    # < 0.75 x 660 x 8,192), so the excess decides
    assert not one_range_for(long, 64, 8, 132, cfg)
    assert one_range_for(long, 64, 8, 132, DecodeConfig(balanced_max_excess=None))
    assert one_range_for(mixed, 64, 8, 132, cfg)
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="balanced_max_excess"):
            DecodeConfig(balanced_max_excess=bad)


def test_longest_first_bound_in_one_wave_takes_the_excess_bound_by_hand():
    """``lpt_fits`` where the programs fit one wave (<= 5 x 132 = 660 at 8 KV heads) also needs
    the busiest SM's excess (``busiest_sm_excess_fits``, 1,024 positions an SM):

    * 72 requests, 36 of 8,192 and 36 of 7,680: 576 programs, one wave, 5 on the busiest SM;
      the load bound holds (571,392 x 8 = 4,571,136 >= 0.75 x 660 x 8,192 = 4,055,040) but
      132 x 5 x 8,192 - 4,571,136 = 835,584 > 132 x 1,024 = 135,168: no.
    * 80 requests, 40 of 2,048 and 40 of 1,920: 640 programs, 5 on the busiest; load
      1,269,760 >= 1,013,760 and 1,351,680 - 1,269,760 = 81,920 <= 135,168: yes.
    * Past one wave (1,224 requests of mostly 1,029: 9,792 programs) the excess is not asked.
    """
    cfg = DecodeConfig()
    long = [8192] * 36 + [7680] * 36
    assert not lpt_fits(long, 8, 132, cfg) and not one_range_for(long, 72, 8, 132, cfg)
    assert lpt_fits(long, 8, 132, DecodeConfig(balanced_max_excess=None))
    assert one_range_for(long, 72, 8, 132, DecodeConfig(balanced_max_excess=None))
    short = [2048] * 40 + [1920] * 40
    assert lpt_fits(short, 8, 132, cfg) and one_range_for(short, 80, 8, 132, cfg)
    lens = np.array(short, dtype=np.int64)
    assert busiest_sm_excess_fits(lens, 8, 132, DecodeConfig(balanced_max_excess=621))
    assert not busiest_sm_excess_fits(lens, 8, 132, DecodeConfig(balanced_max_excess=620))
    assert not busiest_sm_excess_fits(lens, 8, 0, cfg)
    many = ([1029] * 152 + [8192]) * 8  # 0.13 of the maximum on average: a huge excess
    assert lpt_fits(many, 8, 132, cfg)  # 10,534,400 >= 4,055,040, several waves


def test_decode_config_errors():
    for bad in (dict(tile_n=24), dict(max_splits=65), dict(mid_splits=0), dict(small_waves=0),
                dict(large_min_split_tokens=0), dict(min_split_tokens=0), dict(num_stages=0),
                dict(balanced_fraction=0.0), dict(balanced_fraction=1.5),
                dict(balanced_min_programs_per_sm=-1.0),
                dict(balanced_min_programs_per_sm=6.0, wave_programs_per_sm=5.0),
                dict(few_waves=0.0), dict(few_max_programs_per_sm=-0.5),
                dict(table_ahead_stages=0)):
        with pytest.raises(ConfigError):
            DecodeConfig(**bad)
    for bad in (1, 3, 12, 128, True, 8.0, None):
        with pytest.raises(ConfigError, match="merge_chunk"):
            DecodeConfig(merge_chunk=bad)
    assert DecodeConfig().merge_chunk == 16 and DecodeConfig(merge_chunk=64).merge_chunk == 64
    for bad in (1, 3, 12, 128, True, 8.0):
        with pytest.raises(ConfigError, match="wide_merge_chunk"):
            DecodeConfig(wide_merge_chunk=bad)
    for bad in (-1.0, True, None, "3"):
        with pytest.raises(ConfigError, match="wide_merge_programs_per_sm"):
            DecodeConfig(wide_merge_programs_per_sm=bad)


def test_merge_chunk_for():
    """The merge's ranges a round trip by hand: a fused per-request launch of at most
    ``wide_merge_programs_per_sm`` (3) programs an SM merges ``wide_merge_chunk`` (32) at once
    (B1 at 8 KV heads x 32 ranges = 256 programs on 132 SMs), a larger one (B2: 512) or a
    reduce launch ``merge_chunk`` (16); without a wide chunk, or on FP8 caches, always
    ``merge_chunk``."""
    cfg = DecodeConfig()
    assert cfg.merge_chunk_for(256, 132, True) == 32
    assert cfg.merge_chunk_for(396, 132, True) == 32 and cfg.merge_chunk_for(397, 132, True) == 16
    assert cfg.merge_chunk_for(512, 132, True) == 16
    assert cfg.merge_chunk_for(256, 132, False) == 16
    assert DecodeConfig(wide_merge_chunk=None).merge_chunk_for(256, 132, True) == 16
    assert DecodeConfig(wide_merge_programs_per_sm=0.0).merge_chunk_for(1, 132, True) == 16
    assert FP8_DECODE_CONFIG.merge_chunk_for(256, 132, True) == FP8_DECODE_CONFIG.merge_chunk == 8


def test_kernel_stages():
    """The decode kernels launch at ``table_ahead_stages`` only with ``table_ahead``."""
    assert DecodeConfig().table_ahead and DecodeConfig().kernel_stages() == 3
    assert DecodeConfig(table_ahead=False).kernel_stages() == DecodeConfig().num_stages == 5
    assert DecodeConfig(table_ahead=True, table_ahead_stages=6,
                        num_stages=4).kernel_stages() == 6
    assert DecodeConfig(table_ahead=False, table_ahead_stages=6,
                        num_stages=4).kernel_stages() == 4
    assert not FP8_DECODE_CONFIG.table_ahead  # not measured on FP8 caches


def test_decode_argument_errors():
    case = make_case([(3, 1)], block_size=2, write_new=True)
    m = case["meta"]
    args = (case["q"], case["cache"], m.block_table_tensor, m.query_start_loc, m.seq_lens, 1,
            case["scale"])
    with pytest.raises(ConfigError, match="num_splits"):
        paged_decode_attention(*args, poisoned_out(case), num_splits=65)
    with pytest.raises(ConfigError, match="q's shape"):
        paged_decode_attention(*args, case["q"][:, :2].clone())
    with pytest.raises(ConfigError, match="multiple"):
        paged_decode_attention(case["q"][:, :3].contiguous(), *args[1:],
                               case["q"][:, :3].contiguous())
    with pytest.raises(ConfigError, match="tile_n"):
        DecodeConfig(tile_n=24)


def test_decode_merge_more_ranges_than_a_chunk(kernel_device):
    """The reduce merges 8 ranges per iteration: 13 used ranges (208 positions = 13 tiles of
    16, 20 splits launched) take two iterations, 8 and 5; exact against the reference."""
    case = make_case([(207, 1), (5, 1), (130, 1)], block_size=4, device=kernel_device,
                     write_new=True, seed=15)
    check(case, run_decode(case, num_splits=20))


@pytest.mark.parametrize("merge_chunk", [2, 4, 16])
def test_decode_merge_chunk(kernel_device, merge_chunk):
    """``DecodeConfig.merge_chunk``: both merges (the reduce launch and the split kernel's own,
    fused) load ``merge_chunk`` ranges a round trip: the 13 used ranges of the 208-position
    request (20 launched) take 7 / 4 / 1 iterations at 2 / 4 / 16, the 9 of the 131-position
    one 5 / 3 / 1. The two merges equal each other bit for bit at every chunk (the same
    order of merging) and the reference."""
    case = make_case([(207, 1), (5, 1), (130, 1)], block_size=4, device=kernel_device,
                     write_new=True, seed=15)
    base = DecodeConfig(tile_n=16, num_warps=1, num_stages=1, min_split_tokens=16,
                        use_order=False, lpt_one_range=False, flat_split=False,
                        merge_chunk=merge_chunk, wide_merge_chunk=None)
    outs = []
    for cfg in (base.unfused(), dataclasses.replace(base, fused_reduce=True)):
        ws: dict = {}
        outs.append(run_decode(case, num_splits=20, config=cfg, workspace=ws))
        assert ("decode_counters" in ws) == cfg.fused_reduce
    assert torch.equal(outs[0].nan_to_num(7.0), outs[1].nan_to_num(7.0))
    check(case, outs[0])
    # the wide chunk of a fused launch of few programs (all 20 ranges in one trip): the
    # reference, and the chunked merges up to float rounding
    wide = run_decode(case, num_splits=20, config=dataclasses.replace(
        base, fused_reduce=True, wide_merge_chunk=32))
    check(case, wide)
    rows = rows_of(case, lambda ql: ql == 1)
    torch.testing.assert_close(wide[rows], outs[0][rows], atol=1e-5, rtol=1e-5)


def test_merge_chunk_reaches_every_merge(kernel_device, monkeypatch):
    """The four decode launches that merge (the per-request split kernel, its reduce, the flat
    kernel, its reduce) are given ``DecodeConfig.merge_chunk`` as their ``SPLIT_CHUNK``, fused
    or not: each launch's keyword arguments recorded on the way to the kernel."""
    from pagedkv.attention import triton_decode

    seen: dict = {}
    for name in ("_decode_kernel", "_decode_reduce_kernel", "_decode_flat_kernel",
                 "_decode_flat_reduce_kernel"):
        kernel = getattr(triton_decode, name)

        def run(*a, _real=kernel.run, _name=name, **kw):
            seen.setdefault(_name, set()).add(kw.get("SPLIT_CHUNK"))
            return _real(*a, **kw)

        monkeypatch.setattr(kernel, "run", run)
    case = make_case([(70, 1), (9, 1)], block_size=4, device=kernel_device, write_new=True,
                     seed=3)
    base = DecodeConfig(tile_n=16, num_warps=1, num_stages=1, min_split_tokens=16,
                        use_order=False, lpt_one_range=False, flat_split=False, merge_chunk=4,
                        wide_merge_chunk=None)
    flat = dataclasses.replace(base, flat_split=True, flat_min_split_tokens=16,
                               flat_min_programs_per_sm=0.0)
    for cfg in (base.unfused(), dataclasses.replace(base, fused_reduce=True), flat.unfused(),
                dataclasses.replace(flat, fused_reduce=True)):
        check(case, run_decode(case, num_splits=None if cfg.flat_split else 5, config=cfg))
    assert seen == {"_decode_kernel": {4}, "_decode_reduce_kernel": {4},
                    "_decode_flat_kernel": {4}, "_decode_flat_reduce_kernel": {4}}, seen
    # the wide chunk: the fused per-request launch of few programs (2 requests x 2 KV heads x
    # 5 ranges), and not its reduce launch when unfused, nor the flat launches
    seen.clear()
    wide = dataclasses.replace(base, wide_merge_chunk=8)
    wide_flat = dataclasses.replace(flat, wide_merge_chunk=8)
    for cfg in (wide.unfused(), dataclasses.replace(wide, fused_reduce=True),
                dataclasses.replace(wide_flat, fused_reduce=True),
                dataclasses.replace(wide, fused_reduce=True, wide_merge_programs_per_sm=0.0)):
        check(case, run_decode(case, num_splits=None if cfg.flat_split else 5, config=cfg))
    assert seen == {"_decode_kernel": {4, 8}, "_decode_reduce_kernel": {4},
                    "_decode_flat_kernel": {4}}, seen


def test_decode_reduce_ignores_stale_partials(kernel_device):
    """The reduce loads a request's partials before it knows which ranges the request used:
    stale values in the ranges it did not use (NaN / inf here, left in the workspace by an
    earlier launch) must not reach the output."""
    case = make_case([(200, 1), (20, 1), (70, 1)], block_size=4, device=kernel_device,
                     write_new=True, seed=23)
    m = case["meta"]
    n, heads, dim = m.num_reqs, case["q"].shape[1], case["q"].shape[2]
    parts = n * heads * 8
    dev = case["q"].device
    ws = {"decode_partials": (torch.full((parts,), float("nan"), device=dev),
                              torch.full((parts,), float("inf"), device=dev),
                              torch.full((parts, 16), float("nan"), device=dev))}
    out = poisoned_out(case)
    paged_decode_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                           m.seq_lens, n, case["scale"], out, num_splits=8, workspace=ws,
                           config=DecodeConfig(tile_n=16, num_warps=1, num_stages=1,
                                               min_split_tokens=32))
    check(case, out)


@pytest.mark.parametrize("reduce_heads", [1, 2, 4, 8])
def test_decode_reduce_heads_per_program(kernel_device, reduce_heads):
    """The reduce merges ``reduce_heads`` query heads a program: 6 heads (3 K/V heads) with 4
    or 8 a program leave heads past the sixth masked in the last program (never stored, no
    NaN reaching the output); forced splits, attention sinks and the log-sum-exp all pass
    through the merge and equal the torch twin; rows of the longer request stay untouched."""
    reqs = [(90, 1), (3, 1), (41, 5), (200, 1)]
    case = make_case(reqs, block_size=4, num_heads=6, num_kv_heads=3, device=kernel_device,
                     write_new=True, seed=31)
    m = case["meta"]
    gen = torch.Generator().manual_seed(5)
    sinks = torch.randn(6, generator=gen).to(kernel_device)
    cfg = DecodeConfig(tile_n=16, num_warps=1, num_stages=1, min_split_tokens=16,
                       reduce_heads=reduce_heads)
    rows = case["q"].shape[0]
    lse = torch.full((rows, 6), float("nan"), device=kernel_device)
    out = poisoned_out(case)
    paged_decode_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                           m.seq_lens, m.num_reqs, case["scale"], out, num_splits=5,
                           config=cfg, sinks=sinks, lse=lse)
    want_lse = torch.full((rows, 6), float("nan"), device=kernel_device)
    want = paged_decode_attention_ref(case["q"], case["cache"], m.block_table_tensor,
                                      m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"],
                                      poisoned_out(case), sinks=sinks, lse=want_lse)
    dec = rows_of(case, lambda ql: ql == 1)
    torch.testing.assert_close(out.cpu()[dec], want.cpu()[dec], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu()[dec], want_lse.cpu()[dec], atol=1e-5, rtol=1e-5)
    assert_rows_untouched(out, rows_of(case, lambda ql: ql != 1))
    assert torch.isnan(lse.cpu()[rows_of(case, lambda ql: ql != 1)]).all()


def test_decode_reduce_heads_config():
    assert DecodeConfig().reduce_heads == 4
    for bad in (0, 3, 6, True, 2.0):
        with pytest.raises(ConfigError, match="reduce_heads"):
            DecodeConfig(reduce_heads=bad)


# ---- the fused reduce: the split kernel's last range merges (DecodeConfig.fused_reduce)


@pytest.mark.parametrize("heads", [(6, 3), (4, 1), (3, 3)])
@pytest.mark.parametrize("num_splits,ordered_launch", [(5, False), (20, True), (3, True)])
def test_decode_fused_reduce_equals_the_reduce_launch(kernel_device, heads, num_splits,
                                                      ordered_launch):
    """With ``fused_reduce`` the split kernel's last range of each (request, KV head) merges
    the ranges itself: bit for bit the split + reduce launches' output and log-sum-exps (the
    same merge), with sinks, GQA groups of 2 / 4 / 1, more ranges than one merge chunk (20),
    the longest-first grid, a prefill row and CUDA-graph padding (``zero_padded_rows``); rows
    of other requests untouched; the counters left at zero, so a second launch on the same workspace
    (its partials now stale) gives the same output."""
    reqs = [(90, 1), (3, 1), (41, 5), (200, 1), (16, 1)]
    case = make_case(reqs, block_size=4, num_heads=heads[0], num_kv_heads=heads[1],
                     device=kernel_device, write_new=True, pad_tokens=2, padded_reqs=1,
                     seed=heads[0] * 10 + num_splits)
    m = case["meta"]
    gen = torch.Generator().manual_seed(num_splits)
    sinks = torch.randn(heads[0], generator=gen).to(kernel_device)
    order = torch.from_numpy(longest_first_order(m.seq_lens_cpu[:m.num_reqs].numpy()))
    rows = case["q"].shape[0]
    results = []
    for fused in (False, True, True):
        cfg = DecodeConfig(tile_n=16, num_warps=1, num_stages=1, min_split_tokens=16,
                           use_order=ordered_launch, lpt_one_range=False, flat_split=False,
                           fused_reduce=fused)
        cfg = cfg if fused else cfg.unfused()
        ws = results[-1][2] if fused and len(results) == 2 else {}
        lse = torch.full((rows, heads[0]), float("nan"), device=kernel_device)
        out = poisoned_out(case)
        paged_decode_attention(case["q"], case["cache"], m.block_table_tensor,
                               m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"], out,
                               num_splits=num_splits, config=cfg, sinks=sinks, lse=lse,
                               workspace=ws, zero_padded_rows=True,
                               order=order.to(kernel_device) if ordered_launch else None)
        assert ("decode_counters" in ws) == fused
        if fused:
            assert int(ws["decode_counters"].abs().sum()) == 0
        results.append((out.cpu(), lse.cpu(), ws))
    (plain, plain_lse, _), (got, got_lse, _), (again, again_lse, _) = results
    for o, l in ((got, got_lse), (again, again_lse)):
        assert torch.equal(o.nan_to_num(7.0), plain.nan_to_num(7.0))
        assert torch.equal(l.nan_to_num(7.0), plain_lse.nan_to_num(7.0))
    want = paged_decode_attention_ref(case["q"], case["cache"], m.block_table_tensor,
                                      m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"],
                                      poisoned_out(case), sinks=sinks)
    dec = rows_of(case, lambda ql: ql == 1)
    torch.testing.assert_close(got[dec], want.cpu()[dec], atol=1e-5, rtol=1e-5)
    assert torch.isnan(got[rows_of(case, lambda ql: ql > 1)]).all()


def test_decode_fused_reduce_defaults():
    """By default only per-request split launches of one wave (<= 5 programs an SM) merge
    their own ranges; FP8 caches' config fuses none; ``unfused`` turns both off."""
    cfg = DecodeConfig()
    assert cfg.fused_reduce is False and cfg.fused_reduce_programs_per_sm == 5.0
    # B1 / B2 / B3 of 8 KV heads x 32 splits on an H200's 132 SMs: 256 / 512 / 768 programs
    assert [cfg.fuses_reduce(n * 8 * 32, 132) for n in (1, 2, 3)] == [True, True, False]
    assert cfg.fuses_reduce(660, 132) and not cfg.fuses_reduce(661, 132)
    assert DecodeConfig(fused_reduce=True).fuses_reduce(10**6, 132)
    assert not FP8_DECODE_CONFIG.fuses_reduce(2, 132)
    assert not cfg.unfused().fuses_reduce(2, 132)
    assert INTERPRET_DECODE_CONFIG.fuses_reduce(256, 132)  # the CPU runs the GPU's default path
    for bad in (-1, -0.5, True, None, float("nan")):
        with pytest.raises(ConfigError):
            DecodeConfig(fused_reduce_programs_per_sm=bad)


@pytest.mark.parametrize("num_reqs", [1, 2, 3])
def test_decode_one_wave_merges_its_own_ranges(kernel_device, num_reqs):
    """A per-request split launch within ``fused_reduce_programs_per_sm`` (here 24 programs
    on the interpreter's 132 SMs: 1 or 2 requests of 2 KV heads x 6 splits, not 3) runs no
    reduce launch (its counters are made, and left at zero) and equals the reduce launch bit
    for bit; past it the reduce launch stays. Rows past the requests' stay untouched."""
    reqs = [(90, 1), (37, 1), (200, 1)][:num_reqs]
    case = make_case(reqs, block_size=4, num_heads=4, num_kv_heads=2, device=kernel_device,
                     write_new=True, pad_tokens=1, seed=num_reqs)
    cfg = dataclasses.replace(INTERPRET_DECODE_CONFIG, flat_split=False,
                              fused_reduce_programs_per_sm=24 / 132)
    outs = []
    for c in (cfg, cfg.unfused()):
        ws: dict = {}
        outs.append(run_decode(case, num_splits=6, config=c, workspace=ws))
        assert ("decode_counters" in ws) == (c is cfg and num_reqs <= 2)
        if "decode_counters" in ws:
            assert int(ws["decode_counters"].abs().sum()) == 0
    assert torch.equal(outs[0].nan_to_num(7.0), outs[1].nan_to_num(7.0))
    check(case, outs[0])


# ---- native GPU


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 1, 3, 48, 256])
def test_decode_gpu_bf16(block_size):
    torch.manual_seed(block_size)
    ctx = [int(x) for x in torch.randint(1, 3000, (37,))] + [8191, 1, 15, 16, 17]
    case = make_case([(c, 1) for c in ctx], block_size=block_size, num_heads=16,
                     num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda",
                     write_new=True, seed=block_size)
    for splits in (None, 1, 8):
        check(case, run_decode(case, num_splits=splits))


@pytest.mark.gpu
@pytest.mark.parametrize("stages,tile", [(3, 32), (5, 32), (7, 32), (4, 64)])
def test_decode_gpu_table_ahead(stages, tile):
    """The block table a tile ahead, compiled (the pipelined loop the interpreter cannot
    show): bf16, 16 / 8 heads of 128, lengths 1-8,191 at pages of 16 and 64 (a 32-position
    tile within one page), split or not; equal to the reference, and bitwise to the plain
    loop at the same tile (the same products in the same order)."""
    torch.manual_seed(stages)
    ctx = [int(x) for x in torch.randint(1, 3000, (21,))] + [8191, 1, 15, 16, 17, 64, 65]
    for bs in (16, 64):
        case = make_case([(c, 1) for c in ctx], block_size=bs, num_heads=16, num_kv_heads=8,
                         head_dim=128, dtype=torch.bfloat16, device="cuda", write_new=True,
                         seed=stages + bs)
        plain = DecodeConfig(tile_n=tile, num_stages=stages, flat_split=False, table_ahead=False)
        ahead = dataclasses.replace(plain, table_ahead=True, table_ahead_stages=stages)
        for splits in (None, 1, 32):
            out = run_decode(case, num_splits=splits, config=ahead)
            check(case, out)
            torch.testing.assert_close(out, run_decode(case, num_splits=splits, config=plain),
                                       atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,dtype", [((8, 8), torch.float16), ((32, 8), torch.bfloat16),
                                         ((8, 2), torch.float32)])
def test_decode_gpu_gqa_dtypes(heads, dtype):
    case = make_case([(c, 1) for c in (1000, 5, 2047, 300)], block_size=16,
                     num_heads=heads[0], num_kv_heads=heads[1], head_dim=128, dtype=dtype,
                     device="cuda", write_new=True, seed=9)
    check(case, run_decode(case))


@pytest.mark.gpu
def test_decode_gpu_cuda_graph_replay():
    """Capture with one set of lengths, replay with others written in place."""
    case = make_case([(4000, 1), (100, 1), (2500, 1)], block_size=16, num_heads=16,
                     num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda",
                     write_new=True, seed=11)
    m = case["meta"]
    out = torch.zeros_like(case["q"])

    def call():
        paged_decode_attention(case["q"], case["cache"], m.block_table_tensor,
                               m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"], out,
                               max_seq_len=8192)

    graph = capture_graph(call)
    for lens in ([3000, 1, 2000], [17, 101, 2501]):
        set_lengths(case, lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(case, out)


@pytest.mark.gpu
def test_decode_gpu_longest_first_order():
    """bf16, 16 / 8 heads, 150 mixed lengths: the ordered launch (default splits and 8) is
    bit-for-bit the unordered one, and close to the reference."""
    torch.manual_seed(3)
    ctx = [int(x) for x in torch.randint(1, 2500, (150,))]
    case = make_case([(c, 1) for c in ctx], block_size=16, num_heads=16, num_kv_heads=8,
                     head_dim=128, dtype=torch.bfloat16, device="cuda", write_new=True, seed=3)
    m = case["meta"]
    order = torch.from_numpy(longest_first_order(m.seq_lens_cpu[:m.num_reqs].numpy())).cuda()
    for splits in (None, 8):
        a = run_decode(case, num_splits=splits, order=order, config=ordered("cuda"))
        check(case, a)
        assert torch.equal(a, run_decode(case, num_splits=splits))


@pytest.mark.gpu
def test_decode_gpu_split_merge_repeatable():
    """Split + merge under real concurrency (64 mixed-length requests, 8 and 20 ranges): 100
    launches on one workspace, bitwise equal to the first and close to the reference."""
    torch.manual_seed(21)
    ctx = [int(x) for x in torch.randint(1, 4000, (64,))]
    case = make_case([(c, 1) for c in ctx], block_size=16, num_heads=16, num_kv_heads=8,
                     head_dim=128, dtype=torch.bfloat16, device="cuda", write_new=True, seed=21)
    m = case["meta"]
    for splits in (8, 20):
        ws: dict = {}
        outs = []
        for _ in range(100):
            out = poisoned_out(case)
            paged_decode_attention(case["q"], case["cache"], m.block_table_tensor,
                                   m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"], out,
                                   num_splits=splits, workspace=ws)
            outs.append(out)
        torch.cuda.synchronize()
        check(case, outs[0])
        for o in outs[1:]:
            assert torch.equal(o, outs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("merge_chunk", [16, 32])
def test_decode_gpu_merge_chunk(merge_chunk):
    """``DecodeConfig.merge_chunk`` 16 / 32 under real concurrency (bf16, 16 / 8 heads), the
    default launches otherwise: B1/L8192 and B2/L4096 (32 ranges, merged by the split
    kernel), 64 mixed lengths (the flat split and its reduce), and forced 20 ranges through
    the reduce launch: the reference, and close to the default chunk of 8; 20 launches equal
    the first bit for bit."""
    cfg = dataclasses.replace(DecodeConfig(), merge_chunk=merge_chunk, wide_merge_chunk=None)
    torch.manual_seed(7)
    for ctx in ([8192], [4096, 4096], [int(x) for x in torch.randint(1, 4000, (64,))]):
        case = make_case([(c, 1) for c in ctx], block_size=16, num_heads=16, num_kv_heads=8,
                         head_dim=128, dtype=torch.bfloat16, device="cuda", write_new=True,
                         seed=len(ctx))
        for splits, c in ((None, cfg), (20, cfg.unfused())):
            ws: dict = {}
            got = run_decode(case, num_splits=splits, config=c, workspace=ws)
            check(case, got)
            base = run_decode(case, num_splits=splits,
                              config=dataclasses.replace(c, merge_chunk=8))
            torch.testing.assert_close(got, base, atol=2e-3, rtol=2e-3)
            for _ in range(20):
                assert torch.equal(run_decode(case, num_splits=splits, config=c, workspace=ws),
                                   got)


@pytest.mark.gpu
def test_decode_gpu_fused_reduce():
    """The fused reduce under real concurrency (bf16, 16 / 8 heads): B1/L8192 and 64 mixed
    lengths, default and forced splits (8, 20): close to the split + reduce launches and to
    the reference, 50 launches on one workspace equal to the first bit for bit (the counters
    reset every launch), then CUDA-graph replays with new lengths."""
    fused = dataclasses.replace(DecodeConfig(), fused_reduce=True, flat_split=False)
    torch.manual_seed(5)
    for ctx in ([8192], [int(x) for x in torch.randint(1, 4000, (64,))]):
        case = make_case([(c, 1) for c in ctx], block_size=16, num_heads=16, num_kv_heads=8,
                         head_dim=128, dtype=torch.bfloat16, device="cuda", write_new=True,
                         seed=len(ctx))
        for splits in (None, 8, 20):
            ws: dict = {}
            first = run_decode(case, num_splits=splits, config=fused, workspace=ws)
            check(case, first)
            plain = run_decode(case, num_splits=splits,
                               config=fused.unfused())
            torch.testing.assert_close(first, plain, atol=2e-3, rtol=2e-3)
            for _ in range(50):
                assert torch.equal(run_decode(case, num_splits=splits, config=fused,
                                              workspace=ws), first)
            if splits is None or splits > 1:
                assert int(ws["decode_counters"].abs().sum()) == 0
    m = case["meta"]
    out = torch.zeros_like(case["q"])

    def call():
        paged_decode_attention(case["q"], case["cache"], m.block_table_tensor,
                               m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"], out,
                               num_splits=8, config=fused)

    graph = capture_graph(call)
    held = [int(x) for x in m.seq_lens_cpu[:m.num_reqs]]  # what each request's blocks hold
    for lens in ([int(torch.randint(1, h + 1, ())) for h in held], [min(held)] * len(held), held):
        set_lengths(case, lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(case, out)
