"""State groups (``MambaSpec``, the seeds' ``SlotMappingMode.NONE``) in the engine's runner.

A toy hybrid model drives the real Scheduler -> ModelRunner -> Scheduler loop: one attention
layer (its KV is written but not read) and one state layer whose per-request state is two
tensors (a "conv" window of the last two token embeddings and a decaying sum ``h <- h/2 + x``),
read and written at the runner's state indices (``MambaMetadata``), as a Mamba mixer does.
Each token's hidden value is a function of the state after it and the next token follows from
it, so any state carried wrongly (lost across a chunk, not zeroed, not copied to the block an
align-mode step ends in, aliased between rows, resumed from the wrong checkpoint after a
prefix hit) changes the tokens. The reference runs the same float32 recurrence over each whole
sequence. Every step is also checked by the engine's sanitizer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.attention.backend import AttentionLayout
from pagedkv.config import CacheConfig, SchedulerConfig
from pagedkv.core.planning import hybrid_state_specs
from pagedkv.core.scheduler import Scheduler
from pagedkv.core.spec import FullAttentionSpec, KVCacheConfig, MambaCacheMode, MambaSpec
from pagedkv.errors import ConfigError
from pagedkv.sanitizer import check_pool, check_step
from pagedkv.tools.fake_model import TraceBackend
from pagedkv.worker.attn_builders import MambaMetadata
from pagedkv.worker.model_runner import ModelRunner, kv_cache_groups_for

V, D = 61, 6
ATTN, STATE = "model.layers.0.self_attn", "model.layers.1.mamba"


class _Cfg:
    vocab_size = V
    hidden_size = 1
    eos_token_ids = ()


class ToyStateModel:
    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.E = torch.randint(-3, 4, (V, D), generator=g).to(torch.float32)
        self.w = torch.randint(-2, 3, (D,), generator=g).to(torch.float32)
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.config = _Cfg()
        self.attn_backend = TraceBackend()
        self.layers = [None, None]
        self.state_rows_seen: list[list[int]] = []

    def kv_cache_specs(self, block_size: int) -> dict:
        return {ATTN: FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=4,
                                        dtype="float32"),
                STATE: MambaSpec(block_size=block_size, shapes=((2, D), (D,)),
                                 dtypes=("float32", "float32"))}

    def attention_layout(self, spec=None) -> AttentionLayout:
        return AttentionLayout(1, 1, 4, self.dtype, self.device)

    @staticmethod
    def emit(h: torch.Tensor, c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return h @ w + c.sum()

    def __call__(self, input_ids, positions, kv_caches, attention):
        md = attention.plans[1]
        assert isinstance(md, MambaMetadata)
        conv, ssm = kv_caches[1]
        assert conv.shape[1:] == (2, D) and ssm.shape[1:] == (D,)
        qsl = md.query_start_loc.tolist()
        idx = md.state_indices[:, 0].tolist()
        init = md.has_initial_state.tolist()
        n = md.num_actual_reqs
        assert all(i == -1 for i in idx[n:md.num_reqs])  # padded rows alias no state
        live = idx[:n]
        assert len(set(live)) == n and min(live, default=1) > 0, live  # live rows, own blocks
        self.state_rows_seen.append(live)
        assert md.num_decodes + md.num_prefills == n
        out = torch.zeros(input_ids.shape[0], 1)
        for r in range(n):
            s, a, b = idx[r], qsl[r], qsl[r + 1]
            if r < md.num_decodes:
                assert b - a == 1
            if r < md.num_decodes or init[r]:
                h, c = ssm[s].clone(), conv[s].clone()
            else:
                h, c = torch.zeros(D), torch.zeros(2, D)
            for t in range(a, b):
                x = self.E[int(input_ids[t])]
                h = 0.5 * h + x
                c = torch.cat([c[1:], x[None]])
                out[t, 0] = self.emit(h, c, self.w)
            ssm[s], conv[s] = h, c
        return out

    def compute_logits(self, hidden, indices=None, widen: bool = True):
        rows = hidden[:, 0] if indices is None else hidden[indices, 0]
        toks = torch.round(rows).to(torch.int64) % V
        logits = torch.zeros(rows.shape[0], V)
        logits[torch.arange(rows.shape[0]), toks] = 1.0
        return logits

    def reference(self, prompt: list[int], max_tokens: int) -> list[int]:
        toks, out = list(prompt), []
        h, c = torch.zeros(D), torch.zeros(2, D)
        for i in range(len(prompt) + max_tokens - 1):
            x = self.E[toks[i]]
            h = 0.5 * h + x
            c = torch.cat([c[1:], x[None]])
            if i >= len(prompt) - 1:
                nxt = int(torch.round(self.emit(h, c, self.w))) % V
                out.append(nxt)
                toks.append(nxt)
        return out


def _engine(model, *, block_size=16, num_blocks=64, max_model_len=128, prefix=False,
            max_num_batched_tokens=64, max_num_seqs=8):
    groups = kv_cache_groups_for(model, block_size, max_model_len=max_model_len,
                                 enable_prefix_caching=prefix)
    attn_block = groups[0].kv_cache_spec.block_size
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=tuple(groups))
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len)
    cc = CacheConfig(block_size=attn_block, num_gpu_blocks=num_blocks, enable_prefix_caching=prefix)
    sched = Scheduler(sc, kv, cc)
    runner = ModelRunner(model, kv, sc, cc, device="cpu")
    runner.step_check = lambda step: check_step(sched.kv_cache_manager, runner.input_batch, step)
    return sched, runner


def _run(sched, runner, prompts: dict[str, list[int]], max_tokens: int, stagger=None):
    got = {rid: [] for rid in prompts}
    pending = list(prompts)
    stats = dict(hits=0, preempted=0, steps=0)
    first = pending if stagger is None else pending[:stagger]
    for rid in first:
        sched.add_request(sched.make_request(rid, prompts[rid], max_tokens=max_tokens, ignore_eos=True))
    later = [] if stagger is None else pending[stagger:]
    while sched.has_requests() or later:
        if not sched.has_requests():
            rid = later.pop(0)
            sched.add_request(sched.make_request(rid, prompts[rid], max_tokens=max_tokens,
                                                 ignore_eos=True))
        so = sched.schedule()
        stats["preempted"] += len(so.preempted_req_ids or ())
        out = sched.update_from_output(so, runner.execute_model(so))
        check_pool(sched.kv_cache_manager)
        st = out.scheduler_stats
        if st is not None and st.prefix_cache_stats is not None:
            stats["hits"] += st.prefix_cache_stats.hits
        for o in out.outputs:
            got[o.req_id].extend(o.new_token_ids)
        stats["steps"] += 1
        assert stats["steps"] < 2000
    return got, stats


def _prompts(lengths, seed=1):
    rng = np.random.default_rng(seed)
    return {f"r{i}": rng.integers(0, V, n).tolist() for i, n in enumerate(lengths)}


def test_hybrid_state_specs_layout():
    # a 5248-byte state (conv (3, 96) + ssm (4, 16, 16), fp32) beside 256-byte attention tokens:
    # the attention block grows to 32 (16-aligned, 8192-byte page), the state page is padded
    specs = {"a": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype="float32"),
             "m": MambaSpec(block_size=16, shapes=((3, 96), (4, 16, 16)),
                            dtypes=("float32", "float32"))}
    out, b = hybrid_state_specs(specs, block_size=16, max_model_len=100, enable_prefix_caching=False)
    assert b == 32 and out["a"].block_size == 32 and out["a"].page_size_bytes == 8192
    m = out["m"]
    assert (m.block_size, m.mamba_cache_mode, m.page_size_padded, m.state_bytes) == (
        100, MambaCacheMode.NONE, 8192, 5248)
    out, b = hybrid_state_specs(specs, block_size=64, max_model_len=100, enable_prefix_caching=True)
    assert b == 64 and out["m"].block_size == 64 and out["m"].mamba_cache_mode == MambaCacheMode.ALIGN
    assert out["m"].page_size_padded == 16384
    with pytest.raises(ConfigError, match="state layers only"):
        hybrid_state_specs({"m": specs["m"]}, block_size=16, max_model_len=64,
                           enable_prefix_caching=False)


def test_state_views_are_pages_of_the_pool():
    model = ToyStateModel()
    sched, runner = _engine(model, num_blocks=9)
    conv, ssm = runner.kv_caches[1]
    assert conv.shape == (9, 2, D) and ssm.shape == (9, D)
    assert runner.kv_caches[0].untyped_storage().data_ptr() == conv.untyped_storage().data_ptr()
    page = runner.kv_pool.pages[0]
    assert page.shape[0] == 9
    conv[4].fill_(1.0)
    ssm[4].fill_(2.0)
    # block 4's page holds exactly its conv then its ssm state, nothing of block 3 or 5
    f = page[4].view(torch.float32)
    assert f[: 2 * D].eq(1.0).all() and f[2 * D: 3 * D].eq(2.0).all()
    assert page[3].eq(0).all() and page[5].eq(0).all()
    runner.kv_pool.zero_blocks(torch.tensor([4]))
    assert conv.eq(0).all() and ssm.eq(0).all()


@pytest.mark.parametrize("block_size", [16, 32])
def test_mode_none_matches_whole_sequence(block_size):
    model = ToyStateModel()
    sched, runner = _engine(model, block_size=block_size, max_num_batched_tokens=24)
    spec = runner.kv_cache_config.kv_cache_groups[1].kv_cache_spec
    assert spec.mamba_cache_mode == MambaCacheMode.NONE and spec.block_size == 128
    prompts = _prompts([5, 1, 40, 17, 63, 2])
    got, st = _run(sched, runner, prompts, max_tokens=12)
    for rid, p in prompts.items():
        assert got[rid] == model.reference(p, 12), rid
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 63


def test_state_preemption_recomputes():
    model = ToyStateModel()
    # 12 blocks: the attention group needs a block per 16 tokens, each request one state block
    sched, runner = _engine(model, num_blocks=12, max_num_batched_tokens=32)
    prompts = _prompts([30, 28, 33, 25], seed=3)
    got, st = _run(sched, runner, prompts, max_tokens=20)
    assert st["preempted"] > 0
    for rid, p in prompts.items():
        assert got[rid] == model.reference(p, 20), rid


def test_align_mode_prefix_hit_resumes_from_the_checkpoint():
    model = ToyStateModel()
    sched, runner = _engine(model, prefix=True, max_num_batched_tokens=20)
    spec = runner.kv_cache_config.kv_cache_groups[1].kv_cache_spec
    assert spec.mamba_cache_mode == MambaCacheMode.ALIGN and spec.block_size == 16
    rng = np.random.default_rng(7)
    shared = rng.integers(0, V, 50).tolist()
    prompts = {"a": shared + rng.integers(0, V, 9).tolist(),
               "b": shared + rng.integers(0, V, 13).tolist(),
               "c": shared[:40] + rng.integers(0, V, 5).tolist()}
    got, st = _run(sched, runner, prompts, max_tokens=10, stagger=1)
    assert st["hits"] > 0  # b and c resumed from a's checkpoints
    for rid, p in prompts.items():
        assert got[rid] == model.reference(p, 10), rid


def test_align_copies_follow_the_block_boundary():
    model = ToyStateModel()
    sched, runner = _engine(model, prefix=True, max_num_batched_tokens=16)
    sched.add_request(sched.make_request("x", list(range(10)), max_tokens=30, ignore_eos=True))
    copies = []
    real = runner.aligned_state_copies

    def spy(num_sched):
        pairs = real(num_sched)
        copies.append((int(runner.input_batch.num_computed_tokens_cpu[0]), pairs))
        return pairs

    runner.aligned_state_copies = spy
    while sched.has_requests():
        so = sched.schedule()
        sched.update_from_output(so, runner.execute_model(so))
    # the state moves to a new block exactly when a step's tokens start a new block:
    # after 16 and 32 computed tokens (decode steps), never inside a block
    moved = [c for c, pairs in copies if pairs]
    assert moved == [16, 32]


def test_sanitizer_state_index_rule():
    from pagedkv.errors import InvariantError
    from pagedkv.sanitizer import _check_state_indices

    model = ToyStateModel()
    sched, runner = _engine(model, prefix=True, max_num_batched_tokens=64)
    seen = []
    runner.step_check = lambda step: seen.append(
        (step.seq_lens_cpu.numpy().copy(), step.num_reqs))
    for rid, p in _prompts([40, 20], seed=5).items():
        sched.add_request(sched.make_request(rid, p, max_tokens=4, ignore_eos=True))
    so = sched.schedule()
    sched.update_from_output(so, runner.execute_model(so))
    seq, n = seen[-1]
    mgr = sched.kv_cache_manager.coordinator.single_type_managers[1]
    _check_state_indices(runner.input_batch, mgr, 1, n, seq)  # the real step passes
    # the column of a state 16 tokens further on holds no block of the request yet
    with pytest.raises(InvariantError) as e:
        _check_state_indices(runner.input_batch, mgr, 1, n, seq + 16)
    assert e.value.rule == "state-index"


@pytest.mark.parametrize("budget", [20, 44, 100])
def test_align_mode_chunks_end_on_block_boundaries(budget):
    """vLLM's Mamba-align split: with prefix caching a prefill chunk that ends before the
    prompt's last block boundary ends on a boundary, so a cached block's state is the state at
    its end; a second identical prompt then resumes from a correct checkpoint."""
    model = ToyStateModel()
    sched, runner = _engine(model, prefix=True, max_num_batched_tokens=budget)
    prompt = np.random.default_rng(11).integers(0, V, 74).tolist()
    ends = []
    real = runner.execute_model

    def spy(so):
        ends.extend(sched.requests[r].num_computed_tokens for r in so.num_scheduled_tokens
                    if r in sched.requests)
        return real(so)

    runner.execute_model = spy
    got, st = _run(sched, runner, {"a": prompt, "b": list(prompt)}, max_tokens=6, stagger=1)
    assert got["a"] == got["b"] == model.reference(prompt, 6)
    assert st["hits"] > 0
    # chunk ends during a's prefill: multiples of 16 up to 64, then 74 (the tail)
    prefill_ends = sorted({e for e in ends if e <= 74})
    assert all(e % 16 == 0 for e in prefill_ends if e < 64), prefill_ends


@pytest.mark.parametrize("budget", [8, 14])
def test_align_mode_with_a_step_smaller_than_a_block(budget):
    """A budget below the block size: chunks inside a block update its state in place until
    the block's end, never crossing it, so cached blocks still hold their end states."""
    model = ToyStateModel()
    sched, runner = _engine(model, prefix=True, max_num_batched_tokens=budget)
    prompt = np.random.default_rng(12).integers(0, V, 50).tolist()
    got, st = _run(sched, runner, {"a": prompt, "b": prompt + [3, 4, 5]}, max_tokens=5, stagger=1)
    assert got["a"] == model.reference(prompt, 5)
    assert got["b"] == model.reference(prompt + [3, 4, 5], 5)
    assert st["hits"] > 0
