"""Attention metadata: CSR (sec. 15), reuse across groups, kernel blocks (sec. 11), Mamba (sec. 14)."""

import pytest
import torch

from pagedkv.core.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)
from pagedkv.errors import ConfigError
from pagedkv.worker.attn_builders import (
    FlashAttentionMetadataBuilder,
    FlashInferMetadataBuilder,
    MambaMetadataBuilder,
    mamba_state_indices,
)
from pagedkv.worker.input_batch import CachedRequestState, InputBatch
from pagedkv.worker.inputs import InputPreparer
from pagedkv.worker.metadata import (
    AttentionGroup,
    build_attention_metadata,
    common_metadata_from_inputs,
    make_attention_groups,
    slot_mappings_by_group_and_layer,
)

MAX_LEN = 64
FULL = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8)


def build_world(specs, reqs=4, tokens=16):
    cfg = KVCacheConfig(
        num_blocks=64,
        kv_cache_groups=[KVCacheGroupSpec((f"g{g}.l0", f"g{g}.l1"), s) for g, s in enumerate(specs)],
    )
    batch = InputBatch(
        reqs, MAX_LEN, tokens, "cpu", False,
        [s.block_size for s in specs],
        [s.max_num_blocks_per_req(MAX_LEN) for s in specs],
        [s.slot_mapping_mode for s in specs],
    )
    return cfg, batch, InputPreparer(reqs, tokens, "cpu", False)


def add(b, rid, n_tokens, blocks, computed):
    b.add_request(CachedRequestState(rid, list(range(n_tokens)), None, blocks, computed))


def test_flashinfer_csr_verified_example_with_padding():
    """Sec. 15 (verified): seq [40,3,17], page 16, rows [4,5,6],[9],[1,2] ->
    indptr [0,3,4,6], indices [4,5,6,9,1,2], last_page_len [8,3,1]; padded rows: 0 pages."""
    cfg, b, prep = build_world([FULL])
    add(b, "A", 40, ([4, 5, 6],), 39)
    add(b, "B", 3, ([9],), 2)
    add(b, "C", 17, ([1, 2],), 16)
    step = prep.prepare(b, {"A": 1, "B": 1, "C": 1})
    groups = make_attention_groups(cfg, [FlashInferMetadataBuilder], b.block_table)
    md = build_attention_metadata(common_metadata_from_inputs(step, b.block_table), groups, b.block_table, step.slot_mappings)
    fi = md.by_layer["g0.l0"]
    assert fi is md.by_layer["g0.l1"]
    assert fi.paged_kv_indptr.tolist() == [0, 3, 4, 6]
    assert fi.paged_kv_indices[:6].tolist() == [4, 5, 6, 9, 1, 2]
    assert fi.paged_kv_last_page_len.tolist() == [8, 3, 1]

    step = prep.prepare(b, {"A": 1, "B": 1, "C": 1}, num_reqs_padded=4)
    md = build_attention_metadata(common_metadata_from_inputs(step, b.block_table), groups, b.block_table, step.slot_mappings)
    fi = md.by_layer["g0.l0"]
    assert fi.paged_kv_indptr.tolist() == [0, 3, 4, 6, 6]
    assert fi.paged_kv_last_page_len.tolist() == [8, 3, 1, 0]


