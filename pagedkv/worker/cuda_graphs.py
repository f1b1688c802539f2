"""CUDA graphs for pure-decode steps (one query token per request) and for mixed steps.

A decode step of ``n`` requests is padded to the smallest captured size ``B >= n`` and replays
the graph captured for ``B``. Padding is the index layer's (``InputPreparer.prepare`` with
``num_reqs_padded = num_tokens_padded = B``): padded requests have 0 query tokens
(``query_start_loc`` repeats its last value) and ``seq_len`` 0, their device block-table rows
hold the null block 0, padded tokens have slot ``-1`` (never written), position 0 and input
id 0. Nothing is rebuilt at replay: the graph reads the runner's persistent device buffers
(the preparer's ``query_start_loc``/``seq_lens``/``positions``/``input_ids``, the block
table's device mirror and slot-mapping rows, the KV caches) at the addresses they had during
capture, and ``prepare`` has just rewritten their contents. The output (hidden states
``[B, hidden]``) is the graph's static tensor; rows ``>= n`` are padding and never read. With
async scheduling the decode rows' input ids are written into the same persistent input-id
buffer on the device (the previous step's sampled ids) after ``prepare`` and before the replay.
The logits (hidden rows ``[:n]`` as they are) and the greedy argmax run eagerly after it.

Host values baked into the captured kernels: ``num_reqs = num_actual_tokens = B``,
``max_query_len = 1`` and ``max_seq_len = max_model_len`` (as ``prepare(...,
for_cudagraph_capture=True)`` defines), so a backend must be correct for every real length up
to ``max_model_len`` under those launch parameters and must never read a device value on the
host. Only backends that declare ``supports_cuda_graphs`` are captured (never the torch
reference, which loops over requests with host lengths); ``enforce_eager`` turns graphs off.
The step's attention plans are made inside each capture (the model plans the capture metadata
when it runs), so a graph owns the workspace its plan allocates.

Graph variants: a backend may bake host decisions besides the size into its launches. Its
``graph_variants(size, num_kv_heads, device)`` lists them (default ``(None,)``: one graph per
size); one graph is captured per (size, value), the capture metadata carrying the fields
``graph_capture_fields(value)`` names (default ``decode_balanced=value``), and a step replays
the value that ``graph_variant(size, num_kv_heads, seq_lens, device, cascade)`` picks from its
actual requests' host lengths and whether every attention group takes cascade attention. The
Triton backend has two values where a batch with balanced lengths launches the decode kernel
as one wave of one range per request (``DecodeConfig``): a few sizes (those with 2-5 decode
programs per multiprocessor); and a ``CASCADE`` graph for sizes of at least its cascade
``min_reqs``, captured with ``use_cascade`` and each group's persistent prefix-length scalar
(``AttentionGroup.common_prefix_len_device``), which the runner writes before a replay: one
graph serves every shared-prefix length.

Mixed-step graphs (on by default, ``EngineConfig.mixed_cuda_graphs``; ``mixed_sizes``, where the
runner finds them safe: ``ModelRunner.mixed_cuda_graphs_supported``): a step that is not a pure decode (prefill chunks,
with or without decode rows) of ``t`` scheduled tokens is padded to the smallest captured token
count ``T >= t`` (:func:`default_mixed_capture_sizes`) and to ``max_num_seqs`` requests, and
replays the graph captured for ``T``: the same padding path (padded requests with 0 query tokens,
padded tokens with slot ``-1``, position 0 and input id 0), and the capture metadata carries
``mixed_graph=True``, ``num_actual_tokens = T``, ``num_reqs = max_num_seqs`` and ``max_query_len =
T``: a backend that declares ``supports_mixed_cuda_graphs`` then launches every kernel of a mixed
step (the decode launch for the one-token rows, the prefill launch for the others, cascade's too)
with grids sized by those bounds alone and reads every length on the device (the Triton backend's
plan, ``TritonPlan``). Eager mixed steps spend ~20-90 ms of host time launching 28 layers (more
than their device time on W3's shared-prefix extends, BENCHMARKS.md); a replay costs one
launch. Measured on the H200 with 16,384 tokens a step: in the eleventh session on a fast host
W3 50,732 / 49,693 and 50,947 / 51,181 output tok/s against 50,055 / 51,062 eager; in the
twenty-second, alternating processes in one lease, W3 50,672 / 50,150 and 50,830 / 50,445
against 45,500 / 47,058 and 47,020 / 47,804 eager (its three prefill-like steps 0.145 s against
0.224-0.251 s), W2 3,717 against 3,712, W1 26,315 against 25,942. In bf16 a padded step's
GEMMs have other row counts (other cuBLAS kernels, other rounding), so its logits differ from
an eager step's by that rounding (7% relative on one step of random weights, 28 layers deep);
in float32 the GPU test (``tests/engine/test_mixed_graphs.py``) matches the eager engine at
1e-3.
Variants: the plain graph and, where cascade attention can run, a ``CASCADE`` graph (the prefix
length read from the group's device scalar, as in decode). Padding costs up to the gap between two
sizes in tokens (the padded rows are computed and never read).

Capture: mixed sizes first (the largest activations), then decode sizes, each from largest to
smallest, all graphs in one memory pool, each on a batch of
``B`` *padded* requests exactly as the index layer pads (0 query tokens, ``seq_len`` 0, null-block
table rows, slots ``-1``, host and device copies consistent), so capture reads no KV and writes
none, and whatever a backend does for padding rows (the Triton backend zeroes output rows past
``query_start_loc[num_reqs]``) is what the graph does for them at every replay. Every size is
first run eagerly twice (Triton compilation, allocator warm-up). Block-table rows used during
capture are set to the null block on the device only; the host copy (the truth) is untouched.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from pagedkv.errors import ConfigError
from pagedkv.worker.metadata import CommonAttentionMetadata, common_metadata_from_inputs

if TYPE_CHECKING:
    from pagedkv.worker.model_runner import ModelRunner


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, ... (multiples of 8) up to ``max_num_seqs``, which is always
    the largest size."""
    if max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def default_mixed_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts of the mixed-step graphs: 512, 1024, 2048, 4096, then every 2048 below
    ``max_num_batched_tokens``, which is always the largest (a step pads up to 2047 tokens at
    most past 4096; below, at most as many as it has). Empty below 2 tokens a step."""
    if max_num_batched_tokens < 2:
        return []
    sizes = [s for s in (512, 1024, 2048, 4096) if s < max_num_batched_tokens]
    sizes += list(range(6144, max_num_batched_tokens, 2048))
    sizes.append(max_num_batched_tokens)
    return sizes


class CudaGraphCapture:
    """How graphs are captured and replayed: ``torch.cuda.CUDAGraph`` in one shared memory
    pool. ``capture(fn)`` runs ``fn`` under capture and returns ``(replay, static output)``.
    (The seam lets a CPU test drive the manager's buffer and padding logic with a stand-in
    that re-executes ``fn`` into the static output.)"""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ConfigError("CUDA graphs need a CUDA device")
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def capture(self, fn) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph.replay, out


class CudaGraphManager:
    """The captured decode graphs of one ``ModelRunner`` (see the module docstring)."""

    def __init__(self, runner: "ModelRunner", sizes: Sequence[int],
                 graph_capture: CudaGraphCapture | None = None,
                 mixed_sizes: Sequence[int] = ()) -> None:
        if graph_capture is None:
            graph_capture = CudaGraphCapture(runner.device)
        max_reqs = runner.input_batch.max_num_reqs
        clean = sorted({int(s) for s in sizes})
        if not clean or clean[0] < 1 or clean[-1] > max_reqs:
            raise ConfigError(
                f"CUDA-graph sizes must lie in [1, max_num_seqs={max_reqs}], got {list(sizes)}"
            )
        if clean[-1] > runner.input_batch.max_num_batched_tokens:
            raise ConfigError("a CUDA-graph size exceeds max_num_batched_tokens")
        self.runner = runner
        self.sizes = clean
        # n -> smallest captured size >= n (0 where none).
        lookup = np.zeros(clean[-1] + 1, dtype=np.int64)
        j = 0
        for n in range(1, clean[-1] + 1):
            while clean[j] < n:
                j += 1
            lookup[n] = clean[j]
        self._lookup = lookup.tolist()
        self._graphs: dict[tuple, tuple[Callable[[], None], torch.Tensor]] = {}
        self.graph_capture = graph_capture
        backend = runner.attn_backend
        hkv = runner.model.config.num_key_value_heads
        self._variants = {s: tuple(backend.graph_variants(s, hkv, runner.device)) for s in clean}
        self._pick = lambda size, seq_lens, cascade: backend.graph_variant(
            size, hkv, seq_lens, runner.device, cascade)
        self._capture_fields = backend.graph_capture_fields
        # mixed-step graphs: token counts, each with the plain and (where cascade attention
        # can run) the CASCADE variant; every one padded to max_num_seqs requests
        mixed = sorted({int(t) for t in mixed_sizes})
        if mixed and (mixed[0] < 2 or mixed[-1] > runner.input_batch.max_num_batched_tokens):
            raise ConfigError(f"mixed CUDA-graph sizes must lie in [2, max_num_batched_tokens="
                              f"{runner.input_batch.max_num_batched_tokens}], got {list(mixed_sizes)}")
        self.mixed_sizes = mixed
        self.mixed_reqs = max_reqs
        self._mixed_variants = tuple(backend.mixed_graph_variants(max_reqs)) if mixed else ()

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    @property
    def num_graphs(self) -> int:
        return (sum(len(v) for v in self._variants.values())
                + len(self.mixed_sizes) * len(self._mixed_variants))

    @property
    def mixed_variants(self) -> tuple:
        """The variants captured for every mixed size (``None``, and ``CASCADE`` where the
        backend's cascade attention can run)."""
        return self._mixed_variants

    def mixed_padded_size(self, num_tokens: int, num_reqs: int) -> int | None:
        """The token count a mixed step of ``num_tokens`` tokens over ``num_reqs`` requests
        replays, or None (eager: no mixed graphs, or more tokens than the largest)."""
        if not self.mixed_sizes or num_reqs > self.mixed_reqs or num_tokens < 1:
            return None
        i = bisect.bisect_left(self.mixed_sizes, num_tokens)
        return self.mixed_sizes[i] if i < len(self.mixed_sizes) else None

    def mixed_variant(self, cascade: bool):
        """The mixed variant to replay: ``CASCADE`` when every attention group takes cascade
        attention and it was captured, else the plain one."""
        v = self._mixed_variants
        return v[-1] if cascade and len(v) > 1 else v[0]

    def variants(self, size: int) -> tuple:
        """The graph variants captured for ``size`` (see the module docstring)."""
        return self._variants[size]

    def variant(self, size: int, seq_lens: np.ndarray, cascade: bool = False):
        """The variant a decode step of ``size`` replays; ``seq_lens``: the host lengths of
        its actual requests; ``cascade``: every attention group takes cascade attention."""
        if len(self._variants[size]) == 1:
            return self._variants[size][0]
        return self._pick(size, seq_lens, cascade)

    def padded_size(self, num_reqs: int) -> int | None:
        """The graph size a decode step of ``num_reqs`` requests replays, or None (eager)."""
        if 0 < num_reqs <= self.sizes[-1]:
            return self._lookup[num_reqs]
        return None

    # ----- capture -------------------------------------------------------------------------
    def _capture_inputs(self, size: int, variant=None):
        """Fill the persistent buffers with ``size`` padded requests and return ``(input ids,
        positions, step, metadata)``: views of them and the decode metadata the replays stand
        for. The padding is written by the one padding path, ``InputPreparer.prepare`` (here
        on the empty batch with ``num_reqs_padded = num_tokens_padded = size``); the metadata
        is the step's (``common_metadata_from_inputs``) with the values a replay bakes in:
        ``num_reqs = num_actual_reqs = num_actual_tokens = size``, ``max_query_len`` 1,
        ``max_seq_len`` ``max_model_len``, and the variant's ``graph_capture_fields``."""
        r = self.runner
        batch = r.input_batch
        step = r.preparer.prepare(batch, np.zeros(0, dtype=np.int32), num_reqs_padded=size,
                                  num_tokens_padded=size, for_cudagraph_capture=True)
        md = dataclasses.replace(common_metadata_from_inputs(step, batch.block_table),
                                 num_actual_reqs=size, max_query_len=1,
                                 **self._capture_fields(variant))
        return step.input_ids, step.positions, step, md

    def _mixed_capture_inputs(self, num_tokens: int, variant=None):
        """As :meth:`_capture_inputs` for the mixed graph of ``num_tokens`` tokens: the empty
        batch padded to ``max_num_seqs`` requests and ``num_tokens`` tokens; the metadata's
        baked values are ``mixed_graph=True``, ``num_actual_reqs = max_num_seqs``,
        ``max_query_len = num_tokens`` and the variant's ``mixed_graph_capture_fields``."""
        r = self.runner
        batch = r.input_batch
        step = r.preparer.prepare(batch, np.zeros(0, dtype=np.int32),
                                  num_reqs_padded=self.mixed_reqs, num_tokens_padded=num_tokens,
                                  for_cudagraph_capture=True)
        md = dataclasses.replace(common_metadata_from_inputs(step, batch.block_table),
                                 num_actual_reqs=self.mixed_reqs, max_query_len=num_tokens,
                                 mixed_graph=True,
                                 **r.attn_backend.mixed_graph_capture_fields(variant))
        return step.input_ids, step.positions, step, md

    @torch.inference_mode()
    def capture(self, warmup: int = 2) -> None:
        """Capture every size (and variant). Each run, eager warm-up or capture, makes its own
        attention plans (``ModelRunner.attention_for`` inside the captured function): a graph
        owns what its plans allocate."""
        r = self.runner
        model = r.model
        if r.input_batch.num_reqs:
            raise ConfigError("capture CUDA graphs before any request runs")
        gc = self.graph_capture
        todo = [(("mixed", t), v, self._mixed_capture_inputs)
                for t in reversed(self.mixed_sizes) for v in self._mixed_variants]
        todo += [(size, v, self._capture_inputs)
                 for size in reversed(self.sizes) for v in self._variants[size]]
        for key, variant, inputs in todo:
            ids, pos, step, md = inputs(key[1] if isinstance(key, tuple) else key, variant)

            def run(ids=ids, pos=pos, step=step, md=md):
                return model(ids, pos, r.kv_caches,
                             r.attention_for(step, md, for_cudagraph_capture=True))

            for _ in range(warmup):
                run()
            gc.synchronize()
            replay, out = self._graphs[(key, variant)] = gc.capture(run)
            # one replay on the capture's own inputs (the warm-up runs' computation again):
            # a graph's first launch also uploads it to the device, which costs milliseconds
            # (W3's first replays of its 256-request cascade graph: ~10 ms steps against 4.4)
            replay()
        gc.synchronize()

    # ----- replay --------------------------------------------------------------------------
    def replay(self, size: int, variant=None) -> torch.Tensor:
        """Replay the graph of ``size`` and ``variant`` (:meth:`variant`; the persistent
        buffers must hold a step prepared with ``num_reqs_padded = num_tokens_padded = size``);
        returns hidden ``[size, hidden]``."""
        replay, out = self._graphs[(size, variant)]
        replay()
        return out

    def replay_mixed(self, num_tokens: int, variant=None) -> torch.Tensor:
        """Replay the mixed graph of ``num_tokens`` tokens (:meth:`mixed_padded_size`) and
        ``variant`` (:meth:`mixed_variant`; the persistent buffers must hold a step prepared
        with ``num_reqs_padded = max_num_seqs`` and ``num_tokens_padded = num_tokens``);
        returns hidden ``[num_tokens, hidden]``."""
        replay, out = self._graphs[(("mixed", num_tokens), variant)]
        replay()
        return out


__all__ = ["CudaGraphCapture", "CudaGraphManager", "default_capture_sizes",
           "default_mixed_capture_sizes"]
