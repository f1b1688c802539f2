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
   slot-mapping row; with a backend that ``supports_cascade``, each group's shared prefix of
   the step, :func:`~pagedkv.worker.metadata.cascade_prefix_lens` of the scheduler's
   ``num_common_prefix_blocks``), the forward pass (or the graph replay: the ``CASCADE``
   graph where every attention group's plan would take cascade attention, its prefix
   lengths written into the groups' device scalars first);
4. logits only for rows that complete their known tokens this step: a partial-prefill chunk
   samples nothing and reports ``[]``; a pure-decode step projects the hidden rows as they are
   (no gather). With CUDA graphs the projected row count is padded to a graph size (a replay
   projects its padded rows; gathered rows repeat the last one), so the LM-head GEMM only sees
   shapes warmed at capture; the extra rows are dropped before sampling;
5. sampling: when every request of the batch is greedy without logprobs, min_tokens or
   penalties (cached per batch composition), the model's ``greedy_tokens``: the argmax of the
   model-dtype logits (``pagedkv.kernels.argmax.argmax_rows``: two Triton launches on CUDA; no
   float32 copy, no metadata), or for a plain LM head and at most 64 sampled rows on CUDA the
   LM head and the argmax in one pass that never writes the logits
   (``pagedkv.kernels.lm_head_argmax``); otherwise the :class:`~pagedkv.sampling.sampler.Sampler` with
   the batch's :class:`~pagedkv.worker.sampling_state.SamplingState` (metadata, min_tokens
   bans and penalty counts, rebuilt only when the set of sampled rows changes; seeded requests
   keep their own generator in their :class:`CachedRequestState` for their whole life,
   preemptions included);
6. the sampled ids go to one of two pinned host buffers (non-blocking copy + a CUDA event);
   ``get_output`` waits for that event (the step's one device -> host sync), writes the tokens
   into the batch's token table (vectorised) and the request states, and returns a
   :class:`RunnerOutput` (``ModelRunnerOutput`` plus the requested logprobs).

``execute_model`` is ``execute_model_async`` (steps 1-6 up to the enqueued copy) followed by
``get_output``. Async scheduling (``pagedkv.engine.async_scheduler``) calls them separately:
step k is enqueued before step k-1's output is collected. Rows whose first token this step is
the one step k-1 sampled (not on the host yet) then get a placeholder in the batch's token count
(so input preparation accepts them) and, after input preparation, step k-1's sampled ids are
copied into the persistent input-id buffer on the device (one device copy when the batch did not
change, else an ``index_copy_``), before the forward pass or the graph replay reads it. When step
k-1's output is collected, its tokens overwrite the placeholders. At most one step may be in
flight when the next one is enqueued.

The runner serves the decoder models of ``pagedkv.models``: every attention layer in one
full-attention KV-cache group, one KV tensor per layer
(``[2, num_blocks, block_size, num_kv_heads, head_dim]``; DeepSeek-V3's latent attention:
one ``MLAAttentionSpec`` group, ``[num_blocks, block_size, latent_dim]`` per layer).

``profile_peak_memory`` runs the largest forward (and sampling) the configuration allows on a
throw-away one-block cache, to size the KV pool from the memory left (see
``pagedkv.engine.memory``).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from pagedkv.attention.backend import AttentionBackend, AttentionLayout, StepAttention
from pagedkv.config import CacheConfig, SchedulerConfig, kv_cache_dtype_name
from pagedkv.core.output import ModelRunnerOutput, SchedulerOutput
from pagedkv.core.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaCacheMode,
    MambaSpec,
    MLAAttentionSpec,
    with_kv_cache_dtype,
)
from pagedkv.errors import ConfigError, InvariantError
from pagedkv.kernels.argmax import argmax_rows
from pagedkv.sampling.metadata import SamplingMetadata
from pagedkv.sampling.params import SamplingParams
from pagedkv.sampling.sampler import LogprobsTensors, Sampler
from pagedkv.worker.input_batch import CachedRequestState, InputBatch
from pagedkv.worker.inputs import InputPreparer, StepInputs
from pagedkv.worker.async_output import (  # noqa: F401 - re-exported
    AsyncOutputs,
    RunnerOutput,
    SampledLogprobs,
    StepHandle,
)
from pagedkv.worker.attn_builders import CommonMetadataBuilder, MambaMetadataBuilder
from pagedkv.worker.kv_caches import allocate_group_kv_caches, allocate_kv_pool
from pagedkv.worker.metadata import (
    CommonAttentionMetadata,
    build_attention_metadata,
    cascade_prefix_lens,
    common_metadata_from_inputs,
    make_attention_groups,
    set_common_prefix_lens,
)
from pagedkv.worker.sampling_state import SamplingState
from pagedkv.worker.state_update import StateUpdate, update_states

