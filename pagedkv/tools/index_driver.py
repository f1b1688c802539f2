"""The index layer end to end, without a model: scheduler -> SchedulerOutput -> worker tables ->
slot mappings and CSR page indices -> a fake model's tokens -> scheduler update.

This is what ``pagedkv trace`` runs and what the property tests drive with the sanitizer on.
The "model" is a function ``(request_id, position) -> token``; nothing reads KV data, so the
driver exercises exactly the index layer: block allocation, prefix caching, chunked prefill,
preemption, row operations, commits, slot mappings and page indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from pagedkv.config import CacheConfig, SchedulerConfig
from pagedkv.core.output import ModelRunnerOutput, SchedulerOutput
from pagedkv.core.request import RequestStatus
from pagedkv.core.scheduler import Scheduler
from pagedkv.core.spec import KVCacheConfig, SlotMappingMode
from pagedkv.kernels.compressed_slot_mapping import compute_compressed_slot_mapping
from pagedkv.kernels.page_indices import build_page_indices
from pagedkv.sanitizer import check_pool, check_step
from pagedkv.worker.input_batch import CachedRequestState, InputBatch
from pagedkv.worker.inputs import InputPreparer, StepInputs
from pagedkv.worker.state_update import record_sampled_tokens, update_states

NextToken = Callable[[str, int], int]


@dataclass
class GroupIndices:
    """One group's per-step indices, copied to host lists for display/inspection."""

    slot_mapping: list[int]
    # Compressed groups (compress_ratio > 1): the slots of the tokens that write a state.
    compressed_slot_mapping: list[int] | None = None
    indptr: list[int] | None = None
    indices: list[int] | None = None
    last_page_len: list[int] | None = None


@dataclass
class StepRecord:
    step: int
    scheduler_output: SchedulerOutput
    row_req_ids: list[str]  # batch rows after the update (row order)
    num_scheduled: list[int]  # per row
    positions: list[int]
    block_tables: list[list[list[int]]]  # [group][row] -> block ids (live entries)
    groups: list[GroupIndices]
    sampled: dict[str, list[int]]
    finished: list[str]
    num_free_blocks: int
    usage: float
    preempted: list[str] = field(default_factory=list)
    cached_blocks: list[int] = field(default_factory=list)  # ids with a prefix-cache hash


