"""Decode context parallelism (``pagedkv.distributed``, DCP) on the CPU over gloo: with
``tensor_parallel_size=2, decode_context_parallel_size=2`` the two ranks hold the same KV heads
and each its interleaved share of every request's tokens; greedy tokens equal the one-process
engine's (fp32) on tiny Llama and Qwen3 checkpoints with chunked prefill, prefix-cache hits,
preemption, interleave 1 and 4, every step's slot mapping and local lengths checked by brute
force against the seeds' rule inside the ranks (``PAGEDKV_DCP_CHECK=1``); the pool holds twice
the tokens. In-process: the global positions of local keys and the step check on the seeds'
worked example (reference sec. 12) by hand, the per-rank partial attention merged by
log-sum-exp against full attention (chunked queries, a window, rows with no local key)."""

import types

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.attention.torch_ref import cp_global_positions, paged_attention_ref
from pagedkv.distributed.group import DCPGroup, merge_partials
from pagedkv.errors import ConfigError, InvariantError

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PREFIX = list(range(100, 132))
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], list(range(20, 61)), PREFIX + [7, 8, 9],
           PREFIX + [40, 41, 42, 43, 44]]


def test_global_positions_of_local_keys_by_hand():
    assert cp_global_positions(6, 4, 2, 1, 1).tolist() == [1, 3, 5, 7, 9, 11]
    assert cp_global_positions(8, 4, 2, 0, 2).tolist() == [0, 1, 4, 5, 8, 9, 12, 13]
    assert cp_global_positions(5, 4, 1, 0, 1).tolist() == [0, 1, 2, 3, 4]  # no CP


def _md(slots, local):
    """The seeds' example: rows [6, 7] and [1, 2, 3, 4], B=16, query_start_loc [0, 3, 5],
    positions [0, 1, 2] and [16, 17] (sequence lengths 3 and 18)."""
    return types.SimpleNamespace(
        num_reqs=2, query_start_loc_cpu=torch.tensor([0, 3, 5]),
        seq_lens_cpu=torch.tensor([3, 18]),
        block_table_tensor=torch.tensor([[6, 7, 0, 0], [1, 2, 3, 4]]),
        slot_mapping=torch.tensor(slots + [-1, -1, -1]),
        dcp_local_seq_lens_cpu=torch.tensor(local))


def test_step_check_on_the_seeds_example():
    rank0 = DCPGroup(0, 2, 1, check_steps=True)
    rank0.check_step(_md([96, -1, 97, 24, -1], [2, 9]), 16)  # the reference table's row
    DCPGroup(1, 2, 1).check_step(_md([-1, 96, -1, -1, 24], [1, 9]), 16)
    DCPGroup(0, 2, 4).check_step(_md([96, 97, 98, 24, 25], [3, 10]), 16)
    with pytest.raises(InvariantError, match="dcp-slot-mapping"):
        rank0.check_step(_md([96, 97, 98, 24, -1], [2, 9]), 16)
    with pytest.raises(InvariantError, match="dcp-local-lens"):
        rank0.check_step(_md([96, -1, 97, 24, -1], [2, 10]), 16)
    assert rank0.steps_checked == 1