# Requests that carry no SamplingParams (driven directly through the scheduler) decode greedily.


def attention_layer_names(num_layers: int) -> tuple[str, ...]:
    """KV-cache layer names of the decoder models, in layer order."""
    return tuple(f"model.layers.{i}.self_attn" for i in range(num_layers))


def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_cache_spec_for(model: Any, block_size: int) -> FullAttentionSpec:
    """The full-attention spec of ``model``'s layers (KV in the model's dtype); for a model
    whose layers all cache latents (DeepSeek-V3), their ``MLAAttentionSpec``."""
    cfg = model.config
    if getattr(cfg, "mla", None) is not None:
        specs = set(model.kv_cache_specs(block_size).values())
        if len(specs) == 1 and isinstance(next(iter(specs)), MLAAttentionSpec):
            return specs.pop()
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=cfg.num_key_value_heads,
        head_size=cfg.head_dim,
        dtype=torch_dtype_name(model.dtype),
    )


def served_kv_cache_specs(model: Any, block_size: int, kv_cache_dtype: str = "auto") -> dict:
    """``model.kv_cache_specs(block_size)`` as the engine serves them with the option
    ``kv_cache_dtype`` (``pagedkv.config.KV_CACHE_DTYPES``): "auto" as declared (the model's
    dtype), "fp8" with the attention layers' paged K/V in ``float8_e4m3fn``
    (``with_kv_cache_dtype``: latent and state layers keep theirs)."""
    dtype = kv_cache_dtype_name(kv_cache_dtype)
    specs = model.kv_cache_specs(block_size)
    if dtype is None:
        return specs
    return {name: with_kv_cache_dtype(s, dtype) for name, s in specs.items()}


def kv_cache_groups_for(model: Any, block_size: int, *, max_model_len: int | None = None,
                        enable_prefix_caching: bool = False,
                        kv_cache_dtype: str = "auto") -> list[KVCacheGroupSpec]:
    """The model's KV-cache groups: each cache layer's spec (:func:`served_kv_cache_specs`:
    ``model.kv_cache_specs`` with the attention caches in ``kv_cache_dtype``, in the
    model's cache-layer order) formed into groups by the planner
    (``pagedkv.core.planning.get_kv_cache_groups``: equal specs share one group; full and
    sliding-window layers form a hybrid of several groups). A state-space hybrid's specs are
    first made what the engine serves (``hybrid_state_specs``: Mamba mode from
    ``enable_prefix_caching``, state block size ``max_model_len`` in mode none, attention block
    size raised so its page holds a state page); ``max_model_len`` is then required."""
    from pagedkv.core.planning import get_kv_cache_groups, hybrid_state_specs

    specs = served_kv_cache_specs(model, block_size, kv_cache_dtype)
    if any(isinstance(s, MambaSpec) for s in specs.values()):
        if max_model_len is None:
            raise ConfigError("a model with state layers needs max_model_len to plan its groups")
        specs, _ = hybrid_state_specs(specs, block_size=block_size, max_model_len=max_model_len,
                                      enable_prefix_caching=enable_prefix_caching)
    return get_kv_cache_groups(specs)


def cache_layer_names(model: Any) -> tuple[str, ...]:
    """The model's cache layers in its order (the keys of ``model.kv_cache_specs``): what
    ``kv_caches[k]`` and ``StepAttention.plans[k]`` of a forward pass belong to."""
    return tuple(model.kv_cache_specs(16))


def _same_layer_spec(declared, served) -> bool:
    """Whether a group's spec serves a layer that declares ``declared``: equal, or (a state
    layer) equal up to what the engine decides for it (block size, mode, padded page)."""
    if declared == served:
        return True
    if isinstance(declared, MambaSpec) and isinstance(served, MambaSpec):
        return (declared.shapes, declared.dtypes, declared.num_speculative_blocks) == (
            served.shapes, served.dtypes, served.num_speculative_blocks)
    return False


