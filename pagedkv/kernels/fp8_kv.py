"""FP8 KV cache: the quantization rule every KV writer stores by, and its torch twin.

vLLM's per-tensor scheme (``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"``): a cache of
``torch.float8_e4m3fn`` holds ``q = e4m3(x / scale)`` for each K (V) value ``x``, with one
float ``scale`` per layer for K (``k_scale``) and one for V (``v_scale``); a reader
dequantizes ``q * scale``. vLLM sets both scales to 1.0 when the checkpoint carries none (and
``calculate_kv_scales`` is off, its default): that is what pagedkv's models pass.

Rounding: ``x / scale`` in float32 (IEEE division), rounded to the nearest e4m3fn value, ties
to even, saturating at +-448 (the largest finite e4m3fn; the format has no infinity): what
NVIDIA's ``cvt.rn.satfinite.e4m3x2.f32`` does, and what ``quantize_fp8_ref`` (an explicit
clamp, then torch's round-to-nearest-even cast) computes. ``fp8_e4m3_round`` rounds in float32
arithmetic first, so the final cast receives a value on the e4m3 grid and is exact, whoever
performs it: the Triton interpreter's own fp8 cast neither rounds to even, nor carries a
rounded-up mantissa into the exponent, nor saturates (it turns 500 into 256 and 464 into NaN),
and with the rounding done first it stores the hardware's bits as well (tests compare bits).

Dequantization in the attention kernels: an e4m3 value is exact in bf16, fp16 and fp32, so a
kernel casts the loaded codes to the query dtype without rounding and applies the scales to
the scores (``k_scale`` joins the softmax scale) and to the output (``v_scale``), which is the
same as multiplying every K / V element by its scale, up to float32 rounding.
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from pagedkv.errors import ConfigError

FP8_KV_DTYPES = (torch.float8_e4m3fn,)
FP8_E4M3_MAX = 448.0


def is_fp8_kv(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a quantized (FP8) KV-cache dtype."""
    return dtype in FP8_KV_DTYPES


def check_kv_scale(fn: str, name: str, value) -> float:
    """A K / V scale: a finite host number > 0 (a Python or numpy float, never a tensor: the
    launchers read no device value)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{fn}: {name} must be a finite host number > 0 (the per-tensor FP8 "
                          f"scale; 1.0 without calibration), got {value!r}")
    return float(value)


def quantize_fp8_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Plain torch twin of the writers' FP8 store: ``e4m3(x / scale)``, saturating at +-448."""
    y = x.to(torch.float32) / scale
    return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def dequantize_ref(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """A cache slice in float32 as the attention twins read it: ``q * scale`` for an FP8 cache,
    the values themselves otherwise (the scale applies to FP8 caches only, as in vLLM)."""
    out = cache.to(torch.float32)
    return out * scale if is_fp8_kv(cache.dtype) and scale != 1.0 else out


def store_value(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What a writer stores for ``x`` in a cache of ``dtype``: quantized for FP8 (``scale``),
    else ``x`` cast to ``dtype`` (the scale is not used)."""
    if is_fp8_kv(dtype):
        return quantize_fp8_ref(x, scale, dtype)
    return x.to(dtype)


@triton.jit
def fp8_e4m3_round(x):
    """float32 ``x`` rounded to the e4m3fn grid (nearest, ties to even, saturating at +-448),
    still float32 and sign preserving (-0 stays -0): the final cast to e4m3 is then exact. The
    grid step of ``|x|`` is ``2^(e - 3)`` for its exponent ``e >= -6`` and ``2^-9`` below (the
    subnormals); ``x / step`` (exact, a power of two) rounds to an integer through the
    float32 addition of ``1.5 * 2^23``."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) & 0xFF, 121)  # biased exponent, at least that of 2^-6
    inv_step = ((257 - e) << 23).to(tl.float32, bitcast=True)  # 2^-(e - 127 - 3)
    step = ((e - 3) << 23).to(tl.float32, bitcast=True)
    r = ((x * inv_step + 12582912.0) - 12582912.0) * step
    r_bits = r.to(tl.int32, bitcast=True) | (bits & -2147483648)
    return r_bits.to(tl.float32, bitcast=True)


@triton.jit
def fp8_quantize(x, scale):
    """A tile's store values for an FP8 cache: ``x / scale`` (IEEE float32 division) on the
    e4m3 grid (:func:`fp8_e4m3_round`)."""
    return fp8_e4m3_round(tl.math.div_rn(x.to(tl.float32), scale))


__all__ = ["FP8_E4M3_MAX", "FP8_KV_DTYPES", "check_kv_scale", "dequantize_ref",
           "fp8_e4m3_round", "fp8_quantize", "is_fp8_kv", "quantize_fp8_ref", "store_value"]
