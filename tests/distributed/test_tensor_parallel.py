"""Tensor parallelism on the CPU over gloo (``pagedkv.distributed``): ``LLM(path,
tensor_parallel_size=2)`` starts two worker processes, each holding one rank's shard; its
greedy tokens equal the one-process engine's (fp32) on tiny Llama and Qwen3 checkpoints with
chunked prefill, prefix-cache hits, preemption with a small pool and async scheduling; KV heads
split (2 over 2 ranks) or replicated (1 over 2); a killed rank and a hung rank fail the engine
with ``WorkerError`` in bounded time; bad options fail before any process starts. The layout
rules (local heads, local config) by hand."""

import os
import signal
import time

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.distributed.shard import check_tensor_parallel, local_config, local_kv_heads
from pagedkv.errors import ConfigError, WorkerError
from pagedkv.models.config import load_model_config

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# different lengths; the last two share a 32-token prefix (two whole blocks)
PREFIX = list(range(100, 132))
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], list(range(20, 61)), PREFIX + [7, 8, 9],
           PREFIX + [40, 41, 42, 43, 44]]


def tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def run(path, **options):
    """Tokens of PROMPTS (twice: the second pass hits the prefix cache) and the stats."""
    llm = LLM(path, device="cpu", **options)
    try:
        first = tokens(llm, PROMPTS)
        second = tokens(llm, PROMPTS)
        return first, second, llm.get_kv_stats(), llm.kv_cache_sizing
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tp2_greedy_equals_tp1_chunked_prefix_hits(tiny_dir, family):
    path = tiny_dir(family)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=16)  # 41 tokens: 3 chunks
    one = run(path, **kw)
    two = run(path, tensor_parallel_size=2, **kw)
    assert two[0] == one[0] and two[1] == one[1]
    assert two[1] == two[0]
    assert two[2]["prefix_cache_hits"] > 0 and two[2]["prefix_cache_hits"] == one[2]["prefix_cache_hits"]
    # the ranks hold half the KV heads each: half the bytes per block, twice the blocks
    # (capped at max_num_seqs full-length requests here, as with one process)
    assert two[3].bytes_per_block * 2 == one[3].bytes_per_block
    assert two[3].num_blocks == one[3].num_blocks and "min over 2 ranks" in two[3].source


def test_tp2_preemption_and_async_scheduling(tiny_dir):
    path = tiny_dir("qwen3")
    kw = dict(max_num_seqs=4, max_num_batched_tokens=32, num_gpu_blocks_override=9,
              async_scheduling=True, enable_prefix_caching=False)
    one = run(path, **kw)
    two = run(path, tensor_parallel_size=2, **kw)
    assert two[0] == one[0] and two[1] == one[1]
    assert one[2]["preemptions"] > 0 and two[2]["preemptions"] == one[2]["preemptions"]


def test_tp2_replicates_a_single_kv_head(tiny_dir):
    path = tiny_dir("llama", num_kv_heads=1)
    cfg = load_model_config(path)
    assert [list(local_kv_heads(cfg, r, 2)) for r in (0, 1)] == [[0], [0]]
    one = run(path, max_num_seqs=4)
    two = run(path, max_num_seqs=4, tensor_parallel_size=2)
    assert two[0] == one[0] and two[1] == one[1]
    assert two[3].bytes_per_block == one[3].bytes_per_block  # one KV head on each rank


def test_layout_by_hand(tiny_dir):
    cfg = load_model_config(tiny_dir("qwen3"))  # 4 heads, 2 KV heads, MLP 128
    assert [list(local_kv_heads(cfg, r, 2)) for r in (0, 1)] == [[0], [1]]
    assert [list(local_kv_heads(cfg, r, 4)) for r in range(4)] == [[0], [0], [1], [1]]
    loc = local_config(cfg, 2)
    assert (loc.num_attention_heads, loc.num_key_value_heads, loc.intermediate_size,
            loc.head_dim, loc.vocab_size) == (2, 1, 64, cfg.head_dim, cfg.vocab_size)
    check_tensor_parallel(cfg, 4)
    with pytest.raises(ConfigError, match="must divide the number of attention heads"):
        check_tensor_parallel(cfg, 3)
    with pytest.raises(ConfigError, match="must divide one another"):
        check_tensor_parallel(load_model_config(
            tiny_dir("llama", hidden_size=96, num_heads=6, num_kv_heads=3)), 2)


