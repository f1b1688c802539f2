"""ModelRunner: one engine step on the worker, from a ``SchedulerOutput`` to sampled tokens.

``execute_model(scheduler_output)``, in order:

1. ``update_states``: the persistent batch follows the scheduler (finished rows dropped,
   new/resumed rows added, block tables appended, rows condensed and, if the attention backend
   asks for it, reordered); blocks the scheduler asks to zero are zeroed, then copy-on-write
   pairs are copied, before any forward pass reads them;
2. ``InputPreparer.prepare``: commit of the block table first, vectorised numpy index math,
   host -> device copies, slot mapping on the device (one kernel for all groups). Pure-decode
   batches that fit a captured CUDA graph are padded to the graph's size exactly as the index
   layer defines padding (null-block rows, ``-1`` slots, ``seq_len`` 0);
3. attention metadata (:class:`CommonAttentionMetadata`: the group's device block table and
   slot-mapping row), the forward pass (or the graph replay);
4. logits only for rows that complete their known tokens this step: a partial-prefill chunk
   samples nothing and reports ``[]``;
5. sampling with each request's :class:`~pagedkv.sampling.params.SamplingParams` (the sampling
   metadata is rebuilt only when the set of sampled rows changes; seeded requests keep their own
   generator in their :class:`CachedRequestState` for their whole life, preemptions included);
6. ``record_sampled_tokens`` and a :class:`RunnerOutput` (``ModelRunnerOutput`` plus the
   requested logprobs).

The step has one device -> host sync: the sampled ids.

The runner serves the decoder models of ``pagedkv.models``: every attention layer in one
full-attention KV-cache group, one KV tensor per layer
(``[2, num_blocks, block_size, num_kv_heads, head_dim]``).

``profile_peak_memory`` runs the largest forward (and sampling) the configuration allows on a
throw-away one-block cache, to size the KV pool from the memory left (see
``pagedkv.engine.memory``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from pagedkv.attention.backend import AttentionBackend
from pagedkv.config import CacheConfig, SchedulerConfig
from pagedkv.core.output import ModelRunnerOutput, SchedulerOutput
from pagedkv.core.spec import AttentionSpec, FullAttentionSpec, KVCacheConfig
from pagedkv.errors import ConfigError, InvariantError
from pagedkv.sampling.metadata import SamplingMetadata
from pagedkv.sampling.params import SamplingParams
from pagedkv.sampling.sampler import Sampler
from pagedkv.worker.input_batch import CachedRequestState, InputBatch
from pagedkv.worker.inputs import InputPreparer, StepInputs
from pagedkv.worker.metadata import CommonAttentionMetadata, common_metadata_from_inputs
from pagedkv.worker.state_update import StateUpdate, record_sampled_tokens, update_states

# Requests that carry no SamplingParams (driven directly through the scheduler) decode greedily.
_GREEDY = SamplingParams(temperature=0.0)


def attention_layer_names(num_layers: int) -> tuple[str, ...]:
    """KV-cache layer names of the decoder models, in layer order."""
    return tuple(f"model.layers.{i}.self_attn" for i in range(num_layers))


def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def backend_is_graph_capturable(backend: Any) -> bool:
    """Whether ``backend`` may be captured in a CUDA graph: its ``cuda_graph_capturable``
    attribute, else True only for the Triton backend (the torch reference reads host copies of
    the lengths per request, so a graph would freeze them)."""
    flag = getattr(backend, "cuda_graph_capturable", None)
    if flag is not None:
        return bool(flag)
    return getattr(backend, "name", "") == "triton"


def kv_cache_spec_for(model: Any, block_size: int) -> FullAttentionSpec:
    """The full-attention spec of ``model``'s layers (KV in the model's dtype)."""
    cfg = model.config
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=cfg.num_key_value_heads,
        head_size=cfg.head_dim,
        dtype=torch_dtype_name(model.dtype),
    )


@dataclass
class SampledLogprobs:
    """Logprobs of one sampled token: ``token_ids[0]``/``logprobs[0]`` are the sampled token,
    then the request's top ``k`` alternatives, most likely first; ``rank`` is the sampled
    token's rank (1 = most likely)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class RunnerOutput(ModelRunnerOutput):
    """``ModelRunnerOutput`` plus, for requests that asked for logprobs and sampled this step,
    their :class:`SampledLogprobs` (``None`` when nobody asked)."""

    logprobs: dict[str, SampledLogprobs] | None = None


