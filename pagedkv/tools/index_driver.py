"""The index layer end to end with the engine's own parts and a model without weights:
``Scheduler`` -> ``SchedulerOutput`` -> ``ModelRunner`` (the engine's runner: state update,
one table commit, every group's slot mapping in one launch, per-group metadata, sampling) ->
scheduler update, with :class:`~pagedkv.tools.fake_model.TraceModel` as the model.

This is what ``pagedkv trace`` runs and what the property tests drive with the sanitizer on
(the engine's sanitizer hook: the runner's ``step_check``), so what it prints and checks is
what the engine does. The model's tokens come from ``next_token(tokens, positions)``
(vectorized); nothing reads KV data. Per step the driver records each group's block-table
rows, slot mappings, the compressed slot mapping of compressed groups and CSR page indices
(display), hits, preemptions and the pool.
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
from pagedkv.tools.fake_model import NextTokens, TraceModel
from pagedkv.worker.inputs import StepInputs
from pagedkv.worker.model_runner import ModelRunner


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
        next_token: NextTokens | None = None,
        device: str | torch.device = "cpu",
        sanitize: bool = False,
        build_csr: bool = True,
        vocab_size: int = 1000,
    ) -> None:
        self.scheduler = Scheduler(scheduler_config, kv_cache_config, cache_config)
        self.kv_cache_config = self.scheduler.kv_cache_config
        self.specs = [g.kv_cache_spec for g in self.kv_cache_config.kv_cache_groups]
        self.device = torch.device(device)
        sc = scheduler_config
        self.model = TraceModel(self.kv_cache_config.kv_cache_groups, vocab_size, next_token,
                                self.device)
        cc = cache_config or CacheConfig(block_size=self.specs[0].block_size,
                                         num_gpu_blocks=self.kv_cache_config.num_blocks)
        self.runner = ModelRunner(self.model,
                                  self.model.kv_cache_config(self.kv_cache_config.num_blocks),
                                  sc, cc, device=self.device, enforce_eager=True)
        self.runner.step_check = self._on_step_inputs
        self.sanitize = sanitize
        # StepRecord.cached_blocks is filled when this is set (the trace page shows them)
        self.record_cached = False
        self.step_index = 0
        # The last prepared step's inputs (views of persistent buffers; valid until next step).
        self.last_step_inputs: StepInputs | None = None
        self._step_inputs: StepInputs | None = None
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

    @property
    def batch(self):
        """The runner's persistent batch."""
        return self.runner.input_batch

    @property
    def preparer(self):
        """The runner's input preparer."""
        return self.runner.preparer

    @property
    def states(self) -> dict:
        """The runner's request states."""
        return self.runner.requests

    def _on_step_inputs(self, step: StepInputs) -> None:
        """The runner's hook after input preparation (before the forward pass)."""
        self._step_inputs = step
        if self.sanitize:
            check_pool(self.scheduler.kv_cache_manager)
            check_step(self.scheduler.kv_cache_manager, self.runner.input_batch, step)

    # ----- one step ------------------------------------------------------------------------
    def step(self) -> StepRecord:
        sched = self.scheduler
        so = sched.schedule()
        self._step_inputs = None
        mro = self.runner.execute_model(so)
        batch = self.batch
        num_reqs = batch.num_reqs
        step_inputs = self._step_inputs
        groups: list[GroupIndices] = []
        sampled: dict[str, list[int]] = {}
        if step_inputs is not None:
            self.last_step_inputs = step_inputs
            groups = self._group_indices(step_inputs)
            for rid, i in mro.req_id_to_index.items():
                sampled[rid] = list(mro.sampled_token_ids[i])
        elif self.sanitize:
            check_pool(sched.kv_cache_manager)
        out = sched.update_from_output(so, mro)
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
