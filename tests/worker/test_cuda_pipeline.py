"""The data plane on CUDA: pinned staging, copy events, native Triton kernels; results must
equal the CPU pipeline's (which uses the torch references or the interpreter)."""

import pytest
import torch

from pagedkv.core.output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedkv.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.worker.attn_builders import FlashAttentionMetadataBuilder, FlashInferMetadataBuilder
from pagedkv.worker.buffers import CpuGpuBuffer
from pagedkv.worker.input_batch import InputBatch
from pagedkv.worker.inputs import InputPreparer
from pagedkv.worker.metadata import (
    AttentionGroup,
    build_attention_metadata,
    common_metadata_from_inputs,
)
from pagedkv.worker.state_update import record_sampled_tokens, update_states

pytestmark = pytest.mark.gpu

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8)


def _sched(new=(), cached=(), num=None, finished=()):
    cd = CachedRequestData()
    for rid, comp, blocks in cached:
        cd.req_ids.append(rid)
        cd.num_computed_tokens.append(comp)
        cd.new_block_ids.append(blocks)
    num = dict(num)
    return SchedulerOutput([NewRequestData(r, list(p), None, b, 0) for r, p, b in new], cd, num,
                           sum(num.values()), finished_req_ids=set(finished))


def run_pipeline(device):
    cfg = KVCacheConfig(64, [KVCacheGroupSpec(("a",), SPEC), KVCacheGroupSpec(("b",), SPEC)])
    batch = InputBatch(4, 64, 64, device, True, [16, 16], [4, 4])
    prep = InputPreparer(4, 64, device, True)
    groups = [
        [AttentionGroup(FlashAttentionMetadataBuilder, ("a",), SPEC, 0, 8, 4, device, kernel_block_size=8)],
        [AttentionGroup(FlashInferMetadataBuilder, ("b",), SPEC, 1, 8, 4, device)],
    ]
    reqs, out = {}, []
    steps = [
        (_sched(new=[("A", range(20), ([1, 2], [3, 4])), ("B", range(5), ([5], [6]))], num={"A": 20, "B": 5}), [[7], [8]]),
        (_sched(new=[("C", range(3), ([9], [10]))], cached=[("A", 20, None), ("B", 5, None)],
                num={"A": 1, "B": 1, "C": 3}), [[1], [2], [3]]),
        (_sched(cached=[("C", 3, ([11], [12]))], num={"C": 1}, finished=["A"]), [[4]]),
    ]
    for so, sampled in steps:
        update_states(reqs, batch, so, reorder_threshold=1)
        step = prep.prepare(batch, so.num_scheduled_tokens, num_reqs_padded=4, num_tokens_padded=32)
        md = build_attention_metadata(common_metadata_from_inputs(step, batch.block_table), groups,
                                      batch.block_table, step.slot_mappings)
        fa, fi = md.by_layer["a"], md.by_layer["b"]
        n = fi.paged_kv_indptr[-1].item()
        out.append([
            list(batch.req_ids), step.positions.tolist(), step.input_ids.tolist(),
            step.query_start_loc.tolist(), step.seq_lens.tolist(), step.slot_mappings.tolist(),
            batch.block_table.block_table.gpu.tolist(), fa.block_table.tolist(),
            fi.paged_kv_indptr.tolist(), fi.paged_kv_indices[:n].tolist(),
            fi.paged_kv_last_page_len.tolist(),
        ])
        record_sampled_tokens(reqs, batch, sampled)  # mutates pinned staging after a commit
    return out


def test_cuda_pipeline_matches_cpu():
    assert run_pipeline("cuda") == run_pipeline("cpu")


def test_pinned_copy_event_waited_before_write():
    b = CpuGpuBuffer(1 << 20, dtype=torch.int32, device="cuda", pin_memory=True)
    assert b.cpu.is_pinned()
    b.np[:] = 3
    b.copy_to_gpu()
    assert b._pending is not None
    b.wait_for_copy()
    assert b._pending is None
    b.np[:] = 4  # safe now
    assert b.gpu[-1].item() == 3
