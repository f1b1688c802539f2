"""Prefill and extend attention through cuDNN's fused attention graph, reading the paged cache.

cuDNN's graph API (the ``nvidia-cudnn-frontend`` package, optional: ``pip install
pagedkv[cudnn]``) takes K / V as page pools with per-request page tables, so prefill requests
(fresh ones and chunks after cached context) attend straight out of the engine's cache, with no
gather. The graph is declared once per shape class and reused:

* queries and outputs ragged (THD): ``[B, H, max_q, D]`` with per-request row offsets
  (elements, ``row x token stride``) into the step's ``q`` / ``out`` rows;
* K / V: one cache half ``[num_blocks, block_size, kv_heads, D]`` declared as the pool
  ``[num_blocks, kv_heads, block_size, D]`` with its own strides (token-major pages);
* page table ``[B, 1, max_pages, 1]`` (the block table's rows), lengths ``seq_len_q`` /
  ``seq_len_kv`` with the padding mask, and the causal diagonal aligned bottom right (a
  chunk's queries are the last of its keys).

The batch is declared for ``B`` requests and ``max_q`` query rows; the rows of a step's
requests that take this path get their lengths, the others (single-token decodes, served by the
decode kernel, and padding) length 0. Declaring more than a step uses cost 0-25 us on the H200
(8 x 2,048 causal: 330 us exact, 333 / 338 / 356 us declared for 16 / 64 / 256 requests of up to
16,384 rows: ``bench/bench_cudnn_paged_gpu.py``), so :func:`declared_shape` buckets them to
powers of two and the backend caches one graph per bucket (about 0.2-0.3 s to build after the
first, 1.5-3 s for the first of a process). Every input is made on the device
(:func:`cudnn_paged_inputs`), so the launch replays inside a CUDA graph (checked on the H200).

Unwritten cache slots inside a request's last page are read and masked: they must hold finite
values (a NaN there would turn the masked probabilities' zero products into NaN). The runner
zero-fills its caches, and a slot once written holds a finite K / V. Where one block's bytes
can hold something else first (a Mamba / gated-delta state or another KV dtype in the same
pool), the scheduler asks for every new block to be zeroed (``needs_kv_zeroing``, as vLLM),
so a page reaches this path zeroed or written by the same layout. A caller driving the backend
itself must keep its caches finite the same way (``torch.zeros``, not ``torch.empty``).

Not for: pages of a block size other than a power of two, FP8 caches, sliding windows,
logit soft caps, attention sinks, log-sum-exp outputs (cascade); the Triton kernel serves
those. Availability: CUDA, bf16 / fp16, head size a multiple of 8, the frontend importable
and cuDNN >= 9.5 (paged K / V).
"""

from __future__ import annotations

import atexit
import functools
import gc
import time
import weakref

import torch

from pagedkv.errors import ConfigError

_DTYPES = (torch.bfloat16, torch.float16)
MIN_BACKEND_VERSION = 90500  # paged K / V in cuDNN's fused attention
MIN_DECLARED_ROWS = 1024
MIN_DECLARED_REQS = 8


@functools.lru_cache(maxsize=None)
def frontend():
    """The ``cudnn`` frontend module, or None where it is not installed or cuDNN is too old."""
    try:
        import cudnn  # the nvidia-cudnn-frontend package
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    try:
        if int(cudnn.backend_version()) < MIN_BACKEND_VERSION:
            return None
    except Exception:  # noqa: BLE001
        return None
    return cudnn


