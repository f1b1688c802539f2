"""The Triton attention backend: KV write + paged decode + paged prefill/extend in one call.

``TritonAttentionBackend.forward`` (conventions in ``backend.py``):
  1. writes the step's K/V into the layer's cache with the index layer's writer
     (``pagedkv.kernels.reshape_and_cache``; slots < 0 skipped, token count from the slot
     mapping), unless ``k``/``v`` are None: the caller wrote them already (``fused_kv_write``:
     the model's fused q/k-norm + RoPE + KV-write kernel);
  2. serves the batch, whatever the order of its rows:
       * requests with one query token -> ``paged_decode_attention`` (GQA-packed, split-KV);
       * requests with more -> ``paged_prefill_attention`` (causal, context through the block
         table), which skips the single-token requests when the decode kernel runs;
       * a batch of fresh prefills only (every request's ``seq_len == query_len``) ->
         ``varlen_prefill_attention`` (torch's varlen flash kernel) where ``fresh_prefill``
         selects it and it is available (CUDA, bf16/fp16);
       * with ``paged_prefill="cudnn"`` (the default where cuDNN's paged attention runs:
         ``pagedkv.attention.cudnn_paged``), every request with more than one query token,
         fresh or after cached context, eager or in a mixed-step CUDA graph -> one cuDNN
         graph launch over the paged cache (the decode kernel keeps the single-token rows).
         Not on layers with a sliding window, a logit soft cap or sinks, not over an FP8
         cache, not on cascade steps; a graph first needed inside a CUDA-graph capture
         (never, after the runner's eager warm-up runs) leaves that capture to the Triton
         kernel;
  3. rows past ``query_start_loc[num_reqs]`` (CUDA-graph padding) are zero.

A layer's attention sinks (``sinks [H]``, GPT-OSS) reach both kernels (the varlen path has
none: a layer with sinks takes the paged prefill kernel instead).

FP8 caches (``float8_e4m3fn``, ``kv_cache_dtype="fp8"``): the writer quantizes the step's K/V
by the layer's ``k_scale`` / ``v_scale`` (host floats, 1.0 by default), the decode and prefill
kernels (the cascade launches too) dequantize after their loads. The varlen fresh-prefill path,
which attends to the step's unquantized K/V, is not taken over an FP8 cache: every prompt
token then sees the K/V that later steps and prefix hits read back.

Host work per call reads only host ints and the metadata's ``*_cpu`` copies: a decode-only
batch (``max_query_len <= 1``) costs no array work, except a sum and a max of its host lengths
where the batch size is one the one-range rules of ``DecodeConfig`` can change (unless the
metadata's ``decode_balanced`` says it, as a CUDA graph's does), and its launches depend on host
values only (CUDA-graph safe); a mixed batch takes one ``numpy.diff`` of ``query_start_loc_cpu``.

Cascade (shared-prefix) attention (``CascadeConfig``): where the step's requests share their
first ``P = metadata.common_prefix_len`` positions in the same blocks (the scheduler's
``num_common_prefix_blocks``, capped by the runner below every query) and
:meth:`TritonAttentionBackend.use_cascade` says it pays, a plan serves its layers in three
launches instead of reading the shared blocks once per request:
  1. prefix: every query row of the batch against the ``P`` shared positions, non-causal (each
     query sits after them), as one request of ``paged_prefill_attention(causal=False)``
     whose table row is request 0's (its first blocks are everyone's): one pass over the
     shared K/V for the whole batch, split over the keys into a few ranges when the batch
     is short (``CascadeConfig.prefix_splits``: enough programs to fill the device); float32
     outputs and log-sum-exps per range;
  2. suffix: each request over its own positions ``[P, seq_len)``: the usual decode /
     prefill kernels on the table shifted by ``P // block_size`` columns and the lengths
     reduced by ``P`` (both made on the device from the device copy of ``P``); float32
     output and log-sum-exp;
  3. ``merge_attention_states`` into the output by the log-sum-exps of the prefix ranges and
     the suffix (rows past ``query_start_loc[num_reqs]`` zeroed).
On CUDA the prefix launch runs on a side stream, concurrently with the suffix launch(es)
(``CascadeConfig.concurrent_prefix``; the main stream waits for it before the merge): the
prefix is compute-bound on a few hundred programs, the suffix bandwidth-bound, so the suffix's
programs fill what the prefix leaves (inside a CUDA graph the two become parallel branches).
The launches read ``P`` on the device only (their grids do not depend on it), so one CUDA
graph per batch size serves every prefix length: the graph variant ``CASCADE`` (for sizes of
at least ``min_reqs`` requests) is captured with ``use_cascade=True`` and replayed when the
runner finds every attention group of the step taking cascade. A layer with attention sinks
takes the plain path on a cascade plan (the plan stays valid for it).

Without CUDA and without the Triton interpreter (compiled Triton cannot run on CPU tensors) the
backend falls back to ``paged_attention_ref``, like the index layer's launchers do.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.attention._triton_common import interpreted, num_sms
from pagedkv.attention.backend import (
    AttentionBackend,
    AttentionLayout,
    AttentionMetadataLike,
    AttentionPlan,
)
from pagedkv.attention.cudnn_paged import (
    CudnnPagedGraph,
    cudnn_paged_available,
    cudnn_paged_block_size_ok,
    cudnn_paged_inputs,
    declared_shape,
)
from pagedkv.attention.merge_states import _merge_kernel, merge_attention_states
from pagedkv.attention.torch_ref import paged_attention_ref
from pagedkv.attention.triton_decode import (
    DecodeConfig,
    QKPrologue,
    _decode_kernel,
    default_decode_config,
    one_range_for,
    one_range_possible,
    paged_decode_attention,
)
from pagedkv.attention.triton_prefill import (
    INTERPRET_PREFILL_CONFIG,
    PrefillConfig,
    paged_prefill_attention,
    varlen_available_for,
    varlen_prefill_attention,
)
from pagedkv.errors import ConfigError, InvariantError
from pagedkv.kernels._common import cdiv, use_triton
from pagedkv.kernels.fp8_kv import is_fp8_kv
from pagedkv.kernels.reshape_and_cache import reshape_and_cache

FRESH_PREFILL_CHOICES = ("auto", "triton", "varlen")
PAGED_PREFILL_CHOICES = ("auto", "triton", "cudnn")
# What "auto" picks for requests of more than one query token (H200, bf16, block 16,
# bench/bench_cudnn_paged_gpu.py): cuDNN over the paged cache 329 us on 8 x 2,048 causal (418
# TFLOP/s) against the Triton kernel's 433; a W2-like step (7,000 + 6,500 fresh + 2,860 after
# 4,000) 1,073 against 1,360 us. End to end (bench_w1.py, alternating processes, 4 pairs over
# three leases): W2 3,824 / 3,842 / 3,847 / 3,829 against 3,721 / 3,759 / 3,751 / 3,736, W3
# 50,495 / 50,902 / 50,447 / 51,080 against 51,004 / 50,011 / 48,425 / 50,953, W1 26,457
# against 26,418 (one pair). Where the frontend is not installed (or cuDNN
# declines a layout), the Triton kernel serves: ``wants_cudnn_paged``.
AUTO_PAGED_PREFILL = "cudnn"
# What "auto" picks for batches of fresh prefills on CUDA (bf16/fp16). Measured on the H200
# (bench/bench_attention_gpu.py, 8 x 2048 causal, 16 q / 8 KV heads, head_dim 128, bf16,
# 7ad6768): the paged Triton kernel 512 us (269 TFLOP/s; 477 with two query heads a program);
# torch 2.11's varlen_attn 674 us (204) with the K/V heads repeated to 16 as that torch
# requires (it has no enable_gqa), 500 us (275) for its kernel alone. The Triton kernel wins
# as the backend can call them.
AUTO_FRESH_PREFILL = "triton"
# The graph variant of cascade steps (see the module docstring).
CASCADE = "cascade"
# Copy bandwidth of the H200 (PERF.md): turns the shared-prefix bytes cascade saves into time.
_COPY_BYTES_PER_US = 4.27e6


# The shared-prefix launch's tiles on CUDA when neither the cascade config nor the backend
# names one: W3's decode shape (256 rows, 2,048 shared keys, 16 query / 8 K/V heads; H200,
# bench/bench_cascade_gpu.py --sweep-prefix --generated 128, 871c3d3, us at 4 key splits, the
# block table read a tile ahead): one head a program 64 x 64 x 4 warps x 3 stages 19.5 (20.7
# with the table inside the tile), x 2 stages 19.1, x 4 stages 29.2 (one program an SM),
# 128 x 64 x 8 warps 18.9; two heads a program x 8 warps 18.9; 1, 2 or 8 splits slower.
_CUDA_PREFIX_CONFIG = PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3,
                                    pack_heads=1)


def default_prefix_config(device: torch.device) -> PrefillConfig:
    """The cascade prefix launch's default tiles (see ``_CUDA_PREFIX_CONFIG``)."""
    return _CUDA_PREFIX_CONFIG if device.type == "cuda" else INTERPRET_PREFILL_CONFIG


