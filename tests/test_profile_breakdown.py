"""``pagedkv.tools.profile_breakdown``: kernel names as the H200 profiles show them sorted into
classes by hand, and a window's per-step breakdown computed by hand."""

import types

import pytest

from pagedkv.tools.profile_breakdown import (
    CLASSES,
    breakdown,
    decode_step_fit,
    format_breakdown,
    kernel_class,
)


@pytest.mark.parametrize("name, cls", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", "gemm"),
    ("_paged_decode_kernel", "attention"),
    ("_decode_reduce_kernel", "attention"),
    ("_paged_prefill_kernel", "attention"),
    ("_mla_decode_kernel", "attention"),
    ("_merge_kernel", "attention"),
    ("_qk_norm_rope_cache_kernel", "norm_rope"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm_rope"),
    ("triton_poi_fused_add_mul_0", "elementwise"),
    ("_rms_norm_kernel", "norm_rope"),
    ("_silu_and_mul_kernel", "activation"),
    ("_fused_moe_kernel", "moe"),
    ("_slot_mapping_kernel", "index"),
    ("void at::native::(anonymous namespace)::argmax_kernel", "sampling"),
    ("Memcpy HtoD (Pinned -> Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
     "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>",
     "elementwise"),
    ("some_new_kernel", "other"),
])
def test_kernel_classes_by_hand(name, cls):
    assert kernel_class(name) == cls


def test_breakdown_per_step_by_hand():
    ev = [("nvjet_gemm", 600.0), ("_paged_decode_kernel", 300.0), ("_rms_norm_kernel", 60.0),
          ("argmax_kernel", 40.0), ("aten::linear", 0.0),  # a CPU op: no device time
          types.SimpleNamespace(key="Memcpy DtoH", self_device_time_total=0.0)]
    b = breakdown(ev, wall_s=0.0015, steps=2)  # 1,000 us busy over 1,500 us of wall
    assert b["us_per_step"]["gemm"] == 300.0 and b["us_per_step"]["attention"] == 150.0
    assert b["busy_us_per_step"] == 500.0 and b["wall_us_per_step"] == 750.0
    assert b["idle_us_per_step"] == 250.0
    assert b["fraction_of_busy"]["gemm"] == 0.6 and sum(b["fraction_of_busy"].values()) == 1.0
    assert set(b["us_per_step"]) == set(CLASSES)
    text = format_breakdown("window 4:6", b)
    assert "gemm" in text and "60.0%" in text and "copy" not in text


def test_breakdown_leaves_out_host_entries_with_device_time():
    """As the H200 profiles show them: ``aten::mm`` carries its cuBLAS kernel's time as self
    device time and ``cuLaunchKernelEx`` a launch's; the kernels are listed on their own."""
    from pagedkv.tools.profile_breakdown import is_host_entry

    ev = [("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", 900.0), ("aten::mm", 900.0),
          ("cuLaunchKernelEx", 25.0), ("cudaEventSynchronize", 5.0), ("_prefill_kernel", 100.0),
          ("Torch-Compiled Region: 3/0", 1000.0), ("Memcpy HtoD (Pinned -> Device)", 10.0)]
    b = breakdown(ev, wall_s=0.002, steps=1)
    assert b["busy_us_per_step"] == 1010.0 and b["us_per_step"]["other"] == 0.0
    assert b["us_per_step"]["copy"] == 10.0
    assert not is_host_entry("cutlass_80_tensorop_gemm") and not is_host_entry("_decode_kernel")


def test_breakdown_counts_a_triton_launch_once():
    """A Triton kernel launched from a compiled region: the host launch record
    (``_silu_and_mul_kernel``, ``triton_per_fused_...``, device type CPU) carries the kernel's
    time as self device time; the kernel (``..._0``, device type CUDA) is its own entry. Only
    the device entries count (the H200 W1 profile of the fourteenth session counted both)."""
    from pagedkv.tools.profile_breakdown import is_device_event

    def ev(key, us, dev):
        return types.SimpleNamespace(key=key, self_device_time_total=us,
                                     device_type=f"DeviceType.{dev}")

    evs = [ev("_silu_and_mul_kernel", 40.0, "CPU"), ev("_silu_and_mul_kernel_0", 40.0, "CUDA"),
           ev("triton_per_fused_add_rsqrt_1", 30.0, "CPU"),
           ev("triton_per_fused_add_rsqrt_1", 30.0, "CUDA"), ev("aten::mm", 100.0, "CPU"),
           ev("nvjet_gemm", 100.0, "CUDA")]
    b = breakdown(evs, wall_s=0.0002, steps=1)
    assert b["us_per_step"]["activation"] == 40.0 and b["us_per_step"]["norm_rope"] == 30.0
    assert b["us_per_step"]["gemm"] == 100.0 and b["busy_us_per_step"] == 170.0
    assert is_device_event(("_decode_kernel", 1.0)) and not is_device_event(("aten::mm", 1.0))
    # a real (CPU) profile: torch's ops are host entries
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4) @ torch.ones(4)
    assert prof.key_averages() and not any(is_device_event(e) for e in prof.key_averages())