class ModelRunner:
    """Owns the persistent batch, the request states, the input preparer, the per-layer KV
    caches, the sampler and (optionally) the CUDA graphs of one model.

    ``kv_cache_config``: every cache layer of the model (:func:`cache_layer_names`) in exactly
    one group (build the groups with :func:`kv_cache_groups_for`): attention groups
    (full, sliding-window, latent) and state groups (``MambaSpec``: block tables of state
    indices, no slot mapping; their layers get ``MambaMetadata`` as their plan and a tuple of
    state tensors as their cache). ``attn_backend``: installed
    into the model when given. ``sampler``: default ``Sampler`` whose unseeded stream starts
    from ``seed``. CUDA graphs are captured by :meth:`capture_cuda_graphs` (on a CUDA device,
    with a graph-capturable backend, unless ``enforce_eager``). ``cp_world_size`` /
    ``cp_rank`` / ``cp_interleave``: decode context parallelism (a rank of a DCP group: its
    block tables' slot mappings keep its interleaved share of the tokens, -1 for the others,
    and the step's ``dcp_local_seq_lens`` count them; reference sec. 12).
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
        mixed_cuda_graphs: bool = False,
        cp_world_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
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
        # the attention caches' dtype option (the specs' dtype; "auto": the model's)
        self.kv_cache_dtype = cache_config.cache_dtype if cache_config is not None else "auto"
        self.layer_names = cache_layer_names(model)
        self._check_kv_cache_config(kv_cache_config)
        groups = kv_cache_config.kv_cache_groups
        specs = [g.kv_cache_spec for g in groups]
        # the attention groups' block size (group 0's when every group is a state group)
        self.block_size = next((s.block_size for s in specs if not isinstance(s, MambaSpec)),
                               specs[0].block_size)
        self.num_blocks = kv_cache_config.num_blocks
        sc = scheduler_config
        self.max_model_len = sc.max_model_len
        self.input_batch = InputBatch(
            max_num_reqs=sc.max_num_seqs,
            max_model_len=sc.max_model_len,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            device=self.device,
            pin_memory=self.device.type == "cuda",
            block_sizes=[s.block_size for s in specs],
            max_num_blocks_per_req=[s.max_num_blocks_per_req(sc.max_model_len) for s in specs],
            slot_mapping_modes=[s.slot_mapping_mode for s in specs],
            cp_world_size=cp_world_size, cp_rank=cp_rank, cp_interleave=cp_interleave,
        )
        self.requests: dict[str, CachedRequestState] = {}
        self.preparer = InputPreparer.for_batch(self.input_batch)
        self.preparer.decode_order_enabled = bool(getattr(self.attn_backend,
                                                          "wants_decode_order", False))
        # one tensor per layer, shared across groups by position (the hybrid allocator's
        # layout); a state layer's entry is the tuple of its state tensors
        self.kv_pool = allocate_kv_pool(kv_cache_config, self.layer_names, device=self.device,
                                        fill=0.0)
        self.kv_caches: list = self.kv_pool.caches
        # per KV-cache group: its metadata builder (the backend's for the group's spec,
        # metadata_builder_for; a state group's MambaMetadataBuilder) and the layout its
        # plan serves (None: a state group, whose plan is its MambaMetadata)
        builder_for = self.attn_backend.metadata_builder_for
        self._state_groups = [gid for gid, s in enumerate(specs) if isinstance(s, MambaSpec)]
        self.attn_groups = make_attention_groups(
            kv_cache_config,
            [MambaMetadataBuilder if isinstance(s, MambaSpec)
             else builder_for(s) or CommonMetadataBuilder for s in specs],
            self.input_batch.block_table)
        group_of = {name: gid for gid, g in enumerate(groups) for name in g.layer_names}
        self._layer_group = [group_of[name] for name in self.layer_names]
        self._layouts = [None if isinstance(s, MambaSpec)
                         else dataclasses.replace(model.attention_layout(s), device=self.device)
                         for s in specs]
        # manager block size per group (the unit of the scheduler's num_common_prefix_blocks)
        self._group_block_sizes = [s.block_size for s in specs]
        if sampler is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            sampler = Sampler(generator=gen)
        self.sampler = sampler
        self.reorder_threshold = self.attn_backend.reorder_batch_threshold
        if self._state_groups:  # state mixers take their one-token rows first
            self.reorder_threshold = 1
        self.enforce_eager = enforce_eager
        self.cuda_graph_sizes = cuda_graph_sizes
        self.mixed_cuda_graphs = mixed_cuda_graphs  # also capture mixed steps where supported
        self.cuda_graphs = None  # a CudaGraphManager once captured
        # called with every step's prepared inputs before the forward pass (the engine's
        # sanitizer: pagedkv.sanitizer.check_step), padding for CUDA graphs included
        self.step_check = None
        # Sampling metadata, min_tokens bans and penalty counts per batch composition; its EOS
        # ids are those min_tokens keeps from being sampled early (the engine sets the ids it
        # stops on; default: the model config's)
        self.sampling = SamplingState(
            self.device, model.config.vocab_size, self._to_device,
            tuple(getattr(model.config, "eos_token_ids", ()) or ()))
        # Output row lists, reused while the batch does not change.
        self._out_ids: list[str] = []
        self._out_index: dict[str, int] = {}
        self.num_steps = 0
        self.num_graph_steps = 0
        self.num_mixed_graph_steps = 0
        # Bumped whenever rows move (add/remove/condense/reorder): rows of an enqueued step
        # stay valid while it is unchanged.
        self._batch_version = 0
        # enqueued steps whose sampled ids are not collected yet, their pinned host buffers and
        # events, and the async placeholders (``pagedkv.worker.async_output``)
        self.outputs = AsyncOutputs(self.input_batch, self.requests, self.device,
                                    sc.max_num_seqs, self._to_device)
        self._greedy_tokens_fn = getattr(model, "greedy_tokens", None)
        try:
            self._logits_widen_kw = "widen" in inspect.signature(model.compute_logits).parameters
        except (TypeError, ValueError):
            self._logits_widen_kw = False
    # ----- setup ---------------------------------------------------------------------------
    def _check_kv_cache_config(self, kv: KVCacheConfig) -> None:
        """Every cache layer of the model in exactly one group, each group's spec (a
        ``UniformTypeKVCacheSpecs`` group's member spec) the one the model declares for its
        layers (``model.kv_cache_specs`` in the cache config's ``cache_dtype``,
        :func:`served_kv_cache_specs`; a state layer's up to the block size, mode and page the
        engine chose)."""
        groups = kv.kv_cache_groups
        if not groups:
            raise ConfigError("the KV-cache config has no group; the model's cache layers "
                              "need one (kv_cache_groups_for(model, block_size))")
        names = [n for g in groups for n in g.layer_names]
        if sorted(names) != sorted(self.layer_names) or len(set(names)) != len(names):
            raise ConfigError(
                f"the KV-cache groups must list each of the model's {len(self.layer_names)} "
                f"cache layers (cache_layer_names) exactly once, got {names[:3]}...")
        for gid, g in enumerate(groups):
            spec = g.kv_cache_spec
            want = served_kv_cache_specs(self.model, spec.block_size, self.kv_cache_dtype)
            bad = [n for n in g.layer_names if not _same_layer_spec(want[n], g.layer_spec(n))]
            if bad:
                raise ConfigError(
                    f"KV-cache group {gid} has {spec!r}, but the model's layer {bad[0]} needs "
                    f"{want[bad[0]]!r} (build the groups with kv_cache_groups_for)")

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV memory (each shared tensor, or shared byte slot, counted once)."""
        return self.kv_pool.nbytes

    def attention_for(self, step: StepInputs, common: CommonAttentionMetadata | None = None,
                      for_cudagraph_capture: bool = False,
                      common_prefix_lens: Sequence[int] | None = None) -> StepAttention:
        """The step's attention: the base metadata (``common``, default the step's), each
        KV-cache group's metadata through its builder (``build_attention_metadata``: same spec
        and builder -> only the table and slot mapping swapped; ``common_prefix_lens``: each
        group's shared prefix, :meth:`cascade_prefix_lens`), one backend plan per group,
        and the plans per layer. Inside a CUDA-graph capture this runs in the captured
        function, so the plans belong to the graph."""
        bt = self.input_batch.block_table
        if common is None:
            common = common_metadata_from_inputs(step, bt)
        mds = build_attention_metadata(common, self.attn_groups, bt, step.slot_mappings,
                                       for_cudagraph_capture=for_cudagraph_capture,
                                       common_prefix_lens=common_prefix_lens)
        backend = self.attn_backend
        plans = [per_group[0] if layout is None else backend.plan(per_group[0], layout)
                 for per_group, layout in zip(mds.by_group, self._layouts)]
        return StepAttention(common, [plans[g] for g in self._layer_group])

    def cascade_prefix_lens(self, scheduler_output: SchedulerOutput, n: int) -> list[int] | None:
        """Per KV-cache group, the positions the step's ``n`` requests share (the scheduler's
        ``num_common_prefix_blocks`` capped by their smallest ``num_computed_tokens``, whole
        blocks); None when the backend has no cascade attention or nothing is shared."""
        blocks = scheduler_output.num_common_prefix_blocks
        if not blocks or not self.attn_backend.supports_cascade:
            return None
        return cascade_prefix_lens(blocks, self._group_block_sizes,
                                   self.input_batch.num_computed_tokens_cpu[:n])

    def all_groups_cascade(self, n: int, lens: Sequence[int] | None) -> bool:
        """Every attention group's plan would take cascade attention for a step of ``n``
        requests sharing ``lens`` (the decode graph to replay is then the ``CASCADE`` one)."""
        if lens is None:
            return False
        use = self.attn_backend.use_cascade
        wants = [use(n, p, layout) for p, layout in zip(lens, self._layouts) if layout is not None]
        return bool(wants) and all(wants)

    def cuda_graphs_supported(self) -> bool:
        """A CUDA device and a backend that declares itself graph-capturable."""
        return self.device.type == "cuda" and self.attn_backend.supports_cuda_graphs

    def mixed_cuda_graphs_supported(self) -> bool:
        """Mixed prefill / decode steps may replay CUDA graphs (``pagedkv.worker.cuda_graphs``):
        a backend that declares ``supports_mixed_cuda_graphs``, attention groups only (a state
        group's prefill launches depend on host chunk lengths), every group full attention
        (no sliding window, no logit soft cap), no decode context parallelism, no
        length-dependent (dynamic) RoPE and one process (no tensor parallelism: not run on
        several GPUs here)."""
        if not self.cuda_graphs_supported() or not self.attn_backend.supports_mixed_cuda_graphs:
            return False
        if self._state_groups or self.input_batch.block_table.cp_world_size > 1:
            return False
        if getattr(getattr(self.model, "rotary", None), "is_dynamic", False):
            return False
        if getattr(self.model, "tp", None) is not None:  # not measured on several GPUs yet
            return False
        return all(layout is not None and layout.sliding_window is None
                   and layout.logits_soft_cap is None for layout in self._layouts)

    def capture_cuda_graphs(self) -> int:
        """Capture the pure-decode graphs and, with ``mixed_cuda_graphs`` where
        :meth:`mixed_cuda_graphs_supported`, the mixed-step graphs (see
        ``pagedkv.worker.cuda_graphs``). Returns the number of graphs (0 when graphs are off
        or unsupported)."""
        if self.enforce_eager or not self.cuda_graphs_supported():
            return 0
        from pagedkv.worker.cuda_graphs import (
            CudaGraphManager,
            default_capture_sizes,
            default_mixed_capture_sizes,
        )

        sizes = self.cuda_graph_sizes or default_capture_sizes(self.scheduler_config.max_num_seqs)
        mixed = (default_mixed_capture_sizes(self.scheduler_config.max_num_batched_tokens)
                 if self.mixed_cuda_graphs and self.mixed_cuda_graphs_supported() else ())
        mgr = CudaGraphManager(self, sizes, mixed_sizes=mixed)
        mgr.capture()
        self.cuda_graphs = mgr
        # the eager warm-up runs before each capture left up to a largest step's activations
        # cached outside the graphs' pool; steps now replay graphs, so hand that memory back
        torch.cuda.empty_cache()
        self.warm_logits_shapes()
        return mgr.num_graphs

    # ----- one step ------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """One step, synchronously: :meth:`execute_model_async` then :meth:`get_output`."""
        return self.get_output(self.execute_model_async(scheduler_output))

    @torch.inference_mode()
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Enqueue one step (batch update, inputs, forward, sampling) without waiting for the
        device; :meth:`get_output` returns its tokens. At most one step may be enqueued whose
        output was not collected yet: its sampled tokens feed this step on the device (see
        the module docstring, "async scheduling")."""
        outputs = self.outputs
        prev = outputs.in_flight()
        upd = update_states(self.requests, self.input_batch, scheduler_output, self.reorder_threshold)
        self._apply_block_ops(upd)
        if self._state_groups:
            self._carry_aligned_states(scheduler_output)
        if upd.batch_changed:
            self._batch_version += 1
        batch = self.input_batch
        n = batch.num_reqs
        if n == 0 or scheduler_output.total_num_scheduled_tokens == 0:
            return StepHandle.empty()
        self.num_steps += 1
        if upd.batch_changed or len(self._out_ids) != n:
            self._out_ids = list(batch.req_ids[:n])
            self._out_index = {rid: i for i, rid in enumerate(self._out_ids)}
        nsched = batch.scheduled_tokens_per_row(scheduler_output.num_scheduled_tokens)
        num_tokens = int(nsched.sum())
        prefix_lens = self.cascade_prefix_lens(scheduler_output, n)
        pending = None
        if prev is not None and prev.num_sampled:
            pending = outputs.add_pending_tokens(prev, n, self._batch_version)

        # a pure-decode step replays the decode graph of its padded size, a mixed one the
        # mixed graph of its padded token count (when captured); otherwise eager
        graph_size = mixed_size = None
        graphs = self.cuda_graphs
        if graphs is not None:
            if num_tokens == n:
                graph_size = graphs.padded_size(n)
            else:
                mixed_size = graphs.mixed_padded_size(num_tokens, n)
        if graph_size is not None:
            pads = (graph_size, graph_size)
        elif mixed_size is not None:
            pads = (graphs.mixed_reqs, mixed_size)
        else:
            pads = (None, None)
        step = self.preparer.prepare(batch, nsched, *pads)
        if self.step_check is not None:
            self.step_check(step)
        if pending is not None:
            outputs.fill_pending_inputs(prev, pending, nsched, num_tokens, n,
                                        self.preparer.input_ids.gpu)
        if graph_size is None and mixed_size is None:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches,
                                self.attention_for(step, common_prefix_lens=prefix_lens))
        else:
            cascade = self.all_groups_cascade(n, prefix_lens)
            if cascade:  # the graph reads each group's prefix length on the device
                set_common_prefix_lens(self.attn_groups, prefix_lens)
            if mixed_size is not None:
                hidden = graphs.replay_mixed(mixed_size, graphs.mixed_variant(cascade))
                self.num_mixed_graph_steps += 1
            else:
                variant = graphs.variant(graph_size, self.preparer.seq_lens.np[:n], cascade)
                hidden = graphs.replay(graph_size, variant)
                self.num_graph_steps += 1

        # Rows whose known tokens are all computed after this step sample one token.
        seq = batch.num_computed_tokens_cpu[:n] + nsched
        sample = seq >= batch.num_tokens[:n]
        out_ids = self._out_ids
        if sample.all():
            rows = None
            positions = seq.astype(np.int64)
            sampled_req_ids = out_ids
            if num_tokens == n:  # one token per row: row i's last token is hidden row i
                # a graph replay projects all its (padded) rows: one GEMM shape per graph size
                m_rows = n if graph_size is None else graph_size
                hidden, logits_indices = hidden[:m_rows], None
            else:
                logits_indices = self._logits_rows(self.preparer.logits_indices.np[:n])
        else:
            rows = np.flatnonzero(sample)
            if rows.size == 0:
                return StepHandle(out_ids, self._out_index, n, self._batch_version)
            positions = seq[rows].astype(np.int64)
            sampled_req_ids = [out_ids[r] for r in rows.tolist()]
            ends = np.cumsum(nsched, dtype=np.int64) - 1
            logits_indices = self._logits_rows(ends[rows])
        m = len(sampled_req_ids)

        if self.sampling.plain_greedy(self._out_ids, self.requests, self._batch_version):
            # Every row greedy and no logprobs: one argmax over the model-dtype logits (the
            # float32 widening is exact and order-preserving, so the argmax is the same).
            sampled, logprobs, want = self._greedy_tokens(hidden, logits_indices)[:m], None, None
        else:
            logits = self._compute_logits(hidden, logits_indices, widen=True)[:m]
            key = tuple(out_ids) if rows is None else tuple(sampled_req_ids)
            out = self.sampling.sample(
                self.sampler, logits, key, self.requests, positions,
                None if prev is None else (prev.sampled_req_ids, prev.sampled))
            sampled, logprobs = out.sampled_token_ids, out.logprobs
            want = self.sampling.wants_logprobs if logprobs is not None else None
        host, event = outputs.stage(sampled, m)
        h = StepHandle(out_ids, self._out_index, n, self._batch_version, rows=rows,
                       sampled_req_ids=sampled_req_ids, positions=positions, sampled=sampled,
                       host=host, event=event, logprobs=logprobs, want_logprobs=want)
        outputs.push(h)
        return h

    def get_output(self, handle: StepHandle) -> RunnerOutput:
        """Wait for ``handle``'s sampled tokens (the step's one device -> host sync), record
        them in the request states and the batch, and report them. Outputs are collected in
        the order the steps were enqueued (``AsyncOutputs.collect``)."""
        return self.outputs.collect(handle, self._batch_version)

    def _logits_rows(self, rows: np.ndarray) -> torch.Tensor:
        """Device indices of the hidden rows to project, padded (with the last row) to the
        next CUDA-graph size: the LM-head GEMM then sees the few shapes warmed at capture
        instead of a new row count in most steps (cuBLAS picks its kernel per shape, which
        costs milliseconds on the host the first time, measured in W1's prefill steps).
        Callers use the first ``len(rows)`` rows of the result."""
        graphs = self.cuda_graphs
        m = rows.shape[0]
        if graphs is not None:
            size = graphs.padded_size(m)
            if size is not None and size > m:
                rows = np.concatenate([rows, np.full(size - m, rows[-1], dtype=np.int64)])
        return self._to_device(rows)

    def warm_logits_shapes(self) -> None:
        """Run the LM-head projection (and the greedy argmax) once for every CUDA-graph size,
        so no new GEMM shape appears during serving (see ``_logits_rows``)."""
        if self.cuda_graphs is None:
            return
        hidden = torch.zeros(self.cuda_graphs.sizes[-1], self.model.config.hidden_size,
                             dtype=self.model.dtype, device=self.device)
        for size in self.cuda_graphs.sizes:
            with torch.inference_mode():
                self._greedy_tokens(hidden[:size], None)
                self._compute_logits(hidden[:size], None, widen=True)
        torch.cuda.synchronize(self.device)

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        """A small int64 host array on the device without a sync, holding ``values`` as they
        are at the call: later writes to ``values`` never reach it.

        Always through a private copy. ``values`` may be rows of a staging buffer that the next
        step's input preparation rewrites (the prefill logits rows are
        ``preparer.logits_indices.np``), and on CUDA that buffer is pinned: ``pin_memory()`` of
        a tensor already in pinned memory returns the tensor itself, so the non-blocking copy
        would read the staging bytes when the device reaches it, after the host had written the
        next step's rows there (async scheduling, a device behind the host: a step's tokens
        then came from the next step's rows). A pageable private copy is pinned into a new block
        of torch's caching host allocator, which keeps it until the copy has run."""
        t = torch.from_numpy(np.array(values, dtype=np.int64))
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _greedy_tokens(self, hidden: torch.Tensor, indices) -> torch.Tensor:
        """The all-greedy step's tokens: the model's ``greedy_tokens`` where it has one (the
        fused LM head + argmax where that applies), else the argmax of its model-dtype
        logits."""
        if self._greedy_tokens_fn is not None:
            return self._greedy_tokens_fn(hidden, indices)
        return argmax_rows(self._compute_logits(hidden, indices, widen=False))

    def _compute_logits(self, hidden: torch.Tensor, indices, widen: bool) -> torch.Tensor:
        if not widen and self._logits_widen_kw:
            return self.model.compute_logits(hidden, indices, widen=False)
        return self.model.compute_logits(hidden, indices)

    def reset_requests(self) -> None:
        """Forget every request and every enqueued step: the recovery after a step was
        interrupted (an exception or Ctrl-C inside it), when the scheduler aborted all
        requests. The device work already enqueued is waited for; the persistent batch, the
        request states and the pending outputs are cleared."""
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # a broken device is reported by the next step, not here
                pass
        self.outputs.clear()
        batch = self.input_batch
        for rid in list(batch.req_id_to_index):
            batch.remove_request(rid)
        self.requests.clear()
        batch.condense()
        batch.refresh_metadata()
        self._batch_version += 1
        self._out_ids, self._out_index = [], {}
        self.sampling.invalidate()

    def _apply_block_ops(self, upd: StateUpdate) -> None:
        """Zero the blocks the scheduler asks for, then apply copy-on-write pairs."""
        if upd.block_ids_to_zero:
            ids = torch.tensor(upd.block_ids_to_zero, dtype=torch.int64, device=self.device)
            self.kv_pool.zero_blocks(ids)
        if upd.block_copies:
            src = torch.tensor([s for s, _ in upd.block_copies], dtype=torch.int64, device=self.device)
            dst = torch.tensor([d for _, d in upd.block_copies], dtype=torch.int64, device=self.device)
            self.kv_pool.copy_blocks(src, dst)

    def aligned_state_copies(self, num_scheduled_tokens: dict[str, int]) -> list[tuple[int, int]]:
        """Mode ``align`` state groups: ``(src, dst)`` block pairs that carry each request's
        state to the block its step ends in. A request's state lives in the block holding its
        last computed token (column ``(computed - 1) // B``); this step's tokens update it in
        the block holding the step's last token (column ``(computed + scheduled - 1) // B``).
        When those differ, the older block keeps the checkpoint of its boundary (what a later
        prefix hit resumes from) and the newer one starts as its copy."""
        batch = self.input_batch
        n = batch.num_reqs
        if n == 0:
            return []
        nsched = batch.scheduled_tokens_per_row(num_scheduled_tokens).astype(np.int64)
        computed = batch.num_computed_tokens_cpu[:n].astype(np.int64)
        pairs: list[tuple[int, int]] = []
        for gid in self._state_groups:
            spec = self.kv_cache_config.kv_cache_groups[gid].kv_cache_spec
            if spec.mamba_cache_mode != MambaCacheMode.ALIGN:
                continue
            B = spec.block_size
            rows = np.flatnonzero((computed > 0) & (nsched > 0))
            src_col = (computed[rows] - 1) // B
            dst_col = (computed[rows] + nsched[rows] - 1) // B
            move = src_col != dst_col
            rows, src_col, dst_col = rows[move], src_col[move], dst_col[move]
            if rows.size == 0:
                continue
            table = batch.block_table[gid].block_table.np
            src, dst = table[rows, src_col], table[rows, dst_col]
            if (src <= 0).any() or (dst <= 0).any():
                raise InvariantError("mamba-align", "a state block to carry is the null block",
                                     group=gid, rows=rows.tolist(), src=src.tolist(),
                                     dst=dst.tolist())
            pairs.extend((int(a), int(b)) for a, b in zip(src, dst) if a != b)
        return pairs

    def _carry_aligned_states(self, scheduler_output: SchedulerOutput) -> None:
        pairs = self.aligned_state_copies(scheduler_output.num_scheduled_tokens)
        if pairs:
            src = torch.tensor([a for a, _ in pairs], dtype=torch.int64, device=self.device)
            dst = torch.tensor([b for _, b in pairs], dtype=torch.int64, device=self.device)
            self.kv_pool.copy_blocks(src, dst)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.sampling.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.sampling.eos_token_ids = ids

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