def test_reuse_across_groups_with_same_spec():
    mamba = MambaSpec(block_size=MAX_LEN)
    cfg, b, prep = build_world([FULL, FULL, mamba])
    add(b, "A", 20, ([3, 4], [5, 6], [2]), 19)
    add(b, "B", 5, ([7], [8], [9]), 0)
    step = prep.prepare(b, {"A": 1, "B": 5})
    groups = make_attention_groups(
        cfg, [FlashAttentionMetadataBuilder, FlashAttentionMetadataBuilder, MambaMetadataBuilder], b.block_table
    )
    common = common_metadata_from_inputs(step, b.block_table)
    md = build_attention_metadata(common, groups, b.block_table, step.slot_mappings)
    assert (md.num_built, md.num_reused) == (2, 1)  # group 1 reuses group 0's via update
    m0, m1, m2 = md.by_layer["g0.l0"], md.by_layer["g1.l1"], md.by_layer["g2.l0"]
    assert m1 is not m0 and m1.query_start_loc is m0.query_start_loc
    assert m0.block_table[:, :2].tolist() == [[3, 4], [7, 0]]
    assert m1.block_table[:, :2].tolist() == [[5, 6], [8, 0]]
    assert m1.block_table_stride == (b.block_table.total_width, 1)
    assert m0.slot_mapping.tolist() == [4 * 16 + 3, 7 * 16, 7 * 16 + 1, 7 * 16 + 2, 7 * 16 + 3, 7 * 16 + 4]
    assert m1.slot_mapping.tolist() == [6 * 16 + 3, 8 * 16, 8 * 16 + 1, 8 * 16 + 2, 8 * 16 + 3, 8 * 16 + 4]
    assert m2.state_indices.tolist() == [[2], [9]]  # mode none: the table as is
    assert m2.has_initial_state.tolist() == [True, False]
    # during CUDA-graph capture everything is built
    md = build_attention_metadata(common, groups, b.block_table, step.slot_mappings, for_cudagraph_capture=True)
    assert (md.num_built, md.num_reused) == (3, 0)
    # builders without update support are built per group
    groups = make_attention_groups(
        cfg, [FlashInferMetadataBuilder, FlashInferMetadataBuilder, MambaMetadataBuilder], b.block_table
    )
    md = build_attention_metadata(common, groups, b.block_table, step.slot_mappings)
    assert (md.num_built, md.num_reused) == (3, 0)
    assert md.by_layer["g1.l0"].paged_kv_indices[:3].tolist() == [5, 6, 8]
    # different specs are never shared
    sw = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, sliding_window=8)
    cfg2, b2, prep2 = build_world([FULL, sw])
    add(b2, "A", 4, ([1], [2]), 0)
    step2 = prep2.prepare(b2, {"A": 4})
    g2 = make_attention_groups(cfg2, [FlashAttentionMetadataBuilder] * 2, b2.block_table)
    md = build_attention_metadata(common_metadata_from_inputs(step2, b2.block_table), g2, b2.block_table, step2.slot_mappings)
    assert (md.num_built, md.num_reused) == (2, 0)


def test_kernel_block_mapping():
    cfg, b, prep = build_world([FULL])
    add(b, "A", 20, ([3, 7],), 19)
    step = prep.prepare(b, {"A": 1})
    ag = AttentionGroup(FlashAttentionMetadataBuilder, ("l",), FULL, 0, b.block_table.widths[0], 4, "cpu", kernel_block_size=8)
    assert ag.ratio == 2 and ag.kernel_spec.block_size == 8 and ag.kernel_spec.head_size == 8
    md = build_attention_metadata(common_metadata_from_inputs(step, b.block_table), [[ag]], b.block_table, step.slot_mappings)
    fa = md.by_layer["l"]
    assert fa.page_size == 8
    assert fa.block_table.shape == (1, 2 * b.block_table.widths[0])
    assert fa.block_table[0, :5].tolist() == [6, 7, 14, 15, 0]
    # slot mapping stays in manager blocks, which equals the kernel-block slot for dense layouts
    assert fa.slot_mapping.tolist() == [7 * 16 + 3] == [(7 * 2 + 3 // 8) * 8 + 3 % 8]
    # FlashInfer over kernel pages: seq 20, page 8 -> 3 pages, last page 4
    agi = AttentionGroup(FlashInferMetadataBuilder, ("l",), FULL, 0, b.block_table.widths[0], 4, "cpu", kernel_block_size=8)
    md = build_attention_metadata(common_metadata_from_inputs(step, b.block_table), [[agi]], b.block_table, step.slot_mappings)
    fi = md.by_layer["l"]
    assert fi.paged_kv_indptr.tolist() == [0, 3]
    assert fi.paged_kv_indices[:3].tolist() == [6, 7, 14]
    assert fi.paged_kv_last_page_len.tolist() == [4]
    # packed layout stride
    agp = AttentionGroup(FlashAttentionMetadataBuilder, ("l",), FULL, 0, 8, 4, "cpu", kernel_block_size=4, kernel_block_stride=5)
    out = agp.map_to_kernel_block_table(b.block_table[0].get_device_tensor(1), 1)
    assert out[0, :8].tolist() == [15, 16, 17, 18, 35, 36, 37, 38]
    with pytest.raises(ConfigError):
        AttentionGroup(FlashAttentionMetadataBuilder, ("l",), FULL, 0, 8, 4, "cpu", kernel_block_size=6)
    with pytest.raises(ConfigError):
        AttentionGroup(MambaMetadataBuilder, ("l",), MambaSpec(block_size=16), 0, 1, 4, "cpu", kernel_block_size=8)


def test_mamba_state_indices_align():
    spec = MambaSpec(block_size=4, mamba_cache_mode=MambaCacheMode.ALIGN, num_speculative_blocks=1)
    table = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24], [0, 0, 0, 0, 0]], dtype=torch.int32)
    seq = torch.tensor([9, 4, 0], dtype=torch.int32)
    # start = max((seq-1)//4, 0): 2, 0, 0
    # a row with seq_len 0 is padding (as inside a CUDA graph captured at the padded size)
    assert mamba_state_indices(table, seq, spec, 3).tolist() == [[12, 13], [20, 21], [-1, -1]]
    none = MambaSpec(block_size=4)
    assert mamba_state_indices(table, seq, none, 3).tolist() == [[10], [20], [-1]]