class IndexLayerDriver:
    """Owns a Scheduler and the worker-side index state; ``step()`` runs one engine step."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig | None = None,
        next_token: NextToken | None = None,
        device: str | torch.device = "cpu",
        sanitize: bool = False,
        build_csr: bool = True,
    ) -> None:
        self.scheduler = Scheduler(scheduler_config, kv_cache_config, cache_config)
        self.kv_cache_config = self.scheduler.kv_cache_config
        self.specs = [g.kv_cache_spec for g in self.kv_cache_config.kv_cache_groups]
        self.device = torch.device(device)
        sc = scheduler_config
        self.batch = InputBatch(
            max_num_reqs=sc.max_num_seqs,
            max_model_len=sc.max_model_len,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            device=self.device,
            pin_memory=self.device.type == "cuda",
            block_sizes=[s.block_size for s in self.specs],
            max_num_blocks_per_req=[s.max_num_blocks_per_req(sc.max_model_len) for s in self.specs],
            slot_mapping_modes=[s.slot_mapping_mode for s in self.specs],
        )
        self.states: dict[str, CachedRequestState] = {}
        self.preparer = InputPreparer.for_batch(self.batch)
        self.next_token = next_token or (lambda rid, pos: 0)
        self.sanitize = sanitize
        # StepRecord.cached_blocks is filled when this is set (the trace page shows them)
        self.record_cached = False
        self.step_index = 0
        # The last prepared step's inputs (views of persistent buffers; valid until next step).
        self.last_step_inputs: StepInputs | None = None
        self._csr = None
        if build_csr:
            bt = self.batch.block_table
            i32 = dict(dtype=torch.int32, device=self.device)
            self._csr = [
                (
                    torch.zeros(sc.max_num_seqs + 1, **i32),
                    torch.zeros(sc.max_num_seqs * bt.widths[g], **i32),
                    torch.zeros(sc.max_num_seqs, **i32),
                )
                for g in range(bt.num_groups)
            ]
        # Running totals for the summary.
        self.total_steps = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.peak_usage = 0.0
        self.tokens_generated = 0

    # ----- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids, max_tokens: int, **kw) -> None:
        req = self.scheduler.make_request(
            request_id, prompt_token_ids, max_tokens=max_tokens, ignore_eos=True, **kw
        )
        self.scheduler.add_request(req)

    def abort(self, request_id: str) -> None:
        """Abort a waiting or running request; its blocks are freed exactly once."""
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()

    # ----- one step ------------------------------------------------------------------------
    def step(self) -> StepRecord:
        sched = self.scheduler
        so = sched.schedule()
        update_states(self.states, self.batch, so)
        batch = self.batch
        num_reqs = batch.num_reqs
        step_inputs: StepInputs | None = None
        groups: list[GroupIndices] = []
        sampled: dict[str, list[int]] = {}
        if so.total_num_scheduled_tokens > 0:
            step_inputs = self.preparer.prepare(batch, so.num_scheduled_tokens)
            self.last_step_inputs = step_inputs
            if self.sanitize:
                check_pool(sched.kv_cache_manager)
                check_step(sched.kv_cache_manager, batch, step_inputs)
            groups = self._group_indices(step_inputs)
            # The fake model samples a token for every row whose prompt is now complete.
            nsched = step_inputs.num_scheduled_tokens
            for row in range(num_reqs):
                rid = batch.req_ids[row]
                st = self.states[rid]
                if st.num_computed_tokens + int(nsched[row]) >= st.num_tokens:
                    sampled[rid] = [self.next_token(rid, st.num_tokens)]
                else:
                    sampled[rid] = []
            record_sampled_tokens(self.states, batch, sampled)
        elif self.sanitize:
            check_pool(sched.kv_cache_manager)
        out = sched.update_from_output(so, ModelRunnerOutput.from_sampled(sampled))
        if self.sanitize:
            check_pool(sched.kv_cache_manager)

        stats = out.scheduler_stats
        if stats is not None and stats.prefix_cache_stats is not None:
            self.prefix_queries += stats.prefix_cache_stats.queries
            self.prefix_hits += stats.prefix_cache_stats.hits
        usage = sched.kv_cache_manager.usage
        self.peak_usage = max(self.peak_usage, usage)
        self.tokens_generated += sum(len(o.new_token_ids) for o in out.outputs)
        self.total_steps += 1

        bt = batch.block_table
        record = StepRecord(
            step=self.step_index,
            scheduler_output=so,
            row_req_ids=list(batch.req_ids[:num_reqs]),
            num_scheduled=[] if step_inputs is None else step_inputs.num_scheduled_tokens.tolist(),
            positions=[] if step_inputs is None
            else step_inputs.positions[: step_inputs.num_tokens].cpu().tolist(),
            block_tables=[
                [bt[g].block_table.np[r, : bt.num_blocks_per_row[g, r]].tolist() for r in range(num_reqs)]
                for g in range(bt.num_groups)
            ],
            groups=groups,
            sampled=sampled,
            finished=list(out.finished_req_ids),
            num_free_blocks=sched.kv_cache_manager.num_free_blocks,
            usage=usage,
            preempted=sorted(so.preempted_req_ids),
            cached_blocks=self._cached_blocks() if self.record_cached else [],
        )
        self.step_index += 1
        return record

    def _cached_blocks(self) -> list[int]:
        """Ids of the blocks that carry a prefix-cache hash now (held or evictable)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return [b.block_id for b in pool.blocks if b.block_hash is not None]

    def _group_indices(self, step: StepInputs) -> list[GroupIndices]:
        bt = self.batch.block_table
        out = []
        slots = step.slot_mappings[:, : step.num_tokens].cpu()
        for g in range(bt.num_groups):
            gi = GroupIndices(slot_mapping=slots[g].tolist())
            spec = self.specs[g]
            if getattr(spec, "compress_ratio", 1) > 1:
                cslots = torch.empty(max(step.num_tokens, 1), dtype=torch.int64, device=self.device)
                compute_compressed_slot_mapping(
                    bt[g].get_device_tensor(step.num_reqs), step.query_start_loc, step.seq_lens,
                    cslots, step.num_reqs, step.num_tokens, spec.storage_block_size,
                    spec.compress_ratio, own_slot_mapping=step.slot_mappings[g],
                )
                gi.compressed_slot_mapping = cslots[: step.num_tokens].cpu().tolist()
            if self._csr is not None and bt.slot_mapping_modes[g] == SlotMappingMode.TOKEN_TO_KV_SLOT:
                indptr, indices, last = self._csr[g]
                build_page_indices(
                    bt[g].get_device_tensor(step.num_reqs_padded), step.seq_lens,
                    bt.block_sizes[g], step.num_reqs, step.num_reqs_padded, indptr, indices, last,
                )
                n = step.num_reqs
                ip = indptr[: n + 1].cpu()
                gi.indptr = ip.tolist()
                gi.indices = indices[: int(ip[-1])].cpu().tolist()
                gi.last_page_len = last[:n].cpu().tolist()
            out.append(gi)
        return out

    # ----- whole runs ----------------------------------------------------------------------
    def run(self, workload, max_steps: int = 100_000, on_step=None) -> None:
        """Feed ``workload`` (WorkloadRequest list) by arrival step and step until done."""
        pending = sorted(workload, key=lambda r: r.arrival_step)
        i = 0
        while i < len(pending) or self.has_requests():
            if self.step_index >= max_steps:
                from pagedkv.errors import InvariantError

                raise InvariantError(
                    "progress", f"workload not finished after {max_steps} steps",
                    running=self.scheduler.num_running, waiting=self.scheduler.num_waiting,
                )
            while i < len(pending) and pending[i].arrival_step <= self.step_index:
                r = pending[i]
                self.add_request(r.request_id, r.prompt_token_ids, r.max_tokens)
                i += 1
            rec = self.step()
            if on_step is not None:
                on_step(rec)

    def summary(self) -> dict:
        sched = self.scheduler
        return {
            "steps": self.total_steps,
            "preemptions": sched.num_preemptions,
            "prefix_queries": self.prefix_queries,
            "prefix_hits": self.prefix_hits,
            "prefix_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
            "peak_usage": self.peak_usage,
            "tokens_generated": self.tokens_generated,
            "num_blocks": self.kv_cache_config.num_blocks,
            "free_blocks_at_end": sched.kv_cache_manager.num_free_blocks,
            "unfinished": sched.get_request_counts()[0] + sched.get_request_counts()[1],
        }


def as_numpy_table(record: StepRecord, group: int) -> np.ndarray:
    """A step's block table of one group as a ragged-free numpy array (0-padded)."""
    rows = record.block_tables[group]
    width = max((len(r) for r in rows), default=0)
    arr = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        arr[i, : len(r)] = r
    return arr