def cudnn_paged_available(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether this path can serve a layer: CUDA, bf16 / fp16, ``head_dim % 8 == 0``, the
    frontend importable with cuDNN >= 9.5."""
    return (device.type == "cuda" and dtype in _DTYPES and head_dim % 8 == 0
            and torch.cuda.is_available() and frontend() is not None)


def cudnn_paged_block_size_ok(block_size: int) -> bool:
    """Whether cuDNN's paged K / V load takes pages of ``block_size`` tokens: a power of two
    (its graph check; a hybrid model's attention pages, sized to hold a state's bytes, often
    are not, and the Triton kernel serves those)."""
    return block_size > 0 and block_size & (block_size - 1) == 0


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def declared_shape(num_reqs: int, rows: int) -> tuple[int, int]:
    """``(B, max_q)`` a step of ``num_reqs`` requests over ``rows`` query rows runs declared
    as: each a power of two, at least 8 requests and 1,024 rows."""
    return (_pow2_at_least(num_reqs, MIN_DECLARED_REQS), _pow2_at_least(rows, MIN_DECLARED_ROWS))


def cudnn_paged_inputs(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                       block_table: torch.Tensor, num_reqs: int, batch: int,
                       q_token_stride: int, o_token_stride: int) -> dict:
    """The graph's per-step inputs, made on the device from the metadata (no host read, so a
    CUDA graph replays them): for requests ``r < num_reqs`` with more than one query token,
    ``seq_q[r] = query_len``, ``seq_kv[r] = seq_len``; 0 for the others and for the padding
    requests up to ``batch``; ``q_off`` / ``o_off`` ``[batch + 1]`` the element offsets of each
    request's first row (``query_start_loc x token stride``; padding requests start at the
    last request's end); ``table`` ``[batch, width]`` the block-table rows (zeros past
    ``num_reqs``). All int32, shaped ``[batch (+1), 1, 1, 1]`` / ``[batch, 1, width, 1]``."""
    if not 0 <= num_reqs <= batch:
        raise ConfigError(f"cudnn_paged_inputs: need 0 <= num_reqs ({num_reqs}) <= batch ({batch})")
    dev = query_start_loc.device
    i32 = torch.int32
    qsl = query_start_loc[: num_reqs + 1].to(i32)
    q_lens = qsl[1:] - qsl[:-1]
    take = q_lens > 1
    seq_q = torch.zeros(batch, dtype=i32, device=dev)
    seq_kv = torch.zeros(batch, dtype=i32, device=dev)
    seq_q[:num_reqs] = torch.where(take, q_lens, 0)
    seq_kv[:num_reqs] = torch.where(take, seq_lens[:num_reqs].to(i32), 0)
    starts = qsl[num_reqs:num_reqs + 1].expand(batch + 1).clone()
    starts[: num_reqs + 1] = qsl
    width = block_table.shape[1]
    table = torch.zeros(batch, width, dtype=i32, device=dev)
    table[:num_reqs] = block_table[:num_reqs]
    return {"seq_q": seq_q.view(batch, 1, 1, 1), "seq_kv": seq_kv.view(batch, 1, 1, 1),
            "q_off": (starts * q_token_stride).view(batch + 1, 1, 1, 1),
            "o_off": (starts * o_token_stride).view(batch + 1, 1, 1, 1),
            "table": table.view(batch, 1, width, 1)}


# Every built graph, so that the interpreter's exit can drop their frontend objects first: a
# graph still alive late in the shutdown (a server's engine process, whose engine lives to
# the end) otherwise made the frontend's bindings report "leaked 65 instances!" on stderr.
_LIVE: "weakref.WeakSet[CudnnPagedGraph]" = weakref.WeakSet()


@atexit.register
def release_all() -> None:
    """Drop every live graph's frontend objects (see :meth:`CudnnPagedGraph.release`); run at
    interpreter exit, before the frontend's module is torn down."""
    for graph in list(_LIVE):
        graph.release()
    gc.collect()


