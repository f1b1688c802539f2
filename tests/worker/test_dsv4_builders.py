"""DeepSeek-V4's three index channels built per step from the real scheduler + worker tables.

Groups: main compressed MLA cache (C=4), indexer cache (C=4, other head size), sliding-window MLA
cache (W=8). A workload runs through the index-layer driver (sanitizer on); every step the
channels' metadata is built with the DSV4 builders and checked against values computed by hand
from the CPU block tables: compressed slots (only the token closing each group of C writes, at
``table[c // S] * S + c % S``), SWA window lists, and top-k index translation.
"""

import numpy as np
import pytest
import torch

from pagedkv.config import SchedulerConfig
from pagedkv.core.spec import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec, SlidingWindowMLASpec
from pagedkv.tools.index_driver import IndexLayerDriver
from pagedkv.tools.workload import WorkloadSpec, make_workload
from pagedkv.errors import ConfigError
from pagedkv.worker.dsv4_builders import CompressedMLAMetadataBuilder, SlidingWindowMLAMetadataBuilder
from pagedkv.worker.metadata import build_attention_metadata, common_metadata_from_inputs, make_attention_groups

B, C, W = 16, 4, 8
S = B // C


def _config():
    return KVCacheConfig(num_blocks=64, kv_cache_groups=[
        KVCacheGroupSpec(("mla.0", "mla.1"), MLAAttentionSpec(block_size=B, num_kv_heads=1, head_size=64, compress_ratio=C)),
        KVCacheGroupSpec(("indexer.0",), MLAAttentionSpec(block_size=B, num_kv_heads=1, head_size=32, compress_ratio=C)),
        KVCacheGroupSpec(("swa.0",), SlidingWindowMLASpec(block_size=B, num_kv_heads=1, head_size=64, sliding_window=W)),
    ])


def _expected(driver, step):
    bt = driver.batch.block_table
    rows, pos = step.req_indices, step.positions[: step.num_tokens].numpy()
    comp = {}
    for g in (0, 1):
        t = bt[g].block_table.np
        c = pos // C
        want = t[rows, c // S].astype(np.int64) * S + c % S
        comp[g] = np.where((pos + 1) % C == 0, want, -1)
    t = bt[2].block_table.np
    idx = np.full((step.num_tokens, W), -1, dtype=np.int64)
    lens = np.zeros(step.num_tokens, dtype=np.int64)
    for i, (r, p) in enumerate(zip(rows, pos)):
        start = max(p - (W - 1), 0)
        for k, q in enumerate(range(start, p + 1)):
            idx[i, k] = int(t[r, q // B]) * B + q % B
        lens[i] = p + 1 - start
    return comp, idx, lens


def test_dsv4_channels_every_step():
    kv = _config()
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=48, max_model_len=256)
    driver = IndexLayerDriver(kv, sc, vocab_size=500, sanitize=True)
    groups = make_attention_groups(
        driver.kv_cache_config,
        [CompressedMLAMetadataBuilder, CompressedMLAMetadataBuilder, SlidingWindowMLAMetadataBuilder],
        driver.batch.block_table,
    )
    wl = make_workload(WorkloadSpec(num_requests=5, shared_prefix_ratio=0.6, prefix_len=32,
                                    tail_len=(3, 40), max_tokens=(3, 20), vocab_size=500, seed=7),
                       max_len=200)
    checked = 0

    def check(rec):
        nonlocal checked
        step = driver.last_step_inputs
        if not rec.num_scheduled or step is None:
            return
        common = common_metadata_from_inputs(step, driver.batch.block_table)
        md = build_attention_metadata(common, groups, driver.batch.block_table, step.slot_mappings)
        comp, idx, lens = _expected(driver, step)
        for g in (0, 1):
            got = md.by_group[g][0].compressed_slot_mapping[: step.num_tokens].cpu().numpy()
            np.testing.assert_array_equal(got, comp[g], err_msg=f"group {g} step {rec.step}")
        swa = md.by_group[2][0]
        np.testing.assert_array_equal(swa.swa_indices[: step.num_tokens].cpu().numpy(), idx)
        np.testing.assert_array_equal(swa.swa_lens[: step.num_tokens].cpu().numpy(), lens)
        assert md.by_layer["mla.0"] is md.by_layer["mla.1"]
        checked += 1

    driver.run(wl, on_step=check)
    assert checked > 10
    assert driver.scheduler.kv_cache_manager.num_free_blocks == kv.num_blocks - 1


def test_indexer_topk_translation():
    kv = _config()
    sc = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256)
    driver = IndexLayerDriver(kv, sc, next_token=lambda t, p: torch.ones_like(t))
    driver.add_request("a", list(range(40)), max_tokens=4)
    driver.step()
    step = driver.last_step_inputs
    groups = make_attention_groups(
        driver.kv_cache_config,
        [CompressedMLAMetadataBuilder, CompressedMLAMetadataBuilder, SlidingWindowMLAMetadataBuilder],
        driver.batch.block_table,
    )
    md = build_attention_metadata(common_metadata_from_inputs(step, driver.batch.block_table), groups,
                                  driver.batch.block_table, step.slot_mappings)
    ix = md.by_group[1][0]
    table = driver.batch.block_table[1].block_table.np[0]
    topk = torch.tensor([[0, 3, 4, 9, -1], [2, -1, 5, 1000, 7]], dtype=torch.int32)
    got, lens = ix.topk_to_global(torch.zeros(2, dtype=torch.int32), topk)
    got = got.numpy()
    want = [[int(table[i // S]) * S + i % S if 0 <= i < 40 // C else -1 for i in row] for row in topk.tolist()]
    # index 1000 is past the table width: -1
    want[1][3] = -1
    assert got.tolist() == want
    assert lens.tolist() == [sum(v >= 0 for v in row) for row in want]


def test_builders_reject_wrong_specs():
    with pytest.raises(ConfigError):
        CompressedMLAMetadataBuilder(MLAAttentionSpec(block_size=16), ("x",), "cpu", 2, 4)
    with pytest.raises(ConfigError):
        SlidingWindowMLAMetadataBuilder(MLAAttentionSpec(block_size=16), ("x",), "cpu", 2, 4)
