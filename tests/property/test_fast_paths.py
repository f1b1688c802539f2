"""Every fast path against its slow twin, over random inputs (hypothesis):

* ``KVCacheManager.allocate_running_slots`` (the decode hot path: one full-attention group,
  the held list grown in place) against ``allocate_slots``: two managers driven by the same
  random schedule give the same blocks, the same free-queue order, the same prefix-cache
  registrations and the same refusals, with prefix caching on and off, lookahead and a
  watermark;
* the scheduler's inlined stop check (``update_from_output`` skips ``check_stop`` when a
  token cannot end the request) against ``check_stop`` applied token by token to a shadow of
  each request: same finish step, reason and stop token, with EOS, stop ids, min_tokens,
  max_tokens and the context limit in play;
* the host slot-mapping path of ``MultiGroupBlockTable`` (numpy, what a CPU engine runs; the
  tests' interpreter mode would otherwise never take it) against the kernel module's torch
  twin ``compute_slot_mappings_ref``: random groups (block sizes, ``NONE`` groups), decode
  context parallelism, padding, positions past the table.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.config import SchedulerConfig
from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.output import ModelRunnerOutput
from pagedkv.core.request import Request, RequestStatus
from pagedkv.core.scheduler import Scheduler, check_stop
from pagedkv.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlotMappingMode
from pagedkv.kernels.slot_mapping import compute_slot_mappings_ref
from pagedkv.worker.block_table import MultiGroupBlockTable, _slot_mappings_host

# --------------------------------------------------------------------------------------------
# decode allocation

B = 4
PREFIX = list(range(500, 524))


def _state(mgr: KVCacheManager) -> tuple:
    pool = mgr.block_pool
    return ([b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            sorted((b.block_id, b.block_hash) for b in pool.blocks if b.block_hash is not None),
            {rid: [b.block_id for b in blocks]
             for rid, blocks in mgr.coordinator.single_type_managers[0].req_to_blocks.items()})


alloc_ops = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 24), st.integers(1, 11)),
    st.tuples(st.just("decode"), st.integers(0, 7), st.integers(1, 3), st.integers(0, 3)),
    st.tuples(st.just("decode"), st.integers(0, 7), st.integers(1, 1), st.integers(0, 0)),
    st.tuples(st.just("free"), st.integers(0, 7)),
), min_size=5, max_size=60)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=alloc_ops, caching=st.booleans(), watermark=st.sampled_from([0.0, 0.1]),
       num_blocks=st.integers(8, 24))
def test_allocate_running_slots_equals_allocate_slots(ops, caching, watermark, num_blocks):
    cfg = KVCacheConfig(num_blocks=num_blocks,
                        kv_cache_groups=[KVCacheGroupSpec(("l0",), FullAttentionSpec(block_size=B))])
    fast = KVCacheManager(cfg, max_model_len=64, enable_caching=caching, watermark=watermark)
    slow = KVCacheManager(cfg, max_model_len=64, enable_caching=caching, watermark=watermark)
    assert fast._fast_manager is not None  # the fast path exists for this layout
    reqs: dict[str, tuple[Request, Request]] = {}
    n = 0
    for op in ops:
        if op[0] == "admit":
            n += 1
            toks = PREFIX[:op[1]] + [1000 + 10 * n + k for k in range(op[2])]
            pair = tuple(Request(f"r{n}", toks, block_hasher=m.block_hasher) for m in (fast, slow))
            got = []
            for m, r in zip((fast, slow), pair):
                hits, n_hit = m.get_computed_blocks(r)
                new = r.num_tokens - n_hit
                out = m.allocate_slots(r, new, n_hit, hits)
                got.append(None if out is None else out.get_block_ids())
                if out is not None:
                    r.num_computed_tokens = r.num_tokens
                    r.status = RequestStatus.RUNNING
                    r.append_output_token_ids(7 + n % 3)
            assert got[0] == got[1]
            if got[0] is not None:
                reqs[f"r{n}"] = pair
        elif op[0] == "decode" and reqs:
            rid = sorted(reqs)[op[1] % len(reqs)]
            rf, rs = reqs[rid]
            k = min(op[2], rf.num_tokens - rf.num_computed_tokens + op[2] - 1)
            k = max(1, min(k, 64 - rf.num_computed_tokens))
            if rf.num_computed_tokens + k > 64:
                continue
            a = fast.allocate_running_slots(rf, k, num_lookahead_tokens=op[3])
            b = slow.allocate_slots(rs, k, num_lookahead_tokens=op[3])
            assert (a is None) == (b is None)
            if a is not None:
                assert a.get_block_ids() == b.get_block_ids()
                for r in (rf, rs):
                    r.num_computed_tokens += k
                    while r.num_tokens <= r.num_computed_tokens:
                        r.append_output_token_ids(3 + r.num_tokens % 5)
        elif op[0] == "free" and reqs:
            rid = sorted(reqs)[op[1] % len(reqs)]
            rf, rs = reqs.pop(rid)
            fast.free(rf)
            slow.free(rs)
        assert _state(fast) == _state(slow)


# --------------------------------------------------------------------------------------------
# the scheduler's inlined stop check

EOS = 2
stop_cases = st.lists(st.tuples(
    st.integers(1, 12),                        # prompt length
    st.integers(1, 14),                        # max_tokens
    st.integers(0, 5),                         # min_tokens
    st.booleans(),                             # ignore_eos
    st.lists(st.integers(0, 6), max_size=2),   # stop_token_ids
    st.lists(st.integers(0, 6), min_size=20, max_size=20),  # the tokens the model samples
), min_size=1, max_size=5)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases=stop_cases, max_model_len=st.sampled_from([16, 24, 64]))
def test_inlined_stop_check_equals_check_stop(cases, max_model_len):
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=max_model_len)
    kv = KVCacheConfig(num_blocks=64, kv_cache_groups=[
        KVCacheGroupSpec(("l0",), FullAttentionSpec(block_size=B))])
    sched = Scheduler(sc, kv)
    shadows, streams = {}, {}
    for i, (plen, max_tokens, min_tokens, ignore_eos, stop_ids, toks) in enumerate(cases):
        if plen >= max_model_len:
            continue
        kw = dict(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                  ignore_eos=ignore_eos, stop_token_ids=stop_ids, eos_token_id=EOS)
        prompt = [10 + (i * 7 + k) % 40 for k in range(plen)]
        sched.add_request(sched.make_request(f"q{i}", prompt, **kw))
        shadows[f"q{i}"] = sched.make_request(f"q{i}", prompt, **kw)
        streams[f"q{i}"] = list(toks)
    # the slow twin: check_stop after every token of the shadow request
    want = {}
    for rid, r in shadows.items():
        for j, t in enumerate(streams[rid]):
            r.append_output_token_ids(t)
            if check_stop(r, max_model_len):
                want[rid] = (j + 1, r.get_finished_reason(), r.stop_reason)
                break
    got, produced = {}, {rid: 0 for rid in shadows}
    for _ in range(40):
        if not sched.has_requests():
            break
        so = sched.schedule()
        sampled = {}
        for rid, num in so.num_scheduled_tokens.items():
            req = sched.requests[rid]
            if req.num_computed_tokens + num >= req.num_tokens:
                sampled[rid] = [streams[rid][produced[rid]]]
                produced[rid] += 1
            else:
                sampled[rid] = []
        out = sched.update_from_output(so, ModelRunnerOutput.from_sampled(sampled))
        for o in out.outputs:
            if o.finish_reason is not None:
                got[o.req_id] = (produced[o.req_id], o.finish_reason, o.stop_reason)
    assert got == want


# --------------------------------------------------------------------------------------------
# host slot mappings


@st.composite
def slot_cases(draw):
    cp = draw(st.sampled_from([1, 1, 2, 4]))
    inter = draw(st.sampled_from([1, 2])) if cp > 1 else 1
    g = draw(st.integers(1, 3))
    sizes = [draw(st.sampled_from([2, 4, 8, 16])) * (inter if cp > 1 else 1) for _ in range(g)]
    modes = [draw(st.sampled_from([SlotMappingMode.TOKEN_TO_KV_SLOT] * 3 + [SlotMappingMode.NONE]))
             for _ in range(g)]
    max_blocks = [draw(st.integers(1, 6)) for _ in range(g)]
    num_reqs = draw(st.integers(0, 5))
    counts = [draw(st.integers(0, 9)) for _ in range(num_reqs)]
    pad = draw(st.integers(0, 4))
    rows = [[[draw(st.integers(1, 60)) for _ in range(draw(st.integers(0, max_blocks[k])))]
             for k in range(g)] for _ in range(num_reqs)]
    starts = [draw(st.integers(-3, 40)) for _ in range(num_reqs)]
    rank = draw(st.integers(0, cp - 1))
    return cp, inter, rank, sizes, modes, max_blocks, counts, pad, rows, starts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=slot_cases())
def test_host_slot_mappings_equal_the_kernel_twin(case):
    cp, inter, rank, sizes, modes, max_blocks, counts, pad, rows, starts = case
    num_reqs = len(counts)
    max_tokens = 64
    bt = MultiGroupBlockTable(8, max_tokens, "cpu", False, sizes,
                              [m * cp for m in max_blocks], modes,
                              cp_world_size=cp, cp_rank=rank, cp_interleave=inter)
    for r, ids in enumerate(rows):
        bt.add_row(ids, r)
    bt.commit_block_table(num_reqs)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]), dtype=torch.int32)
    total = int(qsl[-1])
    num_tokens = min(total + pad, max_tokens)
    pos = torch.full((max_tokens,), 10**6, dtype=torch.int64)
    t = 0
    for r, c in enumerate(counts):
        pos[t:t + c] = torch.arange(starts[r], starts[r] + c)
        t += c
    if total > max_tokens:
        return
    # the host path (forced on: under the interpreter the table would take the kernel)
    bt._slot_mappings_np = bt.slot_mappings.numpy()
    bt.slot_mappings.fill_(-7)
    assert _slot_mappings_host(bt, num_reqs, num_tokens, qsl, pos)
    host = bt.slot_mappings.clone()
    twin = torch.full_like(host, -7)
    compute_slot_mappings_ref(bt.block_table.gpu, bt.group_col_start, bt.group_width,
                              bt.group_block_size, bt.group_mode, qsl, pos, twin, num_reqs,
                              num_tokens, cp, rank, inter)
    assert torch.equal(host, twin)
    # the engine's entry (token rows + positions from the host arrays) gives the same values
    if total == num_tokens:
        token_rows = np.repeat(np.arange(num_reqs, dtype=np.int64), counts)
        bt.slot_mappings.fill_(-7)
        bt.compute_slot_mappings_host(token_rows, pos[:total].numpy())
        assert torch.equal(bt.slot_mappings, twin)
