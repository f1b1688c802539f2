"""Attention metadata: the per-step description every attention layer reads.

* :class:`CommonAttentionMetadata`: built once per step from :class:`StepInputs` (group 0's
  block table and slot mapping), then shallow-copied per KV-cache group with that group's
  table and slot mapping swapped in (reference sec. 14).
* :class:`AttentionGroup`: layers of one KV-cache group served by one backend builder. It
  owns the *kernel block size* (sec. 11): when the kernel page is smaller than the manager
  block (ratio ``B / kbs > 1``), the table handed to the backend is translated with
  ``map_to_kernel_block_table`` (``out[r, c*ratio + j] = table[r, c]*stride + j``) into a
  persistent buffer, and the builder receives ``spec.copy_with_new_block_size(kbs)``. The
  block table and slot mapping themselves stay in manager blocks (for dense layouts
  ``b*B + off == (b*ratio + off//kbs)*kbs + off%kbs``).
* :func:`build_attention_metadata`: per-group metadata with the reuse rule: key
  ``(builder's spec, builder class)``; when the key was already built this step and the
  builder ``supports_update_block_table``, ``update_block_table(prev, table, slot_mapping)``
  replaces ``build``. Reuse is skipped during CUDA-graph capture.
* ``CommonAttentionMetadata.num_actual_reqs`` (our addition) carries the unpadded request
  count, so builders can apply their own padding rules (FlashInfer's CSR does).
* :func:`slot_mappings_by_group_and_layer`: the step's slot mappings keyed by group id (for
  metadata) and by layer name (for the forward context). Layers of one group share one tensor.
* Cascade attention: :func:`cascade_prefix_lens` turns the scheduler's per-group
  ``num_common_prefix_blocks`` into the positions a step may treat as shared (capped by the
  step's smallest ``num_computed_tokens``, whole blocks); each :class:`AttentionGroup` keeps
  the value in a persistent device scalar (``common_prefix_len_device``, written by
  :func:`set_common_prefix_lens`, read by a CUDA graph at replay), and
  :func:`build_attention_metadata` puts both into the group's metadata.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from pagedkv.core.spec import KVCacheConfig, KVCacheSpec, MambaSpec
from pagedkv.errors import ConfigError
from pagedkv.kernels.kernel_block_table import map_to_kernel_block_table
from pagedkv.worker.block_table import MultiGroupBlockTable
from pagedkv.worker.inputs import StepInputs


@dataclass
class CommonAttentionMetadata:
    """Per-step metadata shared by all layers; sizes are the padded (CUDA-graph) sizes."""

    query_start_loc: torch.Tensor  # device int32 [num_reqs + 1]
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor  # device int32 [num_reqs]
    seq_lens_cpu: torch.Tensor
    num_reqs: int  # padded
    num_actual_tokens: int  # padded
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor  # device int32 [num_reqs, width] (one group)
    slot_mapping: torch.Tensor  # device int64 [num_actual_tokens] (one group)
    positions: torch.Tensor | None = None
    is_prefilling: torch.Tensor | None = None
    num_computed_tokens_cpu: torch.Tensor | None = None
    dcp_local_seq_lens: torch.Tensor | None = None
    dcp_local_seq_lens_cpu: torch.Tensor | None = None
    num_actual_reqs: int = -1  # unpadded request count; defaults to num_reqs
    causal: bool = True
    # decode steps: whether the lengths are balanced (a CUDA graph's baked value, see
    # cuda_graphs.py); None: a backend that cares derives it from seq_lens_cpu
    decode_balanced: bool | None = None
    # cascade attention, per KV-cache group (AttentionMetadataLike): the leading positions
    # every request of the step shares in the same blocks, capped below every query
    # (cascade_prefix_lens); the same value in the group's persistent device scalar (a graph
    # reads it at replay); a CUDA graph's baked decision (None: the backend decides)
    common_prefix_len: int = 0
    common_prefix_len_device: torch.Tensor | None = None
    use_cascade: bool | None = None
    # a CUDA graph of mixed steps (cuda_graphs.py): num_reqs / num_actual_tokens are the
    # capture's bounds, every request may be a decode or a prefill; the host lengths are the
    # capture's (empty) batch's, never the replayed step's
    mixed_graph: bool = False
    # device int32 [>= num_reqs]: the order the decode kernel launches the requests' programs
    # in (StepInputs.decode_order, longest first); None: request order
    decode_order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.num_actual_reqs < 0:
            self.num_actual_reqs = self.num_reqs


def common_metadata_from_inputs(step: StepInputs, block_table: MultiGroupBlockTable) -> CommonAttentionMetadata:
    """The step's base metadata, carrying group 0's table and slot mapping."""
    return CommonAttentionMetadata(
        query_start_loc=step.query_start_loc,
        query_start_loc_cpu=step.query_start_loc_cpu,
        seq_lens=step.seq_lens,
        seq_lens_cpu=step.seq_lens_cpu,
        num_reqs=step.num_reqs_padded,
        num_actual_tokens=step.num_tokens_padded,
        max_query_len=step.max_query_len,
        max_seq_len=step.max_seq_len,
        block_table_tensor=block_table[0].get_device_tensor(step.num_reqs_padded),
        slot_mapping=step.slot_mappings[0],
        positions=step.positions,
        is_prefilling=step.is_prefilling,
        num_computed_tokens_cpu=step.num_computed_tokens_cpu,
        dcp_local_seq_lens=step.dcp_local_seq_lens,
        dcp_local_seq_lens_cpu=step.dcp_local_seq_lens_cpu,
        num_actual_reqs=step.num_reqs,
        decode_order=step.decode_order,
    )


class AttentionGroup:
    """Layers of KV-cache group ``kv_cache_group_id`` served by one builder.

    ``kernel_block_size`` (default: the manager block size) must divide the manager block
    size; Mamba groups are never split. ``kernel_block_stride``: kernel blocks between two
    manager blocks (packed layouts); default ``ratio``.
    """

    def __init__(
        self,
        builder_cls: type,
        layer_names: Sequence[str],
        kv_cache_spec: KVCacheSpec,
        kv_cache_group_id: int,
        table_width: int,
        max_num_reqs: int,
        device: torch.device | str,
        kernel_block_size: int | None = None,
        kernel_block_stride: int | None = None,
    ) -> None:
        B = kv_cache_spec.block_size
        kbs = B if kernel_block_size is None else kernel_block_size
        if not isinstance(kbs, int) or kbs < 1 or B % kbs:
            raise ConfigError(
                f"kernel_block_size {kbs!r} must be a positive divisor of the group's block size {B}"
            )
        if isinstance(kv_cache_spec, MambaSpec) and kbs != B:
            raise ConfigError("Mamba groups are never split into kernel blocks")
        self.builder_cls = builder_cls
        self.layer_names = tuple(layer_names)
        self.kv_cache_spec = kv_cache_spec
        self.kv_cache_group_id = kv_cache_group_id
        self.kernel_block_size = kbs
        self.ratio = B // kbs
        self.kernel_block_stride = kernel_block_stride
        self.kernel_spec = kv_cache_spec if self.ratio == 1 else kv_cache_spec.copy_with_new_block_size(kbs)
        self.device = torch.device(device)
        self._kernel_table = (
            torch.zeros(max_num_reqs, table_width * self.ratio, dtype=torch.int32, device=self.device)
            if self.ratio > 1
            else None
        )
        self.builder = builder_cls(self.kernel_spec, self.layer_names, self.device, max_num_reqs, table_width * self.ratio)
        # cascade attention: the group's shared prefix length on the device (a graph reads
        # it at replay) and the value last written there
        self.common_prefix_len_device = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._common_prefix_len = 0

    def set_common_prefix_len(self, n: int) -> None:
        """Write ``n`` into :attr:`common_prefix_len_device` (one small device fill, only when
        the value changes; stream-ordered after the steps that read the old one)."""
        if n != self._common_prefix_len:
            self.common_prefix_len_device.fill_(n)
            self._common_prefix_len = n

    @property
    def reuse_key(self) -> tuple:
        return (self.kernel_spec, self.builder_cls)

    def map_to_kernel_block_table(self, block_table: torch.Tensor, num_reqs: int) -> torch.Tensor:
        """The manager-block table as the backend must see it (kernel blocks)."""
        if self.ratio == 1:
            return block_table
        out = self._kernel_table
        map_to_kernel_block_table(block_table, num_reqs, self.ratio, out, block_stride=self.kernel_block_stride)
        return out[:num_reqs]


def make_attention_groups(
    kv_cache_config: KVCacheConfig,
    builder_classes: Sequence[type],
    block_table: MultiGroupBlockTable,
    kernel_block_sizes: Sequence[int | None] | None = None,
) -> list[list[AttentionGroup]]:
    """One attention group per KV-cache group (``builder_classes[g]`` serves group ``g``)."""
    groups = kv_cache_config.kv_cache_groups
    if len(builder_classes) != len(groups) or block_table.num_groups != len(groups):
        raise ConfigError(
            f"{len(groups)} KV-cache groups, {len(builder_classes)} builder classes, "
            f"{block_table.num_groups} block tables: give one of each per group"
        )
    kbs = list(kernel_block_sizes) if kernel_block_sizes is not None else [None] * len(groups)
    return [
        [
            AttentionGroup(
                cls,
                g.layer_names,
                g.kv_cache_spec,
                gid,
                block_table.widths[gid],
                block_table.max_num_reqs,
                block_table.device,
                kernel_block_size=kbs[gid],
            )
        ]
        for gid, (g, cls) in enumerate(zip(groups, builder_classes))
    ]


@dataclass
class AttentionMetadataSet:
    by_layer: dict[str, Any] = field(default_factory=dict)
    by_group: list[list[Any]] = field(default_factory=list)  # [kv group][attention group]
    num_built: int = 0
    num_reused: int = 0


def cascade_prefix_lens(num_common_prefix_blocks: Sequence[int], block_sizes: Sequence[int],
                        num_computed_tokens: np.ndarray) -> list[int] | None:
    """Per KV-cache group, the leading positions a step's attention may treat as shared by all
    its requests (cascade attention), vLLM's ``_compute_cascade_attn_prefix_len``: the
    scheduler's shared blocks x the group's block size, capped by the smallest
    ``num_computed_tokens`` of the step's requests (each query must sit after the whole
    prefix, which it then sees without a causal mask), rounded down to whole blocks. None
    when no group has any (the common case)."""
    if not num_common_prefix_blocks or not any(num_common_prefix_blocks) \
            or len(num_computed_tokens) == 0:
        return None
    low = int(num_computed_tokens.min())
    if low <= 0:
        return None
    lens = [min(b * bs, low) // bs * bs for b, bs in zip(num_common_prefix_blocks, block_sizes)]
    return lens if any(lens) else None


def set_common_prefix_lens(attn_groups: Sequence[Sequence[AttentionGroup]],
                           lens: Sequence[int]) -> None:
    """Write each KV-cache group's shared prefix length into its groups' device scalars."""
    for groups, n in zip(attn_groups, lens):
        for ag in groups:
            ag.set_common_prefix_len(n)


def build_attention_metadata(
    common: CommonAttentionMetadata,
    attn_groups: Sequence[Sequence[AttentionGroup]],
    block_table: MultiGroupBlockTable,
    slot_mappings: torch.Tensor,
    for_cudagraph_capture: bool = False,
    common_prefix_lens: Sequence[int] | None = None,
) -> AttentionMetadataSet:
    """Metadata for every attention group of every KV-cache group (with cross-group reuse).

    ``slot_mappings``: ``[G, >= common.num_actual_tokens]`` (e.g. ``StepInputs.slot_mappings``).
    ``common_prefix_lens``: per KV-cache group, the step's shared prefix length
    (:func:`cascade_prefix_lens`): written into the group's device scalar and, with it, into
    the group's :class:`CommonAttentionMetadata`; so is the scalar alone (length 0) when
    ``common.use_cascade`` (a cascade graph's capture). None: no cascade fields.
    """
    if len(attn_groups) != block_table.num_groups:
        raise ConfigError(
            f"attention groups for {len(attn_groups)} KV-cache groups, the block table has "
            f"{block_table.num_groups}"
        )
    out = AttentionMetadataSet()
    seen: dict[tuple, Any] = {}
    n_reqs, n_tok = common.num_reqs, common.num_actual_tokens
    cascade = common_prefix_lens is not None or bool(common.use_cascade)
    extra: dict = {}
    for gid, groups in enumerate(attn_groups):
        table = block_table[gid].get_device_tensor(n_reqs)
        slots = slot_mappings[gid, :n_tok]
        per_group = []
        for ag in groups:
            if cascade:
                n_prefix = 0 if common_prefix_lens is None else int(common_prefix_lens[gid])
                if common_prefix_lens is not None:
                    ag.set_common_prefix_len(n_prefix)
                extra = dict(common_prefix_len=n_prefix,
                             common_prefix_len_device=ag.common_prefix_len_device)
            kernel_table = ag.map_to_kernel_block_table(table, n_reqs)
            key = ag.reuse_key
            prev = seen.get(key)
            if prev is not None and ag.builder.supports_update_block_table and not for_cudagraph_capture:
                md = ag.builder.update_block_table(prev, kernel_table, slots)
                if extra and isinstance(md, CommonAttentionMetadata):
                    md = dataclasses.replace(md, **extra)
                out.num_reused += 1
            else:
                cm = dataclasses.replace(common, block_table_tensor=kernel_table, slot_mapping=slots,
                                         **extra)
                md = ag.builder.build(cm, for_cudagraph_capture=for_cudagraph_capture)
                out.num_built += 1
            seen[key] = md
            per_group.append(md)
            for name in ag.layer_names:
                out.by_layer[name] = md
        out.by_group.append(per_group)
    return out


def slot_mappings_by_group_and_layer(
    kv_cache_config: KVCacheConfig, slot_mappings: torch.Tensor, num_tokens: int
) -> tuple[dict[int, torch.Tensor], dict[str, torch.Tensor]]:
    """``(gid -> slot mapping, layer name -> slot mapping)``, each ``[:num_tokens]``.

    Every layer of a group gets the same tensor object.
    """
    by_gid: dict[int, torch.Tensor] = {}
    by_layer: dict[str, torch.Tensor] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        sm = slot_mappings[gid, :num_tokens]
        by_gid[gid] = sm
        for name in group.layer_names:
            by_layer[name] = sm
    return by_gid, by_layer