@dataclass(frozen=True)
class CascadeConfig:
    """When a step takes cascade attention (:meth:`TritonAttentionBackend.use_cascade`): at
    least ``min_prefix_tokens`` shared positions, at least ``min_reqs`` requests (vLLM's
    thresholds, 256 and 8, as that project chose them, untuned), and at least
    ``min_saved_us`` of shared K/V reads saved: ``(num_reqs - 1) x P x Hkv x D x 2`` elements
    at the copy bandwidth of the H200 (4.27 TB/s), against the prefix and merge launches that
    cascade adds (a few microseconds each). Never on layers with a sliding window or a logit
    soft cap."""

    min_prefix_tokens: int = 256
    min_reqs: int = 8
    min_saved_us: float = 10.0
    # the prefix launch: its tiles (None: the backend's prefill config) and key splits, so
    # that a short batch over a long prefix fills the device: ``prefix_waves`` x SMs programs
    # wanted, at most ``max_prefix_splits`` splits of at least ``min_prefix_split_tokens``
    # keys (when the prefix length is known on the host; a graph's launch is sized by its
    # batch alone), merged with the suffix by one merge launch (untuned first choices)
    prefix_config: PrefillConfig | None = None  # None: the backend's, else default_prefix_config
    prefix_waves: float = 2.0
    max_prefix_splits: int = 8
    min_prefix_split_tokens: int = 256
    # on CUDA, the prefix launch on a side stream concurrent with the suffix (module docstring)
    concurrent_prefix: bool = True

    def __post_init__(self):
        if self.prefix_config is not None and not isinstance(self.prefix_config, PrefillConfig):
            raise ConfigError(f"CascadeConfig.prefix_config must be a PrefillConfig, got "
                              f"{self.prefix_config!r}")
        if not 1 <= self.max_prefix_splits <= 64 or self.prefix_waves <= 0:
            raise ConfigError("CascadeConfig: need 1 <= max_prefix_splits <= 64 and "
                              "prefix_waves > 0")
        for name in ("min_prefix_tokens", "min_reqs", "min_prefix_split_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"CascadeConfig.{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.min_saved_us, (int, float)) or self.min_saved_us < 0:
            raise ConfigError(f"CascadeConfig.min_saved_us must be >= 0, got {self.min_saved_us!r}")

    def prefix_splits(self, rows: int, num_heads: int, block_m: int, sms: int,
                      prefix_len: int = 0) -> int:
        """Key splits of the prefix launch over ``rows`` query rows (grid ``(rows // block_m +
        1) x num_heads`` programs per split: ``num_heads`` counts the launch's head programs,
        the query heads over ``PrefillConfig.heads_per_program``); ``prefix_len`` (0:
        unknown) caps them."""
        programs = (rows // block_m + 1) * num_heads
        splits = min(self.max_prefix_splits, cdiv(int(self.prefix_waves * sms), programs))
        if prefix_len > 0:
            splits = min(splits, prefix_len // self.min_prefix_split_tokens)
        return max(1, splits)


def _host_ints(x, n: int) -> np.ndarray:
    """The first ``n`` entries of a host tensor / array / sequence as an int64 numpy array."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ConfigError("attention metadata: the *_cpu fields must live on the CPU")
        return x[:n].numpy().astype(np.int64, copy=False)
    return np.asarray(x, dtype=np.int64)[:n]


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through Triton kernels (see the module docstring).

    Args:
        fresh_prefill: fresh prefills (no cached context): ``"triton"`` (the paged prefill
            kernel), ``"varlen"`` (batches of fresh prefills only: torch's varlen flash
            attention where available, else the Triton kernel) or ``"auto"`` (the faster
            one on the H200: ``AUTO_FRESH_PREFILL``). Requests that ``paged_prefill`` gives
            to cuDNN take it whatever this says.
        paged_prefill: requests of more than one query token: ``"triton"`` (the paged prefill
            kernel), ``"cudnn"`` (cuDNN's fused attention over the paged cache where available:
            ``pagedkv.attention.cudnn_paged``, else the Triton kernel; takes precedence
            over ``fresh_prefill``) or ``"auto"`` (``AUTO_PAGED_PREFILL``: cuDNN).
        decode_config / prefill_config: launch parameters (default per device).
        cascade: when to take cascade attention (:class:`CascadeConfig`); None: never.
    """

    name = "triton"
    # Grids and buffers depend only on host ints fixed in the plan: safe to replay in a CUDA graph.
    supports_cuda_graphs = True
    supports_cascade = True

    @property
    def supports_mixed_cuda_graphs(self) -> bool:
        """Mixed-step graphs run every prefill through the paged Triton kernel, so only where
        fresh prefills take it anyway (``fresh_prefill="triton"``, the default): a backend
        asked for the varlen fresh-prefill path keeps its mixed steps eager, where that path
        runs (cuDNN's paged launch runs inside mixed graphs)."""
        return self.fresh_prefill == "triton"

    def wants_cudnn_paged(self, layout: AttentionLayout) -> bool:
        """Whether this backend's prefill requests of ``layout``'s layers take cuDNN's paged
        attention (asked for, and available for the layout)."""
        return (self.paged_prefill == "cudnn" and layout.sliding_window is None
                and layout.logits_soft_cap is None
                and cudnn_paged_available(layout.dtype, layout.device, layout.head_dim))

    def __init__(self, *, fresh_prefill: str = "auto", decode_config: DecodeConfig | None = None,
                 prefill_config: PrefillConfig | None = None,
                 cascade: CascadeConfig | None = CascadeConfig(),
                 paged_prefill: str = "auto"):
        if paged_prefill not in PAGED_PREFILL_CHOICES:
            raise ConfigError(f"unknown paged_prefill {paged_prefill!r}; use one of "
                              f"{', '.join(PAGED_PREFILL_CHOICES)}")
        self.paged_prefill = AUTO_PAGED_PREFILL if paged_prefill == "auto" else paged_prefill
        self._cudnn_graphs: dict = {}  # declared shape -> CudnnPagedGraph (False: declined)
        if fresh_prefill == "cudnn":
            raise ConfigError("fresh_prefill='cudnn' (one cuDNN call per fresh request over "
                              "gathered K/V) was replaced by paged_prefill='cudnn', cuDNN over "
                              "the paged cache, which 'auto' picks where the frontend is "
                              "installed")
        if fresh_prefill not in FRESH_PREFILL_CHOICES:
            raise ConfigError(f"unknown fresh_prefill {fresh_prefill!r}; use one of "
                              f"{', '.join(FRESH_PREFILL_CHOICES)}")
        if cascade is not None and not isinstance(cascade, CascadeConfig):
            raise ConfigError(f"cascade must be a CascadeConfig or None, got {cascade!r}")
        self.fresh_prefill = AUTO_FRESH_PREFILL if fresh_prefill == "auto" else fresh_prefill
        self.decode_config = decode_config
        self.prefill_config = prefill_config
        self.cascade = cascade
        self._side_streams: dict = {}  # device -> the cascade prefix launch's stream

    @property
    def fused_kv_write(self) -> bool:
        """``forward`` accepts ``k = v = None`` when the caller has already written the step's
        K/V at ``metadata.slot_mapping`` (the model's fused q/k-norm + RoPE + KV-write kernel):
        every kernel here reads K/V from the paged cache, except the varlen fresh-prefill path,
        which needs the K/V tensors."""
        return self.fresh_prefill != "varlen"

    @property
    def wants_decode_order(self) -> bool:
        """The decode launches take the step's longest-first order (``DecodeConfig.use_order``
        of the configured launch; on by default: the preparer then stages it each step, which an
        FP8 cache's launch, FP8_DECODE_CONFIG, does not read)."""
        return (self.decode_config or DecodeConfig()).use_order

    def _decode_cfg(self, device: torch.device) -> DecodeConfig:
        return self.decode_config or default_decode_config(device)

    def graph_variants(self, num_reqs: int, num_kv_heads: int, device: torch.device) -> tuple:
        """The host decisions that a decode CUDA graph of ``num_reqs`` requests bakes in
        besides its size, one graph per value: whether the decode launch runs one range per
        request (balanced lengths, or the longest-first bound: ``one_range_for``), where that
        can change it (``(False, True)``), else ``(False,)``; plus ``CASCADE``
        where cascade attention is on and ``num_reqs >= min_reqs``. The graph's metadata
        carries the value as :meth:`graph_capture_fields` says."""
        if one_range_possible(num_reqs, num_kv_heads, num_sms(device), self._decode_cfg(device)):
            plain = (False, True)
        else:
            plain = (False,)
        if self.cascade is not None and num_reqs >= self.cascade.min_reqs:
            return plain + (CASCADE,)
        return plain

    def graph_variant(self, num_reqs: int, num_kv_heads: int, seq_lens, device: torch.device,
                      cascade: bool = False):
        """The value of :meth:`graph_variants` that a decode step replays: ``num_reqs`` the
        graph's (padded) size, ``seq_lens`` the host lengths of the step's actual requests,
        ``cascade`` whether every attention group takes cascade attention (``CASCADE`` where
        the size has that graph)."""
        if cascade and self.cascade is not None and num_reqs >= self.cascade.min_reqs:
            return CASCADE
        return one_range_for(seq_lens, num_reqs, num_kv_heads, num_sms(device),
                             self._decode_cfg(device))

    def mixed_graph_variants(self, num_reqs: int) -> tuple:
        """Mixed-step graphs: the plain one and, where cascade attention is on and
        ``num_reqs >= min_reqs``, a ``CASCADE`` one."""
        if self.cascade is not None and num_reqs >= self.cascade.min_reqs:
            return (None, CASCADE)
        return (None,)

    def mixed_graph_capture_fields(self, variant) -> dict:
        """``CASCADE``: ``use_cascade``; else no cascade (the decode launch unbalanced)."""
        return {"decode_balanced": False, "use_cascade": variant == CASCADE}

    def graph_capture_fields(self, variant) -> dict:
        """``CASCADE``: ``use_cascade`` (the suffix decode launch unbalanced); else
        ``decode_balanced=variant`` and no cascade."""
        if variant == CASCADE:
            return {"decode_balanced": False, "use_cascade": True}
        return {"decode_balanced": variant, "use_cascade": False}

    def cascade_capable(self, layout: AttentionLayout) -> bool:
        """Cascade attention is on and ``layout``'s layers allow it (no sliding window, no
        logit soft cap)."""
        return (self.cascade is not None and layout.sliding_window is None
                and layout.logits_soft_cap is None)

    def use_cascade(self, num_reqs: int, common_prefix_len: int,
                    layout: AttentionLayout) -> bool:
        """The host decision of a step (:class:`CascadeConfig`'s thresholds)."""
        if common_prefix_len <= 0 or not self.cascade_capable(layout):
            return False
        cfg = self.cascade
        if common_prefix_len < cfg.min_prefix_tokens or num_reqs < cfg.min_reqs:
            return False
        saved = ((num_reqs - 1) * common_prefix_len * layout.num_kv_heads * layout.head_dim * 2
                 * layout.dtype.itemsize)
        return saved >= cfg.min_saved_us * _COPY_BYTES_PER_US

    def plan(self, metadata: AttentionMetadataLike, layout: AttentionLayout) -> "TritonPlan":
        """This step's plan for the layers of one KV-cache group (see :class:`TritonPlan`)."""
        return TritonPlan(self, metadata, layout)

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        plan: "TritonPlan",
        scale: float,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        check = not plan.checked
        if check:  # first layer of the step: the plan's layout and the launchers' shapes
            plan.check(q, kv_cache)
        metadata = plan.metadata
        if k is not None:
            reshape_and_cache(k, v, kv_cache[0], kv_cache[1], plan.slots, k_scale, v_scale)
        elif not self.fused_kv_write:
            raise InvariantError("kv-write", "k/v are None but this backend's fresh-prefill path "
                                 "needs them (fresh_prefill='varlen')")
        layout = plan.layout
        window, cap = layout.sliding_window, layout.logits_soft_cap
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        if not plan.triton:
            return paged_attention_ref(q, kv_cache, metadata, scale, sliding_window=window,
                                       logits_soft_cap=cap, sinks=sinks, **scales)

        n = plan.n
        out = torch.empty_like(q)
        if n == 0:
            return out.zero_()
        # cascade: not for a layer with sinks (it takes the plain path)
        if plan.cascade and sinks is None:
            return self._forward_cascade(q, kv_cache, plan, scale, out, check, scales)
        qsl = metadata.query_start_loc
        seq_lens = metadata.seq_lens
        table = metadata.block_table_tensor
        if plan.decode_only:  # decode-only batch: host ints only
            return self._decode_only(q, kv_cache, plan, scale, out, check, sinks, scales)
        if plan.end < q.shape[0]:
            out[plan.end:].zero_()
        # torch's varlen kernel has no sinks, and reads the step's K/V, not an FP8 cache's
        if plan.varlen and sinks is None and not is_fp8_kv(kv_cache.dtype):
            varlen_prefill_attention(q, k, v, qsl[: n + 1], plan.end, plan.max_q, scale, out)
            return out
        # cuDNN over the paged cache: every request of more than one query token
        graph = None
        if plan.cudnn_paged and sinks is None and not is_fp8_kv(kv_cache.dtype):
            graph = self._cudnn_paged_graph(plan, q, out, kv_cache, scale)
            if graph is not None and plan.mixed_graph:
                out.zero_()  # rows no request owns (a graph's host end is the capture's)
        if plan.has_decode:
            paged_decode_attention(q, kv_cache, table, qsl, seq_lens, n, scale, out,
                                   max_seq_len=plan.max_seq_len, config=self.decode_config,
                                   check=check, workspace=plan.workspace,
                                   sliding_window=window, logits_soft_cap=cap, sinks=sinks,
                                   order=getattr(metadata, "decode_order", None), **scales)
        if graph is not None:
            graph(q, kv_cache, out, plan.cudnn_inputs(q, out))
            return out
        paged_prefill_attention(q, kv_cache, table, qsl, seq_lens, n, scale, out,
                                num_tokens=plan.end, skip_decode=plan.has_decode,
                                config=self.prefill_config, check=check,
                                sliding_window=window, logits_soft_cap=cap, sinks=sinks,
                                **scales)
        return out

    def _decode_only(self, q, kv_cache, plan: "TritonPlan", scale, out, check, sinks, scales,
                     prologue: QKPrologue | None = None) -> torch.Tensor:
        """A decode-only step's launch (host ints only)."""
        metadata = plan.metadata
        n = plan.n
        # padded requests zero their rows inside the decode kernel (in a CUDA graph the
        # host's `end` is the capture's, not the replay's); rows past num_reqs here
        if n < q.shape[0]:
            out[n:].zero_()
        paged_decode_attention(q, kv_cache, metadata.block_table_tensor,
                               metadata.query_start_loc, metadata.seq_lens, n, scale, out,
                               max_seq_len=plan.max_seq_len, balanced=plan.balanced,
                               config=self.decode_config, zero_padded_rows=True,
                               check=check, workspace=plan.workspace,
                               sliding_window=plan.layout.sliding_window,
                               logits_soft_cap=plan.layout.logits_soft_cap, sinks=sinks,
                               order=getattr(metadata, "decode_order", None), prologue=prologue,
                               **scales)
        return out

    def forward_decode_prologue(self, layer_idx: int, prologue: QKPrologue,
                                kv_cache: torch.Tensor, plan: "TritonPlan",
                                scale: float) -> torch.Tensor | None:
        """A decode-only step's attention with the layer's q/k norms, RoPE and K/V write done
        by the decode launch itself (``QKPrologue``: one launch less than
        ``qk_norm_rope_cache`` + :meth:`forward`); the same result. None where the step takes
        another path (prefill rows, cascade, the reference attention, an empty step): the
        caller then runs the prologue's kernel and :meth:`forward`."""
        if not (plan.triton and plan.decode_only and not plan.cascade and plan.n > 0):
            return None
        q = prologue.query()
        check = not plan.checked
        if check:
            plan.check(q, kv_cache)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return self._decode_only(q, kv_cache, plan, scale, out, check, None, {}, prologue)

    def _cudnn_paged_graph(self, plan: "TritonPlan", q: torch.Tensor, out: torch.Tensor,
                           kv_cache: torch.Tensor, scale: float):
        """The cuDNN graph of this step's declared shape (built and cached on first use), or
        None inside a CUDA-graph capture that finds none built (that capture then takes the
        Triton kernel)."""
        batch, max_q = declared_shape(plan.n, q.shape[0])
        half = kv_cache[0]
        key = (q.device, q.dtype, q.shape[1], q.shape[2], batch, max_q, tuple(half.shape),
               tuple(half.stride()), plan.metadata.block_table_tensor.shape[1], q.stride(0),
               out.stride(0), float(scale))
        graph = self._cudnn_graphs.get(key)
        if graph is None:
            if plan.capturing:
                return None
            if q.stride(2) != 1 or q.stride(1) != q.shape[2] or out.stride(1) != out.shape[2]:
                return None  # heads not packed in their rows: the Triton kernel
            if not cudnn_paged_block_size_ok(half.shape[1]):
                return None  # pages cuDNN does not take (a hybrid's): the Triton kernel
            try:
                graph = CudnnPagedGraph(
                    dtype=q.dtype, num_heads=q.shape[1], head_dim=q.shape[2], batch=batch,
                    max_q=max_q, cache_shape=tuple(half.shape),
                    cache_strides=tuple(half.stride()),
                    width=plan.metadata.block_table_tensor.shape[1],
                    q_token_stride=q.stride(0), o_token_stride=out.stride(0), scale=scale,
                    device=q.device)
            except Exception as e:  # noqa: BLE001 - cuDNN declined the graph: Triton serves
                warnings.warn(f"cuDNN's paged attention declined {key[4:6]} (requests, rows): "
                              f"{type(e).__name__}: {str(e)[:300]}; the Triton kernel serves "
                              "these steps", RuntimeWarning, stacklevel=2)
                graph = False
            self._cudnn_graphs[key] = graph
        return graph or None

    def _side_stream(self, device: torch.device):
        """The stream of the cascade prefix launch on ``device`` (one per backend and device),
        or None: not CUDA, ``concurrent_prefix`` off, or the kernels interpreted (decided on
        the kernel object, as ``use_triton`` does)."""
        if (device.type != "cuda" or not self.cascade.concurrent_prefix
                or interpreted(_merge_kernel)):
            return None
        side = self._side_streams.get(device)
        if side is None:
            side = self._side_streams[device] = torch.cuda.Stream(device)
        return side

    def _forward_cascade(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: "TritonPlan",
                         scale: float, out: torch.Tensor, check: bool,
                         scales: dict) -> torch.Tensor:
        """Cascade attention of one layer (module docstring): prefix, suffix, merge."""
        c = plan.cascade_parts(q, kv_cache)
        metadata = plan.metadata
        n = plan.n
        qsl = metadata.query_start_loc
        # 1. every query row against the shared prefix, one request, non-causal (a decode
        # graph's rows: all of them; its host end is the capture's); on CUDA on the side
        # stream, after everything the main stream has enqueued (this layer's K/V writes)
        side = self._side_stream(q.device)
        main = None
        if side is not None:
            main = torch.cuda.current_stream(q.device)
            side.wait_stream(main)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            paged_prefill_attention(q, kv_cache, c.prefix_table, c.prefix_qsl, c.prefix_len, 1,
                                    scale, c.prefix_out, num_tokens=c.rows,
                                    config=c.prefix_config, check=check, causal=False,
                                    lse=c.prefix_lse, kv_splits=c.splits, **scales)
        # 2. each request over its own positions after the prefix
        if plan.decode_only or plan.has_decode:
            paged_decode_attention(q, kv_cache, c.suffix_table, qsl, c.suffix_seq_lens, n, scale,
                                   c.suffix_out, max_seq_len=max(1, plan.max_seq_len - plan.prefix),
                                   config=self.decode_config, check=check,
                                   workspace=plan.workspace, lse=c.suffix_lse, **scales)
        if not plan.decode_only:
            paged_prefill_attention(q, kv_cache, c.suffix_table, qsl, c.suffix_seq_lens, n, scale,
                                    c.suffix_out, num_tokens=plan.end,
                                    skip_decode=plan.has_decode, config=self.prefill_config,
                                    check=check, lse=c.suffix_lse, **scales)
        if main is not None:
            main.wait_stream(side)
        # 3. merged by the log-sum-exps; rows no request owns are zeroed
        return merge_attention_states(out, c.prefix_out, c.prefix_lse, c.suffix_out,
                                      c.suffix_lse, q.shape[0], end=c.end, check=check)


class TritonPlan(AttentionPlan):
    """What :meth:`TritonAttentionBackend.forward` derives from one step's metadata, once for
    all layers of a KV-cache group: host ints, length checks, the path (decode-only, varlen,
    mixed) and a workspace for the decode kernel's split partials (allocated by the first
    layer's launch). A plan made inside a CUDA-graph capture serves that capture only, and one
    made outside never serves a capture: a graph must own the workspace it writes (buffers
    allocated before the capture would be freed and reused while the graph still writes them),
    so the first ``forward`` checks the capture state against the plan's."""

    __slots__ = ("slots", "triton", "workspace", "n", "decode_only", "varlen", "has_decode",
                 "balanced", "end", "max_q", "max_seq_len", "capturing", "checked", "cascade",
                 "prefix", "_cascade_parts", "backend", "cudnn_paged", "mixed_graph", "_cudnn_inputs")

    def __init__(self, backend: TritonAttentionBackend, metadata, layout: AttentionLayout):
        super().__init__(metadata, layout)
        self.checked = False
        dev = layout.device
        self.capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
        num_actual = int(metadata.num_actual_tokens)
        self.slots = metadata.slot_mapping[:num_actual]
        self.triton = use_triton(_decode_kernel, metadata.slot_mapping)
        self.workspace: dict = {}
        n = self.n = int(metadata.num_reqs)
        self.decode_only = self.varlen = self.has_decode = self.balanced = False
        self.end = self.max_q = self.max_seq_len = 0
        self.cascade = False
        self.prefix = 0
        self._cascade_parts = None
        self.backend = backend
        self.cudnn_paged = False  # the prefill requests take cuDNN's paged attention
        self.mixed_graph = bool(getattr(metadata, "mixed_graph", False))
        self._cudnn_inputs = None
        if not self.triton or n == 0:
            return
        # cascade attention: a graph's baked decision, else the backend's for this step
        self.prefix = int(metadata.common_prefix_len)
        want = metadata.use_cascade
        if want is None:
            want = backend.use_cascade(n, self.prefix, layout)
        self.cascade = bool(want) and backend.cascade_capable(layout)
        self.cudnn_paged = not self.cascade and backend.wants_cudnn_paged(layout)
        if self.mixed_graph:
            # a mixed-step graph: the launches are sized by the capture's bounds (every row
            # may be a query row: num_actual_tokens; any request a decode) and the kernels
            # read the lengths on the device; the host lengths are the capture batch's
            self.end = self.max_q = int(metadata.num_actual_tokens)
            self.max_seq_len = int(metadata.max_seq_len)
            self.has_decode = True
            return
        self.end = int(_host_ints(metadata.query_start_loc_cpu, n + 1)[n])
        self.max_q = int(metadata.max_query_len)
        self.max_seq_len = int(metadata.max_seq_len)
        if self.cascade and self.prefix > 0:
            # every query must sit after the shared prefix (the runner caps it so)
            q_lens = np.diff(_host_ints(metadata.query_start_loc_cpu, n + 1))
            ctx = (_host_ints(metadata.seq_lens_cpu, n) - q_lens)[q_lens > 0]
            if ctx.size and int(ctx.min()) < self.prefix:
                raise InvariantError("cascade-prefix", "common_prefix_len exceeds a request's "
                                     "context: a query would precede the shared prefix",
                                     common_prefix_len=self.prefix, min_context=int(ctx.min()))
        if self.max_q <= 1:
            self.decode_only = True
            # one range per request: the graph's baked value, else (eager) from the host lengths
            # where it changes the launch
            self.balanced = getattr(metadata, "decode_balanced", None)
            if self.balanced is None:
                self.balanced = one_range_for(
                    _host_ints(metadata.seq_lens_cpu, getattr(metadata, "num_actual_reqs", n)),
                    n, layout.num_kv_heads, num_sms(dev), backend._decode_cfg(dev))
            return
        qsl_h = _host_ints(metadata.query_start_loc_cpu, n + 1)
        q_lens = np.diff(qsl_h)
        seq_h = _host_ints(metadata.seq_lens_cpu, n)
        if (q_lens < 0).any() or (seq_h < q_lens).any():
            r = int(np.flatnonzero((q_lens < 0) | (seq_h < q_lens))[0])
            raise InvariantError("attention-lengths", "need 0 <= query_len <= seq_len",
                                 request=r, query_len=int(q_lens[r]), seq_len=int(seq_h[r]))
        self.varlen = (backend.fresh_prefill == "varlen"
                       and layout.sliding_window is None and layout.logits_soft_cap is None
                       and varlen_available_for(layout.dtype, dev)
                       and np.array_equal(seq_h, q_lens))
        self.has_decode = bool((q_lens == 1).any())

    def cudnn_inputs(self, q: torch.Tensor, out: torch.Tensor) -> dict:
        """The cuDNN paged launch's per-step inputs (:func:`cudnn_paged_inputs`, made at the
        first layer on the device, shared by the others)."""
        if self._cudnn_inputs is None:
            md = self.metadata
            batch, _ = declared_shape(self.n, q.shape[0])
            self._cudnn_inputs = cudnn_paged_inputs(md.query_start_loc, md.seq_lens,
                                                    md.block_table_tensor, self.n, batch,
                                                    q.stride(0), out.stride(0))
        return self._cudnn_inputs

    def cascade_parts(self, q: torch.Tensor, kv_cache: torch.Tensor) -> "_CascadeParts":
        """The step's cascade tensors (made at the first layer, shared by the others)."""
        parts = self._cascade_parts
        if parts is None:
            backend = self.backend
            parts = self._cascade_parts = _CascadeParts(self, q, kv_cache, backend.cascade,
                                                        backend.prefill_config)
        return parts

    def check(self, q: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """The first layer's tensors against the plan (later layers of the group have the same
        shapes), and the CUDA-graph capture state against the plan's."""
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise InvariantError("kv-cache-shape",
                                 "KV cache must be [2, num_blocks, block_size, num_kv_heads, head_dim]",
                                 cache_shape=tuple(kv_cache.shape))
        got = AttentionLayout.of(q, kv_cache)
        if not got.same_shapes(self.layout):
            raise InvariantError("attention-layout", "the layer's query/cache do not match the "
                                 "plan's layout", plan=self.layout, layer=got)
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing != self.capturing:
            raise InvariantError("plan-capture", "a plan serves the forward passes it was made "
                                 "for: make plans inside a CUDA-graph capture for the capture")
        if self.end > q.shape[0]:
            raise InvariantError("attention-token-count", "query_start_loc ends past the query rows",
                                 end=self.end, rows=q.shape[0])
        self.checked = True


class _CascadeParts:
    """One cascade step's device tensors, made on the device from the plan's metadata (no
    host value of the prefix length is read, so a CUDA graph replays them for any prefix):
    the prefix as one request (``prefix_qsl = [0, query_start_loc[num_reqs]]``, length the
    device copy of ``P``, table row 0: every request's first blocks are the shared ones), the
    suffix table (each row shifted left by ``P // block_size`` columns; the clamped tail
    columns are never read, they lie past the reduced lengths) and lengths (``seq_lens - P``,
    0 for padding requests), and the float32 partial outputs and log-sum-exps (the prefix's
    ``[S, ...]`` with ``S = splits > 1`` key splits). ``rows``: the prefix launch's row bound
    (a decode step's rows, all of them in a graph whose host end is the capture's)."""

    __slots__ = ("end", "prefix_qsl", "prefix_len", "prefix_table", "suffix_table",
                 "suffix_seq_lens", "prefix_out", "prefix_lse", "suffix_out", "suffix_lse",
                 "rows", "splits", "prefix_config")

    def __init__(self, plan: TritonPlan, q: torch.Tensor, kv_cache: torch.Tensor,
                 cascade: CascadeConfig, prefill_config: PrefillConfig | None) -> None:
        metadata = plan.metadata
        n = plan.n
        dev = q.device
        p = metadata.common_prefix_len_device
        if p is None:
            if plan.capturing:
                raise InvariantError("cascade-capture", "a CUDA graph's cascade plan needs the "
                                     "persistent device copy common_prefix_len_device")
            p = torch.full((1,), plan.prefix, dtype=torch.int32, device=dev)
        qsl = metadata.query_start_loc
        self.end = qsl[n:n + 1]
        self.prefix_qsl = torch.cat((qsl[:1], self.end))
        self.prefix_len = p[:1]
        table = metadata.block_table_tensor
        self.prefix_table = table[:1]
        width = table.shape[1]
        shift = p[:1].to(torch.int64) // kv_cache.shape[2]
        cols = (torch.arange(width, device=dev) + shift).clamp_(max=width - 1)
        self.suffix_table = table[:n].gather(1, cols.expand(n, width))
        self.suffix_seq_lens = (metadata.seq_lens[:n] - p[:1]).clamp_(min=0)
        rows, heads, dim = q.shape
        self.rows = rows if plan.decode_only else plan.end
        self.prefix_config = (cascade.prefix_config or prefill_config
                              or default_prefix_config(dev))
        # programs per split: one per query tile and head group of the launch (packed heads)
        group = heads // kv_cache.shape[3]
        self.splits = cascade.prefix_splits(
            self.rows, heads // self.prefix_config.heads_per_program(group),
            self.prefix_config.block_m, num_sms(dev), plan.prefix)
        f32 = torch.float32
        lead = (self.splits,) if self.splits > 1 else ()
        self.prefix_out = torch.empty(*lead, rows, heads, dim, dtype=f32, device=dev)
        self.prefix_lse = torch.empty(*lead, rows, heads, dtype=f32, device=dev)
        self.suffix_out = torch.empty(rows, heads, dim, dtype=f32, device=dev)
        self.suffix_lse = torch.empty(rows, heads, dtype=f32, device=dev)


__all__ = ["AUTO_FRESH_PREFILL", "AUTO_PAGED_PREFILL", "CASCADE", "FRESH_PREFILL_CHOICES",
           "PAGED_PREFILL_CHOICES", "CascadeConfig",
           "TritonAttentionBackend", "TritonPlan"]
