"""The LM head and the greedy argmax in one pass: ``argmax(hidden @ weight^T, dim=-1)`` without
writing the logits.

``hidden [M, K]`` (the rows to sample), ``weight [V, K]`` (the LM head or tied embedding) ->
``int64 [M]``: per row the index of its largest logit, where a logit is the float32 product
rounded to the inputs' dtype (as the unfused path's GEMM writes it), compared as
:mod:`pagedkv.kernels.argmax` compares: the first index among equal maxima, NaN above every
number (the first NaN wins), ``-0.0`` equal to ``+0.0``.

Why: in a greedy decode step the LM head GEMM writes ``M x V`` logits (at the Qwen3 shape,
151,936 a row: 78 MB at 256 rows) and the argmax reads them back: on the H200 the two took
90.5 + 35.4 us at 128 rows and 123.7 + 63.0 at 256 (``bench/bench_decode_gemm_gpu.py``,
fourteenth session), against 72.9 us for the weight's bytes. Here the logits never leave the
registers.

Kernel 1 (``_lm_head_argmax_kernel``), grid ``(cdiv(M, BLOCK_M), C)``: program ``(i, c)``
computes row tile ``i`` of the logits over chunk ``c`` of the vocabulary, ``tiles`` tiles of
``BLOCK_N`` columns one after the other (each a float32 ``tl.dot`` over ``K`` in ``BLOCK_K``
steps; compiled, one flat loop over tiles x steps, so the pipeline does not drain between
tiles), rounds each tile to the dtype, turns it into the order-preserving int32 keys of
``argmax._keys`` and keeps per row the best key and its first column; it writes one
``(key, index)`` partial per row and chunk. The row tiles of one chunk are grid neighbours: they
share the chunk's weight bytes through the L2. Kernel 2 is the argmax's own reduce
(``argmax._argmax_reduce_kernel``): per row the best key over its ``C`` partials and the
smallest index holding it (chunks are in index order).

Rows past ``M`` and columns past ``V`` are never read (masked). ``M``, ``V`` and the chunking
are runtime arguments (one compiled variant per launch config and dtype). No host syncs.
``lm_head_argmax_ref`` is the torch twin: the float32 product, rounded, then ``torch.argmax``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import cdiv, check_launch_config, next_pow2, use_triton
from pagedkv.kernels.argmax import _INT32_MIN, _argmax_reduce_kernel, _keys

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_CHUNKS = 1024  # the reduce loads a row's partials at once


@dataclass(frozen=True)
class LMHeadArgmaxConfig:
    """Launch parameters: tile sizes (powers of two >= 16), warps, pipeline stages, and
    ``programs_per_sm``: the vocabulary is cut into chunks so that the launch has about this
    many programs (row tiles x chunks) a multiprocessor."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: float = 2.0

    def __post_init__(self):
        check_launch_config(self, ("block_m", "block_n", "block_k"))
        if not self.programs_per_sm > 0:
            raise ConfigError("LMHeadArgmaxConfig: programs_per_sm must be positive")


INTERPRET_CONFIG = LMHeadArgmaxConfig(block_m=16, block_n=32, block_k=16, num_warps=1,
                                      num_stages=1, programs_per_sm=2.0)

# Launch configs by row count: the entry of the smallest key >= M (the largest key above it).
# The H200 sweep's best (``bench/bench_lm_head_argmax_gpu.py --sweep``, seventeenth session,
# 151,936 x 1,024 bf16, us, fused / unfused): M 1 77.9 / 78.3, 8 78.3 / 83.5, 16 78.7 / 85.1
# (16 x 128 x 64, 4 warps, 4 stages); 32 80.0 / 89.4, 64 80.9 / 96.8 (64 x 128 x 64): 91-93% of
# the weight bytes' time. Past 64 rows the product is compute-bound and loses to cuBLAS
# (128 x 256 x 64, 8 warps: 96 107.2 / 105.6, 128 110.4 / 110.8, 160 170.1 / 119.7, 256 180.6 /
# 170.3), so the engine stops at ``FUSED_MAX_ROWS``.
CONFIGS: dict[int, LMHeadArgmaxConfig] = {
    16: LMHeadArgmaxConfig(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=4),
    64: LMHeadArgmaxConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
    256: LMHeadArgmaxConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3,
                            programs_per_sm=1.0),
}


def config_for(rows: int) -> LMHeadArgmaxConfig:
    """The launch config for ``rows`` rows (``CONFIGS``' entry of the smallest key >= rows)."""
    keys = sorted(CONFIGS)
    for k in keys:
        if rows <= k:
            return CONFIGS[k]
    return CONFIGS[keys[-1]]


