"""Cascade attention's per-group fields in the attention metadata: each KV-cache group's
shared prefix length, its persistent device scalar (written only when the value changes), the
fields through both the build and the reuse path, and a capture's ``use_cascade`` attaching
the scalar alone."""

import dataclasses

from test_metadata import FULL, add, build_world

from pagedkv.core.spec import MambaSpec
from pagedkv.worker.attn_builders import CommonMetadataBuilder, MambaMetadataBuilder
from pagedkv.worker.metadata import (
    build_attention_metadata,
    common_metadata_from_inputs,
    make_attention_groups,
    set_common_prefix_lens,
)


def world():
    cfg, b, prep = build_world([FULL, FULL, MambaSpec(block_size=64)])
    add(b, "A", 40, ([3, 4, 5], [6, 7, 8], [2]), 39)
    add(b, "B", 36, ([3, 4, 9], [6, 7, 10], [11]), 35)
    step = prep.prepare(b, {"A": 1, "B": 1})
    groups = make_attention_groups(
        cfg, [CommonMetadataBuilder, CommonMetadataBuilder, MambaMetadataBuilder], b.block_table)
    return b, step, groups, common_metadata_from_inputs(step, b.block_table)


def test_prefix_fields_per_group_built_and_reused():
    b, step, groups, common = world()
    md = build_attention_metadata(common, groups, b.block_table, step.slot_mappings,
                                  common_prefix_lens=[32, 16, 0])
    assert (md.num_built, md.num_reused) == (2, 1)  # group 1 reuses group 0's metadata
    m0, m1 = md.by_group[0][0], md.by_group[1][0]
    assert (m0.common_prefix_len, m1.common_prefix_len) == (32, 16)
    assert m0.common_prefix_len_device is groups[0][0].common_prefix_len_device
    assert m1.common_prefix_len_device is groups[1][0].common_prefix_len_device
    assert m0.common_prefix_len_device.tolist() == [32]
    assert m1.common_prefix_len_device.tolist() == [16]
    assert m1.block_table_tensor[:, :3].tolist() == [[6, 7, 8], [6, 7, 10]]
    # without lengths: no cascade fields (the plain step's metadata is unchanged)
    md = build_attention_metadata(common, groups, b.block_table, step.slot_mappings)
    m0 = md.by_group[0][0]
    assert (m0.common_prefix_len, m0.common_prefix_len_device, m0.use_cascade) == (0, None, None)


def test_capture_with_use_cascade_attaches_the_scalar():
    b, step, groups, common = world()
    set_common_prefix_lens(groups, [48, 48, 0])
    cap = dataclasses.replace(common, use_cascade=True)
    md = build_attention_metadata(cap, groups, b.block_table, step.slot_mappings,
                                  for_cudagraph_capture=True)
    m0 = md.by_group[0][0]
    assert m0.use_cascade is True and m0.common_prefix_len == 0
    assert m0.common_prefix_len_device is groups[0][0].common_prefix_len_device
    assert m0.common_prefix_len_device.tolist() == [48]  # the capture leaves the value alone


def test_device_scalar_written_only_on_change():
    _, _, groups, _ = world()
    ag = groups[0][0]
    buf = ag.common_prefix_len_device
    calls = []
    real_fill = buf.fill_
    buf.fill_ = lambda v: calls.append(v) or real_fill(v)
    for n in (32, 32, 48, 48, 0, 0):
        ag.set_common_prefix_len(n)
        assert buf.tolist() == [n]
    assert calls == [32, 48, 0]
