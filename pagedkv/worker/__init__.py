"""Data plane: persistent batch, block tables, attention metadata (torch, CPU or CUDA).

Where each concept lives:

* ``buffers``       CpuGpuBuffer: host staging tensor (pinned on CUDA) + device mirror.
* ``block_table``   BlockTable (one group), MultiGroupBlockTable (all groups in one buffer),
                    get_block_table_width, row ops, commit_block_table, slot mappings.
* ``input_batch``   CachedRequestState, InputBatch: rows, add/remove/condense/swap/reorder.
* ``state_update``  update_states (apply a SchedulerOutput), record_sampled_tokens.
* ``inputs``        InputPreparer.prepare -> StepInputs (positions, query_start_loc, seq_lens,
                    slot mappings, CUDA-graph padding).
* ``metadata``      CommonAttentionMetadata, AttentionGroup (kernel block size),
                    build_attention_metadata (cross-group reuse), slot mappings by group/layer.
* ``attn_builders`` FlashAttention-, FlashInfer- and Mamba-style metadata builders.

Modules are imported explicitly (``from pagedkv.worker.block_table import ...``); this package
imports nothing so that ``TRITON_INTERPRET`` can still be set before any kernel module loads.
"""