@triton.jit
def _fold_tile(acc, rn, n_ok, best, best_idx, ROUND: tl.constexpr):
    """A ``[BLOCK_M, BLOCK_N]`` tile of float32 logits, rounded to the dtype (``ROUND``: 0
    float32, 1 bf16, 2 fp16), folded into the rows' running best key and first column."""
    x = acc
    if ROUND == 1:
        x = x.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    key = tl.where(n_ok[None, :], _keys(x), _INT32_MIN)
    m = tl.max(key, axis=1)
    first = tl.min(tl.where(key == m[:, None], rn[None, :], 2147483647), axis=1)
    take = m > best  # strictly larger: an earlier tile keeps its tie
    return tl.where(take, m, best), tl.where(take, first, best_idx)


@triton.jit
def _load_step(h_rows, m_ok, w_ptr, w_s0, rn, n_ok, kk, K, EVEN_K: tl.constexpr):
    """One ``BLOCK_K`` step's hidden and weight tiles (rows past ``M`` / ``V`` and, unless
    ``EVEN_K``, columns past ``K`` masked: never read)."""
    if EVEN_K:
        a = tl.load(h_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
        b = tl.load(w_ptr + rn.to(tl.int64)[:, None] * w_s0 + kk[None, :], mask=n_ok[:, None],
                    other=0.0)
    else:
        k_ok = kk < K
        a = tl.load(h_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + rn.to(tl.int64)[:, None] * w_s0 + kk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    return a, b


@triton.jit(do_not_specialize=["M", "N", "tiles", "p_s0"])
def _lm_head_argmax_kernel(h_ptr, h_s0, w_ptr, w_s0, M, N, K, tiles, key_ptr, idx_ptr, p_s0,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           EVEN_K: tl.constexpr, ROUND: tl.constexpr, DOT_PREC: tl.constexpr,
                           RANGE_LOOP: tl.constexpr):
    pid_m = tl.program_id(0)
    c = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + rm.to(tl.int64)[:, None] * h_s0
    best = tl.full([BLOCK_M], _INT32_MIN, tl.int32)
    best_idx = tl.zeros([BLOCK_M], tl.int32)
    n_first = c * tiles * BLOCK_N
    k_steps = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if RANGE_LOOP:
        # one flat loop over (column tile, K step): the software pipeline then runs across the
        # column tiles (the next tile's first weights load while this one's last product and
        # its argmax run) instead of draining at the end of every tile
        for it in range(tiles * k_steps):
            t = it // k_steps
            kt = it - t * k_steps
            rn = n_first + t * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = rn < N
            a, b = _load_step(h_rows, m_ok, w_ptr, w_s0, rn, n_ok, kt * BLOCK_K + rk, K, EVEN_K)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
            if kt == k_steps - 1:
                best, best_idx = _fold_tile(acc, rn, n_ok, best, best_idx, ROUND)
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:  # the interpreter cannot iterate range() over runtime scalars
        t = 0
        while t < tiles:
            rn = n_first + t * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = rn < N
            kt = 0
            while kt < k_steps:
                a, b = _load_step(h_rows, m_ok, w_ptr, w_s0, rn, n_ok, kt * BLOCK_K + rk, K,
                                  EVEN_K)
                acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
                kt += 1
            best, best_idx = _fold_tile(acc, rn, n_ok, best, best_idx, ROUND)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            t += 1
    tl.store(key_ptr + rm * p_s0 + c, best, mask=m_ok)
    tl.store(idx_ptr + rm * p_s0 + c, best_idx, mask=m_ok)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(
        index if index is not None else torch.cuda.current_device()).multi_processor_count


def _check(fn: str, hidden: torch.Tensor, weight: torch.Tensor) -> None:
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise ConfigError(f"{fn}: hidden and weight must be tensors")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ConfigError(f"{fn}: need hidden [M, K] and weight [V, K], got "
                          f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.dtype not in DTYPES or weight.dtype != hidden.dtype:
        raise ConfigError(f"{fn}: hidden and weight must share one of bf16/fp16/fp32, got "
                          f"{hidden.dtype} and {weight.dtype}")
    if hidden.device != weight.device:
        raise ConfigError(f"{fn}: hidden on {hidden.device}, weight on {weight.device}")
    if (hidden.shape[1] > 1 and hidden.stride(1) != 1) or (weight.shape[1] > 1
                                                          and weight.stride(1) != 1):
        raise ConfigError(f"{fn}: hidden and weight must be contiguous in their last dimension")
    if weight.shape[0] == 0 or weight.shape[0] >= 2 ** 31:
        raise ConfigError(f"{fn}: the vocabulary needs 1 to 2^31 - 1 rows, got {weight.shape[0]}")


def chunking(rows: int, vocab: int, sms: int, cfg: LMHeadArgmaxConfig) -> tuple[int, int]:
    """``(chunks, tiles)``: the vocabulary's ``cdiv(vocab, block_n)`` column tiles cut into
    ``chunks`` chunks of ``tiles`` tiles (the last may be shorter), enough chunks for
    ``programs_per_sm x sms`` programs with the row tiles, at most ``MAX_CHUNKS``."""
    n_tiles = cdiv(vocab, cfg.block_n)
    row_tiles = max(1, cdiv(rows, cfg.block_m))
    want = max(1, min(n_tiles, MAX_CHUNKS, cdiv(int(cfg.programs_per_sm * max(1, sms)), row_tiles)))
    tiles = cdiv(n_tiles, want)
    return cdiv(n_tiles, tiles), tiles


def lm_head_argmax(hidden: torch.Tensor, weight: torch.Tensor,
                   config: LMHeadArgmaxConfig | None = None) -> torch.Tensor:
    """``argmax(hidden @ weight^T, -1)`` (int64 ``[M]``, the logits rounded to the dtype) in the
    module docstring's two launches on CUDA (or under the Triton interpreter), else the torch
    twin. ``config``: the launch (default ``config_for(M)``; ``INTERPRET_CONFIG`` under the
    interpreter)."""
    _check("lm_head_argmax", hidden, weight)
    if not use_triton(_lm_head_argmax_kernel, hidden):
        return lm_head_argmax_ref(hidden, weight)
    rows, K = hidden.shape
    vocab = weight.shape[0]
    out = torch.empty(rows, dtype=torch.int64, device=hidden.device)
    if rows == 0:
        return out
    interpreted = isinstance(_lm_head_argmax_kernel, InterpretedFunction)
    cfg = config or (INTERPRET_CONFIG if interpreted else config_for(rows))
    sms = 4 if interpreted else _num_sms(hidden.device.index)
    chunks, tiles = chunking(rows, vocab, sms, cfg)
    keys = torch.empty(rows, chunks, dtype=torch.int32, device=hidden.device)
    idx = torch.empty_like(keys)
    prec = "ieee" if hidden.dtype == torch.float32 else "tf32"
    _lm_head_argmax_kernel[(cdiv(rows, cfg.block_m), chunks)](
        hidden, hidden.stride(0), weight, weight.stride(0), rows, vocab, K, tiles,
        keys, idx, chunks, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=K % cfg.block_k == 0, ROUND=_ROUND[hidden.dtype], DOT_PREC=prec, RANGE_LOOP=not interpreted,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _argmax_reduce_kernel[(rows,)](keys, idx, chunks, chunks, out,
                                   BLOCK_C=max(16, next_pow2(chunks)),
                                   num_warps=1 if chunks <= 256 else 4)
    return out


# The engine's greedy steps take the fused kernel (``DecoderForCausalLM.greedy_tokens``) where
# this is on and the step samples at most ``FUSED_MAX_ROWS`` rows (above, cuBLAS then the argmax
# kernels are faster: ``CONFIGS``). W1 with the fused kernel at every row count (the sweep's
# table, seventeenth session): 26,237 / 26,716 against 26,333 / 26,545 off (within noise: W1's
# steps have over 64 rows but in its tail).
LM_HEAD_ARGMAX_ENABLED = True
FUSED_MAX_ROWS = 64


def fused_applies(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """True where the engine takes :func:`lm_head_argmax` (``LM_HEAD_ARGMAX_ENABLED``, at most
    ``FUSED_MAX_ROWS`` rows, CUDA tensors of one dtype the kernel takes, 2-D, last dimension
    contiguous); the caller
    otherwise takes the product and :func:`pagedkv.kernels.argmax.argmax_rows`."""
    return (LM_HEAD_ARGMAX_ENABLED and hidden.is_cuda and hidden.dim() == 2
            and hidden.shape[0] <= FUSED_MAX_ROWS
            and weight.dim() == 2 and hidden.dtype in DTYPES and weight.dtype == hidden.dtype
            and hidden.shape[1] == weight.shape[1] and 0 < weight.shape[0] < 2 ** 31
            and (hidden.shape[1] <= 1 or (hidden.stride(1) == 1 and weight.stride(1) == 1)))


def lm_head_argmax_ref(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Plain torch twin of :func:`lm_head_argmax`: the float32 product, rounded to the dtype,
    then ``torch.argmax``."""
    _check("lm_head_argmax_ref", hidden, weight)
    logits = (hidden.float() @ weight.float().t()).to(hidden.dtype)
    return logits.argmax(dim=-1)


__all__ = ["CONFIGS", "FUSED_MAX_ROWS", "INTERPRET_CONFIG", "LM_HEAD_ARGMAX_ENABLED", "LMHeadArgmaxConfig",
           "chunking", "config_for", "fused_applies", "lm_head_argmax", "lm_head_argmax_ref"]