def _profile_state_attention(model: Any, groups: Sequence[KVCacheGroupSpec], md) -> tuple:
    """A state hybrid's throw-away caches (two blocks) and per-layer plans for the profile
    forward: attention layers get the backend's plan of ``md`` (null-block tables, ``-1``
    slots), state layers a ``MambaMetadata`` whose rows are all prefills with the padding
    state index (the mixers' GEMMs run at full size, their state kernels skip the rows)."""
    from pagedkv.kernels._common import PAD_SLOT_ID
    from pagedkv.worker.attn_builders import MambaMetadata

    device = model.device
    caches = allocate_group_kv_caches(KVCacheConfig(num_blocks=2, kv_cache_groups=tuple(groups)),
                                      cache_layer_names(model), device=device, fill=0.0)
    n = md.num_reqs
    state_md = MambaMetadata(
        num_reqs=n, num_actual_tokens=md.num_actual_tokens, query_start_loc=md.query_start_loc,
        seq_lens=md.seq_lens,
        state_indices=torch.full((n, 1), PAD_SLOT_ID, dtype=torch.int32, device=device),
        has_initial_state=torch.zeros(n, dtype=torch.bool, device=device),
        block_table=md.block_table_tensor, num_actual_reqs=n, num_prefills=n,
        num_prefill_tokens=md.num_actual_tokens)
    plan_of = {}
    for g in groups:
        spec = g.kv_cache_spec
        plan = state_md if isinstance(spec, MambaSpec) else model.attn_backend.plan(
            md, dataclasses.replace(model.attention_layout(spec), device=device))
        plan_of.update({name: plan for name in g.layer_names})
    return caches, StepAttention(md, [plan_of[name] for name in cache_layer_names(model)])