def test_bad_options_fail_before_a_process_starts(tiny_dir):
    path = tiny_dir("llama")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="attention heads"):
        LLM(path, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="sanitize"):
        LLM(path, device="cpu", tensor_parallel_size=2, sanitize=True)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        LLM.from_shape("bamba-tiny", device="cpu", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="not supported yet"):
        LLM(tiny_dir("gemma2"), device="cpu", tensor_parallel_size=2)
    assert time.monotonic() - t0 < 10  # no worker was started
    # an option only a rank's pool planning can refuse comes back as the ConfigError itself
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        LLM(path, device="cpu", tensor_parallel_size=2, max_num_batched_tokens=8,
            max_num_seqs=16)


def _engine(path, **kw):
    llm = LLM(path, device="cpu", tensor_parallel_size=2, max_num_seqs=4, **kw)
    assert tokens(llm, PROMPTS[:2])  # it runs
    return llm, llm.engine.runner


def test_a_killed_rank_fails_the_engine_in_bounded_time(tiny_dir):
    llm, ex = _engine(tiny_dir("llama"))
    pids = ex.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        tokens(llm, PROMPTS)
    assert time.monotonic() - t0 < 15
    with pytest.raises(WorkerError):  # the engine stays failed, at once
        tokens(llm, PROMPTS[:1])
    time.sleep(0.5)
    for pid in pids:  # both ranks are gone (rank 0 was stopped)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    llm.shutdown()


def test_a_hung_rank_times_out(tiny_dir):
    llm, ex = _engine(tiny_dir("llama"), distributed_timeout_s=3.0)
    pids = ex.worker_pids
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerError, match=r"ranks? (0, )?1 did not answer within 3 s"):
            tokens(llm, PROMPTS)
        assert time.monotonic() - t0 < 15
    finally:
        try:
            os.kill(pids[1], signal.SIGCONT)
        except ProcessLookupError:
            pass
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ctrl_c_while_the_ranks_run_a_step_leaves_the_engine_clean(tiny_dir, async_scheduling):
    """A KeyboardInterrupt in the driver while it waits for the ranks' answers to a step
    (their runners applied it, the engine did not see its outcome): the engine aborts the
    call's requests and resets every rank's runner (their late answers are dropped by call
    number); the next generate gives the one-process tokens and the pool is whole."""
    path = tiny_dir("qwen3")
    kw = dict(max_num_seqs=4, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    want = run(path, **kw)[0]
    llm = LLM(path, device="cpu", tensor_parallel_size=2, **kw)
    try:
        mgr = llm.scheduler.kv_cache_manager
        free0 = mgr.num_free_blocks
        ex = llm.engine.runner
        inner, calls = ex._call_value, [0]

        def call(kind, arg):
            if kind == "exec":
                calls[0] += 1
                if calls[0] == 3:  # the step reached the ranks, its answers are not read
                    for c in ex._conns:
                        c.send((kind, ex._seq + 1, arg))
                    ex._seq += 1
                    raise KeyboardInterrupt
            return inner(kind, arg)

        ex._call_value = call
        with pytest.raises(KeyboardInterrupt):
            tokens(llm, PROMPTS)
        ex._call_value = inner
        assert mgr.num_free_blocks == free0 and not llm.scheduler.has_unfinished_requests()
        assert tokens(llm, PROMPTS) == want
        assert mgr.num_free_blocks == free0
    finally:
        llm.shutdown()


def test_the_throughput_tool_runs_a_tensor_parallel_engine(tiny_dir):
    """``pagedkv.tools.benchmark.run_throughput`` (bench_w1's loop) on a TP=2 engine: the
    executor serves the runner attributes engine-level tools read (device, pool bytes, a
    synchronize that waits for nothing left), the model handle its dtype."""
    import torch

    from pagedkv.tools.benchmark import run_throughput, w1_workload

    llm = LLM(tiny_dir("llama"), device="cpu", tensor_parallel_size=2, max_num_seqs=4,
              max_model_len=256)
    try:
        ex = llm.engine.runner
        assert ex.device == torch.device("cpu") and llm.engine.model.dtype == torch.float32
        assert ex.kv_cache_bytes == llm.kv_cache_sizing.kv_cache_bytes
        res = run_throughput(llm, w1_workload(4, 0.02), use_tqdm=False)
        assert res.output_tokens == w1_workload(4, 0.02).requested_output_tokens
    finally:
        llm.shutdown()
