"""Opt-in per-step invariant checks for the whole index layer.

Turn it on in tests, in ``pagedkv trace --sanitize`` and whenever a KV bug is suspected: every
check reads the state the components already keep (no shadow bookkeeping), so a failure points at
the component whose state is wrong. Each failure raises :class:`InvariantError` whose ``rule``
names the broken rule and whose ``details`` name the request / row / block / slot involved.

Rules (DESIGN.md, "Invariants worth a property test"):

control plane (``check_pool``)
  ``free+held=total``   free blocks + blocks with ref_cnt > 0 == num_blocks - 1 (null excluded)
  ``free-queue``        the free queue holds each free block once, only blocks with ref_cnt 0,
                        never the null block, and its length equals its counter
  ``ref=holders``       every block's ref_cnt equals the number of request block lists holding it
  ``null-block``        block 0 is the null block and nobody frees or caches it
data plane (``check_step``)
  ``table=held``        each batch row holds exactly the blocks its request holds in the manager
                        (entries the manager has since replaced by the null block may keep their
                        stale id: the V1 worker's tables are append-only, reference sec. 8.5)
  ``device=committed``  device block-table rows [0, num_reqs) equal the committed CPU rows
  ``padding``           device rows [num_reqs, num_reqs_padded) are all 0 (null block); slots
                        [num_tokens, padded) are -1; query_start_loc repeats its last value;
                        padded seq_lens are 0
  ``slot=formula``      slot == table[row, pos // B] * B + pos % B (CPU truth)
  ``slot-collision``    no two tokens of one step share a slot (per group)
  ``null-write``        no slot lies in the null block
  ``slot-owner``        every slot lies in a block that the token's request holds
  ``state-index``       a state group's (``SlotMappingMode.NONE``) state index of each live row
                        is a block the row's request holds, not the null block (mode none:
                        column 0; align: the block holding the step's last token), and no
                        two live rows share one; state groups get no slots
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.core.spec import SlotMappingMode
from pagedkv.errors import InvariantError

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.core.kv_cache_manager import KVCacheManager
    from pagedkv.worker.input_batch import InputBatch
    from pagedkv.worker.inputs import StepInputs


def _managers(kv_cache_manager: "KVCacheManager"):
    return kv_cache_manager.coordinator.single_type_managers


def check_pool(kv_cache_manager: "KVCacheManager") -> None:
    """Control-plane invariants of the block pool and the per-group managers."""
    pool = kv_cache_manager.block_pool
    null = pool.null_block
    if null.block_id != 0 or not null.is_null:
        raise InvariantError("null-block", "block 0 must be the null block", block=null.block_id)
    if null.block_hash is not None:
        raise InvariantError("null-block", "the null block must never be cached", block=0)

    free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    if len(free_ids) != pool.free_block_queue.num_free_blocks:
        raise InvariantError(
            "free-queue",
            "free-queue length differs from its counter",
            walked=len(free_ids),
            counter=pool.free_block_queue.num_free_blocks,
        )
    seen: set[int] = set()
    for bid in free_ids:
        if bid == 0:
            raise InvariantError("free-queue", "the null block is in the free queue", block=0)
        if bid in seen:
            raise InvariantError("free-queue", "a block is in the free queue twice", block=bid)
        seen.add(bid)
        if pool.blocks[bid].ref_cnt != 0:
            raise InvariantError(
                "free-queue", "a referenced block is in the free queue", block=bid,
                ref_cnt=pool.blocks[bid].ref_cnt,
            )

    holders: Counter[int] = Counter()
    owner: dict[int, str] = {}
    for gid, mgr in enumerate(_managers(kv_cache_manager)):
        for req_id, blocks in mgr.req_to_blocks.items():
            for b in blocks:
                if b.is_null:
                    continue
                holders[b.block_id] += 1
                owner.setdefault(b.block_id, f"{req_id}@group{gid}")
    held = 0
    for b in pool.blocks[1:]:
        if b.ref_cnt != holders.get(b.block_id, 0):
            raise InvariantError(
                "ref=holders",
                "a block's ref_cnt differs from the number of requests holding it",
                block=b.block_id,
                ref_cnt=b.ref_cnt,
                holders=holders.get(b.block_id, 0),
                first_holder=owner.get(b.block_id),
            )
        if b.ref_cnt > 0:
            held += 1
            if b.block_id in seen:
                raise InvariantError("free-queue", "a held block is in the free queue", block=b.block_id)
    total = pool.num_gpu_blocks - 1
    if held + len(free_ids) != total:
        raise InvariantError(
            "free+held=total",
            "free + held blocks differ from the pool size",
            free=len(free_ids),
            held=held,
            total=total,
        )


def check_step(
    kv_cache_manager: "KVCacheManager",
    batch: "InputBatch",
    step: "StepInputs",
) -> None:
    """Data-plane invariants after input preparation (tables committed, slots computed)."""
    bt = batch.block_table
    num_reqs, n_pad = step.num_reqs, step.num_reqs_padded
    cpu = bt.block_table.np
    dev = bt.block_table.gpu.cpu().numpy()
    managers = _managers(kv_cache_manager)

    # device=committed and padding rows
    if not np.array_equal(dev[:num_reqs], cpu[:num_reqs]):
        bad = np.nonzero((dev[:num_reqs] != cpu[:num_reqs]).any(axis=1))[0]
        r = int(bad[0])
        raise InvariantError(
            "device=committed", "device block-table row differs from the committed CPU row",
            row=r, req_id=batch.req_ids[r],
        )
    if n_pad > num_reqs and dev[num_reqs:n_pad].any():
        r = num_reqs + int(np.nonzero(dev[num_reqs:n_pad].any(axis=1))[0][0])
        raise InvariantError("padding", "padded block-table row is not the null block", row=r)

    qsl = step.query_start_loc_cpu.numpy()
    if np.any(np.diff(qsl) < 0) or np.any(qsl[num_reqs + 1 : n_pad + 1] != qsl[num_reqs]):
        raise InvariantError("padding", "query_start_loc must be non-decreasing with padded repeats")
    seq_lens = step.seq_lens_cpu.numpy()
    if np.any(seq_lens[num_reqs:n_pad] != 0):
        raise InvariantError("padding", "padded requests must have seq_len 0")

    # table=held
    for row in range(num_reqs):
        req_id = batch.req_ids[row]
        for gid, mgr in enumerate(managers):
            held = mgr.req_to_blocks.get(req_id)
            if held is None:
                raise InvariantError("table=held", "a batch row's request holds no blocks",
                                     row=row, req_id=req_id, group=gid)
            n = int(bt.num_blocks_per_row[gid, row])
            if n != len(held):
                raise InvariantError(
                    "table=held", "row block count differs from the request's held blocks",
                    row=row, req_id=req_id, group=gid, row_blocks=n, held=len(held),
                )
            view = bt[gid].block_table.np[row, :n]
            want = np.fromiter((b.block_id for b in held), dtype=np.int64, count=n)
            stale_ok = want == 0  # nulled by the manager after the worker received the id
            if np.any((view != want) & ~stale_ok):
                c = int(np.nonzero((view != want) & ~stale_ok)[0][0])
                raise InvariantError(
                    "table=held", "row entry differs from the request's block",
                    row=row, req_id=req_id, group=gid, column=c, row_block=int(view[c]),
                    held_block=int(want[c]),
                )

    # slots
    nt = step.num_tokens
    # The whole persistent buffer: every slot past this step's tokens must be -1.
    slots_all = bt.slot_mappings.cpu().numpy()
    positions = step.positions.cpu().numpy()[:nt]
    req_idx = step.req_indices
    for gid, mgr in enumerate(managers):
        mode = bt.slot_mapping_modes[gid]
        slots = slots_all[gid]
        if np.any(slots[nt:] != -1):
            t = nt + int(np.nonzero(slots[nt:] != -1)[0][0])
            raise InvariantError("padding", "slot of a padded token is not -1", group=gid, token=t)
        if mode != SlotMappingMode.TOKEN_TO_KV_SLOT:
            _check_state_indices(batch, mgr, gid, num_reqs, seq_lens)
            continue
        B = bt.block_sizes[gid]
        view = bt[gid].block_table.np
        s = slots[:nt]
        if bt.cp_world_size == 1:
            want = view[req_idx, positions // B].astype(np.int64) * B + positions % B
            if not np.array_equal(s, want):
                t = int(np.nonzero(s != want)[0][0])
                raise InvariantError(
                    "slot=formula", "slot differs from table[row, pos // B] * B + pos % B",
                    group=gid, token=t, row=int(req_idx[t]), req_id=batch.req_ids[int(req_idx[t])],
                    position=int(positions[t]), slot=int(s[t]), expected=int(want[t]),
                )
        written = s[s >= 0]
        if written.size != np.unique(written).size:
            vals, counts = np.unique(written, return_counts=True)
            raise InvariantError("slot-collision", "two tokens of one step share a slot",
                                 group=gid, slot=int(vals[counts > 1][0]))
        blocks = s // B
        if np.any((s >= 0) & (blocks == 0)):
            t = int(np.nonzero((s >= 0) & (blocks == 0))[0][0])
            raise InvariantError(
                "null-write", "a token would write into the null block", group=gid, token=t,
                req_id=batch.req_ids[int(req_idx[t])], slot=int(s[t]),
            )
        for row in range(num_reqs):
            req_id = batch.req_ids[row]
            owned = {b.block_id for b in mgr.req_to_blocks[req_id] if not b.is_null}
            sel = (req_idx == row) & (s >= 0)
            for t in np.nonzero(sel)[0]:
                if int(blocks[t]) not in owned:
                    raise InvariantError(
                        "slot-owner", "slot lies in a block the request does not hold",
                        group=gid, token=int(t), row=row, req_id=req_id, slot=int(s[t]),
                        block=int(blocks[t]),
                    )


def _check_state_indices(batch, mgr, gid: int, num_reqs: int, seq_lens: np.ndarray) -> None:
    """``state-index`` (see the module docstring), from the committed CPU table with the
    rule the state layers' metadata applies (``mamba_state_indices``)."""
    from pagedkv.core.spec import MambaCacheMode, MambaSpec

    spec = mgr.kv_cache_spec
    if not isinstance(spec, MambaSpec) or num_reqs == 0:
        return
    view = batch.block_table[gid].block_table.np[:num_reqs]
    if spec.mamba_cache_mode == MambaCacheMode.ALIGN:
        cols = np.maximum((seq_lens[:num_reqs].astype(np.int64) - 1) // spec.block_size, 0)
    else:
        cols = np.zeros(num_reqs, dtype=np.int64)
    idx = view[np.arange(num_reqs), np.minimum(cols, view.shape[1] - 1)].astype(np.int64)
    for row in range(num_reqs):
        req_id = batch.req_ids[row]
        owned = {b.block_id for b in mgr.req_to_blocks.get(req_id, ()) if not b.is_null}
        if idx[row] <= 0 or int(idx[row]) not in owned:
            raise InvariantError("state-index", "a live row's state index is not a block its "
                                 "request holds", group=gid, row=row, req_id=req_id,
                                 column=int(cols[row]), state_index=int(idx[row]))
    if np.unique(idx).size != idx.size:
        vals, counts = np.unique(idx, return_counts=True)
        raise InvariantError("state-index", "two live rows share a state block", group=gid,
                             state_index=int(vals[counts > 1][0]))