@torch.inference_mode()
def profile_peak_memory(
    model: Any,
    scheduler_config: SchedulerConfig,
    block_size: int,
    sampler: Sampler | None = None,
    kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
) -> int:
    """Peak bytes of activations (beyond what is allocated before the call) of the largest step:
    a forward over ``max_num_batched_tokens`` tokens, logits for ``max_num_seqs`` rows and a
    top-k/top-p sampling pass over them. CUDA only. ``kv_cache_groups``: the engine's groups,
    needed for a model with state layers (its forward takes per-layer plans and state
    tensors)."""
    device = model.device
    if device.type != "cuda":
        raise ConfigError("profile_peak_memory needs a CUDA model; size CPU pools from a byte budget")
    sc = scheduler_config
    num_tokens = sc.max_num_batched_tokens
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    md = _profile_metadata(num_tokens, sc.max_model_len, block_size, device)
    if kv_cache_groups is not None and any(isinstance(g.kv_cache_spec, MambaSpec)
                                           for g in kv_cache_groups):
        caches, attn = _profile_state_attention(model, kv_cache_groups, md)
    else:
        caches, attn = model.allocate_kv_caches(1, block_size, device=device, fill=0.0), md
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), device=device, generator=gen)
    pos = torch.cat([torch.arange(n, device=device) for n in md.seq_lens_cpu.tolist()])
    hidden = model(ids, pos, caches, attn)
    rows = min(sc.max_num_seqs, num_tokens)
    logits = model.compute_logits(hidden, torch.arange(rows, device=device))
    del hidden
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, logprobs=5)] * rows
    (sampler or Sampler())(logits, SamplingMetadata.build(params, device))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del logits, caches, md, attn
    torch.cuda.empty_cache()
    if peak < 0:
        raise InvariantError("profile", "negative peak memory", peak=peak)
    return int(peak)


__all__ = [
    "ModelRunner",
    "RunnerOutput",
    "SampledLogprobs",
    "attention_layer_names",
    "kv_cache_groups_for",
    "kv_cache_spec_for",
    "served_kv_cache_specs",
    "profile_peak_memory",
]