class CudnnPagedGraph:
    """One built cuDNN graph (see the module docstring) for ``batch`` requests of up to
    ``max_q`` query rows over a cache half of ``cache_shape`` / ``cache_strides``
    (``[num_blocks, block_size, kv_heads, D]``) and page tables ``width`` columns wide."""

    def __init__(self, *, dtype: torch.dtype, num_heads: int, head_dim: int, batch: int,
                 max_q: int, cache_shape: tuple, cache_strides: tuple, width: int,
                 q_token_stride: int, o_token_stride: int, scale: float,
                 device: torch.device):
        nb, bs, hkv, d = cache_shape
        if d != head_dim or num_heads % hkv:
            raise ConfigError(f"cuDNN paged attention: cache {tuple(cache_shape)} against "
                              f"{num_heads} query heads of {head_dim}")
        if not cudnn_paged_block_size_ok(bs):
            raise ConfigError(f"cuDNN paged attention: pages of {bs} tokens (cuDNN takes a "
                              "power of two)")
        cudnn = frontend()
        if cudnn is None:
            raise ConfigError("cuDNN paged attention needs the nvidia-cudnn-frontend package "
                              "and cuDNN >= 9.5")
        io = {torch.bfloat16: cudnn.data_type.BFLOAT16,
              torch.float16: cudnn.data_type.HALF}[dtype]
        i32 = cudnn.data_type.INT32
        t0 = time.perf_counter()
        with torch.cuda.device(device):
            self.handle = cudnn.create_handle()
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)
        H, D = num_heads, head_dim

        def scalar_per_req(name, n):
            return g.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)

        self.q = g.tensor(name="q", dim=[batch, H, max_q, D],
                          stride=[max_q * q_token_stride, D, q_token_stride, 1], data_type=io)
        self.q_off = scalar_per_req("q_off", batch + 1)
        self.q.set_ragged_offset(self.q_off)
        s_blk, s_tok, s_head, s_d = cache_strides
        pool = [nb, hkv, bs, D]
        pool_stride = [s_blk, s_head, s_tok, s_d]
        self.k = g.tensor(name="k", dim=pool, stride=pool_stride, data_type=io)
        self.v = g.tensor(name="v", dim=pool, stride=pool_stride, data_type=io)
        self.table_k = g.tensor(name="table_k", dim=[batch, 1, width, 1],
                                stride=[width, width, 1, 1], data_type=i32)
        self.table_v = g.tensor(name="table_v", dim=[batch, 1, width, 1],
                                stride=[width, width, 1, 1], data_type=i32)
        self.seq_q = scalar_per_req("seq_q", batch)
        self.seq_kv = scalar_per_req("seq_kv", batch)
        o, _ = g.sdpa(name="sdpa", q=self.q, k=self.k, v=self.v, attn_scale=float(scale),
                      is_inference=True, use_padding_mask=True, seq_len_q=self.seq_q,
                      seq_len_kv=self.seq_kv, paged_attention_k_table=self.table_k,
                      paged_attention_v_table=self.table_v,
                      paged_attention_max_seq_len_kv=width * bs,
                      diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
                      diagonal_band_right_bound=0)
        self.o_off = scalar_per_req("o_off", batch + 1)
        o.set_output(True).set_dim([batch, H, max_q, D]).set_stride(
            [max_q * o_token_stride, D, o_token_stride, 1]).set_ragged_offset(self.o_off)
        self.o = o
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph = g
        self.workspace = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8,
                                     device=device)
        self.build_s = time.perf_counter() - t0
        _LIVE.add(self)

    _FRONTEND_ATTRS = ("graph", "q", "q_off", "k", "v", "table_k", "table_v", "seq_q", "seq_kv",
                       "o", "o_off", "handle", "workspace")

    def release(self) -> None:
        """Drop the frontend's graph, tensors and handle (the graph cannot run after this)."""
        for name in self._FRONTEND_ATTRS:
            self.__dict__.pop(name, None)
        _LIVE.discard(self)

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                 inputs: dict) -> None:
        """Attention of the requests ``inputs`` gives lengths to, into their rows of ``out``,
        on the current stream."""
        frontend().set_stream(handle=self.handle,
                              stream=torch.cuda.current_stream(q.device).cuda_stream)
        self.graph.execute({self.q: q, self.q_off: inputs["q_off"], self.k: kv_cache[0],
                            self.v: kv_cache[1], self.table_k: inputs["table"],
                            self.table_v: inputs["table"], self.seq_q: inputs["seq_q"],
                            self.seq_kv: inputs["seq_kv"], self.o: out,
                            self.o_off: inputs["o_off"]}, self.workspace, handle=self.handle)


__all__ = ["CudnnPagedGraph", "cudnn_paged_available", "cudnn_paged_block_size_ok",
           "cudnn_paged_inputs", "declared_shape", "frontend", "release_all"]