def _cache_for_rank(k, v, seq_lens, block_size, world, rank, inter, num_blocks=40):
    """A paged cache holding rank ``rank``'s share of each request's keys (requests' blocks
    from a shuffled pool; NaN elsewhere), and its block table."""
    g = torch.Generator().manual_seed(1)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    kv = torch.full((2, num_blocks, block_size, k[0].shape[1], k[0].shape[2]), float("nan"))
    table = torch.zeros(len(seq_lens), 8, dtype=torch.int64)
    for r, s in enumerate(seq_lens):
        for b in range(8):
            table[r, b] = perm.pop()
        n_local = sum(1 for p in range(s) if ((p % (block_size * world)) // inter) % world == rank)
        pos = cp_global_positions(n_local, block_size, world, rank, inter)
        for j, p in enumerate(pos.tolist()):
            kv[0, table[r, j // block_size], j % block_size] = k[r][p]
            kv[1, table[r, j // block_size], j % block_size] = v[r][p]
    return kv, table


@pytest.mark.parametrize("inter, window", [(1, None), (2, None), (1, 5)])
def test_rank_partials_merged_equal_full_attention(inter, window):
    g = torch.Generator().manual_seed(0)
    seq_lens, q_lens = [3, 18, 1, 9], [3, 2, 1, 4]  # a whole prefill, chunks, a lone token
    H, Hkv, D, B, world = 4, 2, 8, 4, 2
    k = [torch.randn(s, Hkv, D, generator=g) for s in seq_lens]
    v = [torch.randn(s, Hkv, D, generator=g) for s in seq_lens]
    q = torch.randn(sum(q_lens), H, D, generator=g)
    qsl = torch.tensor([0] + torch.cumsum(torch.tensor(q_lens), 0).tolist())

    def md(table, cp_rank=None):
        return types.SimpleNamespace(num_reqs=4, query_start_loc_cpu=qsl,
                                     seq_lens_cpu=torch.tensor(seq_lens), block_table_tensor=table,
                                     num_actual_tokens=int(qsl[-1]))

    full_kv, full_table = _cache_for_rank(k, v, seq_lens, B, 1, 0, 1)
    want = paged_attention_ref(q, full_kv, md(full_table), 0.3, sliding_window=window)
    outs, lses = [], []
    for rank in range(world):
        kv, table = _cache_for_rank(k, v, seq_lens, B, world, rank, inter)
        lse = torch.full((q.shape[0], H), float("-inf"))
        outs.append(paged_attention_ref(q, kv, md(table), 0.3, sliding_window=window, lse=lse,
                                        cp=(world, rank, inter)))
        lses.append(lse)
    # the lone token at position 0 has its only key on rank 0: rank 1 saw none
    lone = int(qsl[2])
    assert torch.isneginf(lses[1][lone]).all() and (outs[1][lone] == 0).all()
    got = merge_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def run(path, monkeypatch, params=GREEDY, **options):
    monkeypatch.setenv("PAGEDKV_DCP_CHECK", "1")  # the ranks check every step (inherited)
    llm = LLM(path, device="cpu", **options)
    try:
        first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        second = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        return first, second, llm.get_kv_stats(), llm.kv_cache_sizing
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family, inter", [("llama", 1), ("qwen3", 4)])
def test_dcp2_greedy_equals_one_process(tiny_dir, monkeypatch, family, inter):
    path = tiny_dir(family)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=16)
    one = run(path, monkeypatch, **kw)
    two = run(path, monkeypatch, tensor_parallel_size=2, decode_context_parallel_size=2,
              dcp_kv_cache_interleave_size=inter, **kw)
    assert two[0] == one[0] and two[1] == one[1]
    assert two[2]["prefix_cache_hits"] > 0
    assert two[3].block_size == 32  # a scheduler block spans 16 tokens on each of 2 ranks


def test_dcp2_preemption_with_a_small_pool(tiny_dir, monkeypatch):
    path = tiny_dir("llama")
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=32, enable_prefix_caching=False)
    one = run(path, monkeypatch, long, num_gpu_blocks_override=9, **kw)
    # 5 blocks of 2 x 16 tokens hold what 9 blocks of 16 hold (the null block aside)
    two = run(path, monkeypatch, long, tensor_parallel_size=2, decode_context_parallel_size=2,
              num_gpu_blocks_override=5, **kw)
    assert two[3].max_model_len == one[3].max_model_len == 128
    assert two[0] == one[0] and two[1] == one[1]
    assert two[2]["preemptions"] > 0


def test_dcp_doubles_the_tokens_a_replicated_kv_head_holds(tiny_dir, monkeypatch):
    """One KV head on two ranks: without DCP each rank holds a copy of every token; with DCP
    each holds half of them, so the same bytes hold twice the tokens."""
    path = tiny_dir("llama", num_kv_heads=1)
    kw = dict(max_num_seqs=4, kv_cache_memory_bytes=1 << 20, tensor_parallel_size=2)
    plain = run(path, monkeypatch, **kw)
    dcp = run(path, monkeypatch, decode_context_parallel_size=2, **kw)
    assert dcp[0] == plain[0]
    assert dcp[3].bytes_per_block == plain[3].bytes_per_block
    assert dcp[3].token_capacity == 2 * plain[3].token_capacity


def test_dcp_option_errors(tiny_dir):
    path = tiny_dir("llama")
    with pytest.raises(ConfigError, match="must divide\ntensor_parallel_size|must divide tensor"):
        LLM(path, device="cpu", tensor_parallel_size=2, decode_context_parallel_size=4)
    with pytest.raises(ConfigError, match="interleave"):
        LLM(path, device="cpu", tensor_parallel_size=2, decode_context_parallel_size=2,
            dcp_kv_cache_interleave_size=3)
    with pytest.raises(ConfigError, match="torch reference attention"):
        LLM(path, device="cpu", tensor_parallel_size=2, decode_context_parallel_size=2,
            attention_backend="triton")
