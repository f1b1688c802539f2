"""Rotary position embeddings (RoPE) for the Llama / Qwen2 / Qwen3 / Mistral families.

Scaling variants: default, linear, dynamic (NTK), llama3, yarn. The inverse frequencies are
computed in float32 with the same formulas (and the same float32/float64 split) as transformers
5.x, so cos/sin match it bit for bit on CPU; the rotation uses the "halves" convention (the
first half of the head dimension rotates against the second half).

Dynamic NTK scaling depends on the sequence length: transformers recomputes the frequencies from
``max(position_ids) + 1`` of each forward once it exceeds ``max_position_embeddings``. Here the
length is per request (``seq_lens`` of the request each token belongs to), which equals
transformers' value for a request whose whole prompt (or one decode token) is in the step. With
chunked prefill the chunks of a long prompt see their own lengths (transformers has no chunks).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.models.config import ROPE_TYPES, RopeConfig


def _exponents(dim: int, device=None) -> torch.Tensor:
    """``[0, 2, 4, ..., dim-2] / dim`` in float32."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim


def _default_inv_freq(base: float, dim: int, device=None) -> torch.Tensor:
    return 1.0 / (base ** _exponents(dim, device))


def _llama3_inv_freq(rope: RopeConfig, dim: int, device=None) -> torch.Tensor:
    inv = _default_inv_freq(rope.rope_theta, dim, device)
    ctx = rope.original_max_position_embeddings
    low, high, factor = rope.low_freq_factor, rope.high_freq_factor, rope.factor
    long_wave = ctx / low  # wavelengths above this are divided by `factor`
    short_wave = ctx / high  # wavelengths below this are kept
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > long_wave, inv / factor, inv)
    # in between: blend the kept and the divided frequency
    smooth = (ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    middle = ~(wavelen < short_wave) & ~(wavelen > long_wave)
    return torch.where(middle, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig, dim: int, device=None) -> tuple[torch.Tensor, float]:
    base, factor = rope.rope_theta, rope.factor
    orig = rope.original_max_position_embeddings
    if rope.attention_factor is not None:
        attn = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attn = float(_yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim))
    else:
        attn = _yarn_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def dim_for_rotations(rotations: float) -> float:
        # the dimension whose wavelength makes `rotations` turns over `orig` positions
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if rope.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    keep = (1 - ramp).to(device=device, dtype=torch.float32)  # weight of the unscaled frequency

    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float32) / dim)
    unscaled = 1.0 / pos_freqs
    scaled = 1.0 / (factor * pos_freqs)
    return scaled * (1 - keep) + unscaled * keep, attn


def compute_inv_freq(
    rope: RopeConfig, head_dim: int, max_position_embeddings: int, device=None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32 ``[head_dim // 2]``) and the cos/sin scale for lengths up
    to ``max_position_embeddings`` (for dynamic: the unscaled frequencies)."""
    dim = head_dim
    t = rope.rope_type
    if t == "default":
        return _default_inv_freq(rope.rope_theta, dim, device), 1.0
    if t == "linear":
        return _default_inv_freq(rope.rope_theta, dim, device) / rope.factor, 1.0
    if t == "dynamic":
        f = rope.factor
        base = rope.rope_theta * ((f * max_position_embeddings / max_position_embeddings) - (f - 1)) ** (
            dim / (dim - 2)
        )
        return _default_inv_freq(base, dim, device), 1.0
    if t == "llama3":
        return _llama3_inv_freq(rope, dim, device), 1.0
    if t == "yarn":
        return _yarn_inv_freq(rope, dim, device)
    raise ConfigError(f"rope type {t!r} is not supported; supported rope types: {', '.join(ROPE_TYPES)}")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by per-token angles (``cos``/``sin``: ``[T, head_dim//2]``).

    Partial rotary (Qwen3-Next's ``partial_rotary_factor``): with ``cos``/``sin`` of
    ``[T, rotary_dim // 2]``, ``rotary_dim < head_dim``, only the first ``rotary_dim``
    dimensions rotate (halves of that part, as transformers); the rest pass unchanged."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    c = cos.to(x.dtype).unsqueeze(-2)
    s = sin.to(x.dtype).unsqueeze(-2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def apply_rotary_interleaved_tail(x: torch.Tensor, cos: torch.Tensor,
                                  sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's RoPE: rotate the last ``2 * cos.shape[-1]`` dimensions of ``x [T, ...,
    D]`` in interleaved pairs (``(x[2i], x[2i + 1])`` by the angle of ``cos[:, i]`` /
    ``sin[:, i]``, ``[T, R / 2]``), the results staying interleaved; the leading dimensions
    pass unchanged. As transformers: ``cos`` / ``sin`` rounded to ``x``'s dtype, the rotation
    in float32, rounded once. ``-sin`` rotates back (the attention output of V4)."""
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c = cos.to(x.dtype).to(torch.float32).reshape(shape)
    s = sin.to(x.dtype).to(torch.float32).reshape(shape)
    rope = x[..., x.shape[-1] - r:].to(torch.float32)
    x0, x1 = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
    return torch.cat((x[..., : x.shape[-1] - r], rotated.to(x.dtype)), dim=-1)


def tokens_seq_lens(metadata, num_tokens: int) -> torch.Tensor:
    """``seq_lens`` of the request each of the ``num_tokens`` packed tokens belongs to (int64,
    on the metadata's device; padding tokens get the last request's length)."""
    n = int(metadata.num_reqs)
    if n == 0:
        return torch.zeros(num_tokens, dtype=torch.int64, device=metadata.seq_lens.device)
    qsl = metadata.query_start_loc[1 : n + 1].to(torch.int64)
    tok = torch.arange(num_tokens, device=qsl.device, dtype=torch.int64)
    req = torch.searchsorted(qsl, tok, right=True).clamp_(max=n - 1)
    return metadata.seq_lens[:n].to(torch.int64)[req]


class RotaryEmbedding(nn.Module):
    """cos/sin for packed tokens; ``apply_rotary`` rotates q and k with them."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_position_embeddings: int, device=None):
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.max_position_embeddings = max_position_embeddings
        self.is_dynamic = rope.rope_type == "dynamic"
        inv_freq, scale = compute_inv_freq(rope, head_dim, max_position_embeddings, device=device)
        self.attention_scaling = float(scale)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("exponents", _exponents(head_dim, device), persistent=False)

    def _dynamic_inv_freq(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Per-token inverse frequencies ``[T, head_dim//2]`` from per-token sequence lengths."""
        m, f, d = self.max_position_embeddings, self.rope.factor, self.head_dim
        length = torch.clamp(seq_lens.to(torch.int64), min=m)
        base = self.rope.rope_theta * ((f * length / m) - (f - 1)) ** (d / (d - 2))
        grown = 1.0 / (base.to(torch.float32).unsqueeze(-1) ** self.exponents)
        return torch.where((seq_lens > m).unsqueeze(-1), grown, self.inv_freq)

    def forward(
        self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` (float32 ``[T, head_dim//2]``) for int positions ``[T]``. ``seq_lens``
        (per token) is needed by dynamic scaling only."""
        if self.is_dynamic:
            if seq_lens is None:
                raise ConfigError(
                    "dynamic rope scaling needs per-token seq_lens (pass tokens_seq_lens(metadata, T))"
                )
            freqs = positions.to(torch.float32).unsqueeze(-1) * self._dynamic_inv_freq(seq_lens)
        else:
            freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos, sin


__all__ = ["RotaryEmbedding", "apply_rotary", "apply_rotary_interleaved_tail", "compute_inv_freq",
           "tokens_seq_lens"]