def test_mamba_state_indices_padded_rows_never_alias_live_state():
    """Rows past num_reqs are CUDA-graph padding: PAD_SLOT_ID, whatever stale ids the caller
    left there (here a live request's state 20 and 12)."""
    table = torch.tensor([[10, 11, 12], [20, 21, 22], [20, 21, 22], [12, 13, 14]], dtype=torch.int32)
    seq = torch.tensor([9, 4, 0, 0], dtype=torch.int32)
    align = MambaSpec(block_size=4, mamba_cache_mode=MambaCacheMode.ALIGN)
    assert mamba_state_indices(table, seq, align, 2).tolist() == [[12], [20], [-1], [-1]]
    assert mamba_state_indices(table, seq, align, 4).tolist() == [[12], [20], [-1], [-1]]
    none = MambaSpec(block_size=4, num_speculative_blocks=1)
    assert mamba_state_indices(table, seq, none, 1).tolist() == [[10, 11], [-1, -1], [-1, -1], [-1, -1]]
    assert mamba_state_indices(table[:, :1], seq[:0], none, 0).shape == (0, 2)
    with pytest.raises(ConfigError):
        mamba_state_indices(table, seq, none, 5)


def test_mamba_update_block_table_recomputes_indices():
    spec = MambaSpec(block_size=4, mamba_cache_mode=MambaCacheMode.ALIGN)
    cfg, b, prep = build_world([spec, spec])
    add(b, "A", 9, ([1, 2, 3], [4, 5, 6]), 8)
    step = prep.prepare(b, {"A": 1})
    groups = make_attention_groups(cfg, [MambaMetadataBuilder] * 2, b.block_table)
    md = build_attention_metadata(common_metadata_from_inputs(step, b.block_table), groups, b.block_table, step.slot_mappings)
    assert (md.num_built, md.num_reused) == (1, 1)
    assert md.by_layer["g0.l0"].state_indices.tolist() == [[3]]
    assert md.by_layer["g1.l0"].state_indices.tolist() == [[6]]
    assert step.slot_mappings.tolist() == [[-1], [-1]]  # Mamba groups have no slot mapping
    step = prep.prepare(b, {"A": 1}, num_reqs_padded=3)  # CUDA-graph padding rows
    md = build_attention_metadata(common_metadata_from_inputs(step, b.block_table), groups, b.block_table, step.slot_mappings)
    assert md.by_layer["g0.l0"].state_indices.tolist() == [[3], [-1], [-1]]
    assert md.by_layer["g1.l0"].state_indices.tolist() == [[6], [-1], [-1]]


def test_slot_mappings_by_group_and_layer():
    cfg, b, prep = build_world([FULL, FULL])
    add(b, "A", 3, ([1], [2]), 0)
    step = prep.prepare(b, {"A": 3})
    by_gid, by_layer = slot_mappings_by_group_and_layer(cfg, step.slot_mappings, step.num_tokens_padded)
    assert by_gid[0].tolist() == [16, 17, 18] and by_gid[1].tolist() == [32, 33, 34]
    assert by_layer["g0.l0"] is by_layer["g0.l1"] is by_gid[0]
    assert by_layer["g1.l1"] is by_gid[1]