class ModelRunner:
    """Owns the persistent batch, the request states, the input preparer, the per-layer KV
    caches, the sampler and (optionally) the CUDA graphs of one model.

    ``kv_cache_config``: one full-attention group holding every layer (build it with
    :func:`kv_cache_spec_for` and :func:`attention_layer_names`). ``attn_backend``: installed
    into the model when given. ``sampler``: default ``Sampler`` whose unseeded stream starts
    from ``seed``. CUDA graphs are captured by :meth:`capture_cuda_graphs` (on a CUDA device,
    with a graph-capturable backend, unless ``enforce_eager``).
    """

    def __init__(
        self,
        model: Any,
        kv_cache_config: KVCacheConfig,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig | None = None,
        *,
        device: str | torch.device | None = None,
        attn_backend: AttentionBackend | None = None,
        sampler: Sampler | None = None,
        seed: int = 0,
        enforce_eager: bool = True,
        cuda_graph_sizes: Sequence[int] | None = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device) if device is not None else model.device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if model.device.type != self.device.type:
            raise ConfigError(f"the model lives on {model.device}, the runner was asked for {self.device}")
        if attn_backend is not None:
            model.set_attention_backend(attn_backend)
        self.attn_backend = model.attn_backend
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_config = kv_cache_config
        self._check_kv_cache_config(kv_cache_config)
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = spec.block_size
        self.num_blocks = kv_cache_config.num_blocks
        sc = scheduler_config
        self.max_model_len = sc.max_model_len
        self.input_batch = InputBatch(
            max_num_reqs=sc.max_num_seqs,
            max_model_len=sc.max_model_len,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            device=self.device,
            pin_memory=self.device.type == "cuda",
            block_sizes=[spec.block_size],
            max_num_blocks_per_req=[spec.max_num_blocks_per_req(sc.max_model_len)],
            slot_mapping_modes=[spec.slot_mapping_mode],
        )
        self.requests: dict[str, CachedRequestState] = {}
        self.preparer = InputPreparer.for_batch(self.input_batch)
        self.kv_caches: list[torch.Tensor] = model.allocate_kv_caches(
            self.num_blocks, self.block_size, dtype=model.dtype, device=self.device, fill=0.0
        )
        if sampler is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            sampler = Sampler(generator=gen)
        self.sampler = sampler
        self.reorder_threshold = getattr(self.attn_backend, "reorder_batch_threshold", None)
        self.enforce_eager = enforce_eager
        self.cuda_graph_sizes = cuda_graph_sizes
        self.cuda_graphs = None  # a CudaGraphManager once captured
        # Sampling metadata cache: (req ids of the sampled rows) -> metadata.
        self._sampling_key: tuple[str, ...] | None = None
        self._sampling_md: SamplingMetadata | None = None
        self._sampling_wants_logprobs: list[int | None] = []
        # Output row lists, reused while the batch does not change.
        self._out_ids: list[str] = []
        self._out_index: dict[str, int] = {}
        self.num_steps = 0
        self.num_graph_steps = 0

    # ----- setup ---------------------------------------------------------------------------
    def _check_kv_cache_config(self, kv: KVCacheConfig) -> None:
        groups = kv.kv_cache_groups
        n_layers = len(self.model.layers)
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
            raise ConfigError(
                f"the model runner serves one full-attention KV-cache group, got "
                f"{[type(g.kv_cache_spec).__name__ for g in groups]}"
            )
        names = tuple(groups[0].layer_names)
        if names != attention_layer_names(n_layers):
            raise ConfigError(
                f"the KV-cache group must list the model's {n_layers} attention layers in order "
                f"(attention_layer_names({n_layers})), got {names[:3]}..."
            )
        spec = groups[0].kv_cache_spec
        cfg = self.model.config
        if (spec.num_kv_heads, spec.head_size) != (cfg.num_key_value_heads, cfg.head_dim):
            raise ConfigError(
                f"KV-cache spec has {spec.num_kv_heads} KV heads of size {spec.head_size}, the "
                f"model {cfg.num_key_value_heads} of size {cfg.head_dim}"
            )
        if spec.dtype != torch_dtype_name(self.model.dtype):
            raise ConfigError(
                f"KV-cache spec dtype {spec.dtype} differs from the model dtype "
                f"{torch_dtype_name(self.model.dtype)}"
            )

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    def cuda_graphs_supported(self) -> bool:
        """A CUDA device and a backend that declares itself graph-capturable."""
        return self.device.type == "cuda" and backend_is_graph_capturable(self.attn_backend)

    def capture_cuda_graphs(self) -> int:
        """Capture the pure-decode graphs (see ``pagedkv.worker.cuda_graphs``). Returns the
        number of graphs (0 when graphs are off or unsupported)."""
        if self.enforce_eager or not self.cuda_graphs_supported():
            return 0
        from pagedkv.worker.cuda_graphs import CudaGraphManager, default_capture_sizes

        sizes = self.cuda_graph_sizes or default_capture_sizes(self.scheduler_config.max_num_seqs)
        mgr = CudaGraphManager(self, sizes)
        mgr.capture()
        self.cuda_graphs = mgr
        return len(mgr.sizes)

    # ----- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        upd = update_states(self.requests, self.input_batch, scheduler_output, self.reorder_threshold)
        self._apply_block_ops(upd)
        batch = self.input_batch
        n = batch.num_reqs
        if n == 0 or scheduler_output.total_num_scheduled_tokens == 0:
            return RunnerOutput([], {}, [])
        self.num_steps += 1
        if upd.batch_changed or len(self._out_ids) != n:
            self._out_ids = list(batch.req_ids[:n])
            self._out_index = {rid: i for i, rid in enumerate(self._out_ids)}
        nsched = batch.scheduled_tokens_per_row(scheduler_output.num_scheduled_tokens)
        num_tokens = int(nsched.sum())

        graph_size = None
        if self.cuda_graphs is not None and num_tokens == n:
            graph_size = self.cuda_graphs.padded_size(n)
        if graph_size is not None:
            step = self.preparer.prepare(batch, nsched, graph_size, graph_size)
            hidden = self.cuda_graphs.replay(graph_size)
            self.num_graph_steps += 1
        else:
            step = self.preparer.prepare(batch, nsched)
            metadata = common_metadata_from_inputs(step, batch.block_table)
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, metadata)

        # Rows whose known tokens are all computed after this step sample one token.
        computed = batch.num_computed_tokens_cpu[:n]
        sample = (computed + nsched) >= batch.num_tokens[:n]
        if sample.all():
            rows = None
            logits_indices = step.logits_indices
        else:
            rows = np.flatnonzero(sample)
            if rows.size == 0:
                return RunnerOutput(self._out_ids, self._out_index, [[] for _ in range(n)])
            ends = np.cumsum(nsched, dtype=np.int64) - 1
            logits_indices = torch.from_numpy(ends[rows]).to(self.device, non_blocking=True)
        logits = self.model.compute_logits(hidden, logits_indices)
        out = self._sample(logits, rows, n)
        sampled_ids = out.tolist()

        if rows is None:
            sampled = [[t] for t in sampled_ids]
        else:
            sampled = [[] for _ in range(n)]
            for j, r in enumerate(rows.tolist()):
                sampled[r] = [sampled_ids[j]]
        record_sampled_tokens(self.requests, batch, sampled)
        logprobs = self._logprobs(out, rows, n) if out.logprobs is not None else None
        return RunnerOutput(self._out_ids, self._out_index, sampled, logprobs)

    def _apply_block_ops(self, upd: StateUpdate) -> None:
        """Zero the blocks the scheduler asks for, then apply copy-on-write pairs."""
        if upd.block_ids_to_zero:
            ids = torch.tensor(upd.block_ids_to_zero, dtype=torch.int64, device=self.device)
            for kv in self.kv_caches:
                kv.index_fill_(1, ids, 0)
        if upd.block_copies:
            src = torch.tensor([s for s, _ in upd.block_copies], dtype=torch.int64, device=self.device)
            dst = torch.tensor([d for _, d in upd.block_copies], dtype=torch.int64, device=self.device)
            for kv in self.kv_caches:
                kv[:, dst] = kv[:, src]

    def _sample(self, logits: torch.Tensor, rows: np.ndarray | None, n: int):
        batch = self.input_batch
        ids = batch.req_ids
        key = tuple(ids[:n]) if rows is None else tuple(ids[r] for r in rows.tolist())
        if key != self._sampling_key:
            states = [self.requests[rid] for rid in key]
            params = [
                st.sampling_params if isinstance(st.sampling_params, SamplingParams) else _GREEDY
                for st in states
            ]
            gens = {i: st.generator for i, st in enumerate(states) if st.generator is not None}
            md = SamplingMetadata.build(params, self.device, gens)
            for i, g in md.generators.items():
                states[i].generator = g
            self._sampling_key = key
            self._sampling_md = md
            self._sampling_wants_logprobs = [p.logprobs for p in params]
        return self.sampler(logits, self._sampling_md)

    def _logprobs(self, out, rows: np.ndarray | None, n: int) -> dict[str, SampledLogprobs]:
        token_ids, values, ranks = out.logprobs.tolists()
        row_list = range(n) if rows is None else rows.tolist()
        ids = self.input_batch.req_ids
        result: dict[str, SampledLogprobs] = {}
        for j, r in enumerate(row_list):
            k = self._sampling_wants_logprobs[j]
            if k is None:
                continue
            result[ids[r]] = SampledLogprobs(token_ids[j][: k + 1], values[j][: k + 1], ranks[j])
        return result

    # ----- inspection ----------------------------------------------------------------------
    def metadata_for(self, step: StepInputs) -> CommonAttentionMetadata:
        """The attention metadata of a prepared step (what ``execute_model`` hands the model)."""
        return common_metadata_from_inputs(step, self.input_batch.block_table)