def test_device_gaps_by_hand():
    from pagedkv.tools.profile_breakdown import device_gaps, format_gaps

    def ev(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        ev("b", 10.0, 5.0),          # gap 10 - 1 = 9 us after "a" (5-20)
        ev("a", 0.0, 1.0),
        ev("c", 16.0, 2.0),          # gap 1 us (<2)
        ev("d", 17.0, 10.0),         # overlaps c: no gap
        ev("cpu_op", 50.0, 100.0, cat="cpu_op"),  # not a device event
        ev("Memcpy HtoD", 30.0, 1.0, cat="gpu_memcpy"),  # gap 30 - 27 = 3 us (2-5)
        ev("e", 231.0, 1.0),         # gap 200 us (>=100)
    ]}
    g = device_gaps(trace, steps=2, top=2)
    assert g["events_per_step"] == 3.0
    assert g["idle_us_per_step"] == {"<2": 0.5, "2-5": 1.5, "5-20": 4.5, "20-100": 0.0,
                                     ">=100": 100.0}
    assert g["gaps_per_step"] == {"<2": 0.5, "2-5": 0.5, "5-20": 0.5, "20-100": 0.0, ">=100": 0.5}
    assert g["top"] == [{"us": 200.0, "after": "Memcpy HtoD", "before": "e"},
                        {"us": 9.0, "after": "a", "before": "b"}]
    text = format_gaps("w", g)
    assert "200.0 us after 'Memcpy HtoD' before 'e'" in text and ">=100 us: 100" in text


def test_decode_step_fit_by_hand():
    """Steps on the line 1 ms + 25 ns a token (and one step without a time, left out): the fit
    gives them back; 114,688 bytes a token over 25 ns is 4.58752 TB/s; the run's 2.9 ms split
    into 2 ms fixed (2 steps) and 0.9 ms for the 36,000 tokens."""
    steps = [{"ctx": 16_000, "dt": 1e-3 + 16_000 * 25e-9},
             {"ctx": 20_000, "dt": 1e-3 + 20_000 * 25e-9},
             {"ctx": 99, "dt": None}]
    fit = decode_step_fit(steps, 114_688)
    assert fit["steps"] == 2
    assert fit["fixed_ms"] == pytest.approx(1.0)
    assert fit["ns_per_token"] == pytest.approx(25.0)
    assert fit["tb_per_s"] == pytest.approx(4.58752)
    assert fit["fixed_s_total"] == pytest.approx(2e-3)
    assert fit["per_token_s_total"] == pytest.approx(0.9e-3)
    assert fit["decode_s"] == pytest.approx(2.9e-3)
    assert "tb_per_s" not in decode_step_fit(steps)


def test_decode_step_fit_least_squares_and_errors():
    """Three points off a line: the least-squares slope and intercept worked by hand
    (x 0, 1, 2; y 1, 3, 4: slope 1.5, intercept 7/6); one point, or one context size, raise."""
    fit = decode_step_fit([{"ctx": 0, "dt": 1.0}, {"ctx": 1, "dt": 3.0}, {"ctx": 2, "dt": 4.0}])
    assert fit["ns_per_token"] == pytest.approx(1.5e9)
    assert fit["fixed_ms"] == pytest.approx(1e3 * 7 / 6)
    with pytest.raises(ValueError):
        decode_step_fit([{"ctx": 5, "dt": 1.0}])
    with pytest.raises(ValueError):
        decode_step_fit([{"ctx": 5, "dt": 1.0}, {"ctx": 5, "dt": 2.0}])