# --------------------------------------------------------------------------------------------
# Memory profiling (KV-pool sizing on a GPU)


def _profile_metadata(num_tokens: int, max_model_len: int, block_size: int, device: torch.device):
    """Metadata of a prefill of ``num_tokens`` tokens split into requests of at most
    ``max_model_len`` tokens, every block-table entry the null block, every slot -1."""
    from pagedkv.attention.metadata import build_attention_metadata

    lens = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lens.append(num_tokens % max_model_len)
    width = -(-max_model_len // block_size)
    table = torch.zeros(len(lens), width, dtype=torch.int32, device=device)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    return build_attention_metadata(lens, lens, table, slots, device=device)


@torch.inference_mode()
def profile_peak_memory(
    model: Any,
    scheduler_config: SchedulerConfig,
    block_size: int,
    sampler: Sampler | None = None,
) -> int:
    """Peak bytes of activations (beyond what is allocated before the call) of the largest step:
    a forward over ``max_num_batched_tokens`` tokens, logits for ``max_num_seqs`` rows and a
    top-k/top-p sampling pass over them. CUDA only."""
    device = model.device
    if device.type != "cuda":
        raise ConfigError("profile_peak_memory needs a CUDA model; size CPU pools from a byte budget")
    sc = scheduler_config
    num_tokens = sc.max_num_batched_tokens
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    caches = model.allocate_kv_caches(1, block_size, device=device, fill=0.0)
    md = _profile_metadata(num_tokens, sc.max_model_len, block_size, device)
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), device=device, generator=gen)
    pos = torch.cat([torch.arange(n, device=device) for n in md.seq_lens_cpu.tolist()])
    hidden = model(ids, pos, caches, md)
    rows = min(sc.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden, torch.arange(rows, device=device))
    del hidden
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, logprobs=5)] * rows
    (sampler or Sampler())(logits, SamplingMetadata.build(params, device))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del logits, caches, md
    torch.cuda.empty_cache()
    if peak < 0:
        raise InvariantError("profile", "negative peak memory", peak=peak)
    return int(peak)


__all__ = [
    "ModelRunner",
    "RunnerOutput",
    "SampledLogprobs",
    "attention_layer_names",
    "backend_is_graph_capturable",
    "kv_cache_spec_for",
    "profile_peak_memory",
]
