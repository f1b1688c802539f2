"""ModelRunner on its own (Scheduler + runner, no LLM wrapper): logits only where tokens are
sampled, partial chunks report [], zeroing/copy-on-write of KV blocks, configuration checks,
KV-pool sizing and the CUDA-graph size buckets (the graph capture itself needs a GPU: see
test_engine_gpu.py)."""

import pytest
import torch
from engine_helpers import TEXTS, record_replays

from pagedkv.config import SchedulerConfig
from pagedkv.core.output import SchedulerOutput
from pagedkv.core.scheduler import Scheduler
from pagedkv.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.engine.memory import KVCacheSizing, block_bytes, size_kv_cache
from pagedkv.errors import ConfigError
from pagedkv.models.loader import load_checkpoint
from pagedkv.sampling.params import SamplingParams
from pagedkv.worker.cuda_graphs import default_capture_sizes
from pagedkv.worker.model_runner import (
    ModelRunner,
    attention_layer_names,
    kv_cache_spec_for,
)


@pytest.fixture(scope="module")
def ck(tiny_dir):
    return load_checkpoint(tiny_dir("qwen3"), dtype="float32")


def _kv(model, num_blocks=64, block_size=16, names=None):
    spec = kv_cache_spec_for(model, block_size)
    names = names or attention_layer_names(len(model.layers))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=(KVCacheGroupSpec(names, spec),))


def test_partial_chunks_sample_nothing_and_logits_only_for_sampled_rows(ck):
    model = ck.model
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128)
    kv = _kv(model)
    sched = Scheduler(sc, kv)
    runner = ModelRunner(model, kv, sc)
    rows_seen = []
    inner = model.compute_logits

    def compute_logits(hidden, indices=None, **kw):
        out = inner(hidden, indices, **kw)
        rows_seen.append(out.shape[0])
        return out

    model.compute_logits = compute_logits
    try:
        prompts = [ck.tokenizer.encode(t) for t in TEXTS[1:3]]
        for i, p in enumerate(prompts):
            sched.add_request(sched.make_request(f"r{i}", p, max_tokens=3, ignore_eos=True,
                                                 sampling_params=SamplingParams(temperature=0)))
        steps = 0
        saw_partial = False
        while sched.has_requests():
            so = sched.schedule()
            calls = len(rows_seen)
            out = runner.execute_model(so)
            if so.total_num_scheduled_tokens:
                # every scheduled request is reported, in batch-row order
                assert sorted(out.req_ids) == sorted(so.num_scheduled_tokens)
                n_sampled = sum(1 for s in out.sampled_token_ids if s)
                partial = [rid for rid in out.req_ids if not out.sampled_token_ids[out.req_id_to_index[rid]]]
                for rid in partial:  # a partial prefill chunk: nothing sampled
                    req = sched.requests[rid]
                    assert req.num_computed_tokens < req.num_tokens
                    saw_partial = True
                # logits for exactly the sampled rows, and none when nothing is sampled
                assert rows_seen[calls:] == ([n_sampled] if n_sampled else [])
            sched.update_from_output(so, out)
            steps += 1
        assert steps > 4 and saw_partial  # the prompts were chunked (budget 8)
        assert sched.kv_cache_manager.num_free_blocks == kv.num_blocks - 1
    finally:
        del model.compute_logits


def test_block_zeroing_and_copy_on_write(ck):
    model = ck.model
    sc = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    kv = _kv(model, num_blocks=8)
    runner = ModelRunner(model, kv, sc)
    for t in runner.kv_caches:
        t.normal_()
    before = [t.clone() for t in runner.kv_caches]
    so = SchedulerOutput.make_empty()
    so.new_block_ids_to_zero = [3, 5]
    so.kv_cache_block_copies = [(1, 4)]
    out = runner.execute_model(so)
    assert out.req_ids == [] and out.sampled_token_ids == []
    for t, b in zip(runner.kv_caches, before):
        assert torch.all(t[:, [3, 5]] == 0)
        assert torch.equal(t[:, 4], b[:, 1])
        keep = [0, 1, 2, 6, 7]
        assert torch.equal(t[:, keep], b[:, keep])


def test_runner_rejects_mismatched_kv_config(ck):
    model = ck.model
    sc = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    with pytest.raises(ConfigError, match="layers"):
        ModelRunner(model, _kv(model, names=("a", "b")), sc)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype="float32")
    bad = KVCacheConfig(8, (KVCacheGroupSpec(attention_layer_names(len(model.layers)), spec),))
    with pytest.raises(ConfigError, match="num_kv_heads=1.*needs.*num_kv_heads=2"):
        ModelRunner(model, bad, sc)
    half = FullAttentionSpec(block_size=16, num_kv_heads=model.config.num_key_value_heads,
                             head_size=model.config.head_dim, dtype="bfloat16")
    with pytest.raises(ConfigError, match="bfloat16.*needs.*float32"):
        names = attention_layer_names(len(model.layers))
        ModelRunner(model, KVCacheConfig(8, (KVCacheGroupSpec(names, half),)), sc)
    from pagedkv.core.spec import SlidingWindowSpec

    swa = SlidingWindowSpec(block_size=16, num_kv_heads=model.config.num_key_value_heads,
                            head_size=model.config.head_dim, dtype="float32", sliding_window=8)
    with pytest.raises(ConfigError, match="SlidingWindowSpec.*needs.*FullAttentionSpec"):
        ModelRunner(model, KVCacheConfig(8, (KVCacheGroupSpec(names, swa),)), sc)


# ----- KV pool sizing --------------------------------------------------------------------------

def test_sizing_precedence_and_report():
    per = block_bytes(num_layers=2, block_size=16, num_kv_heads=2, head_dim=16, dtype_bytes=4)
    assert per == 2 * 2 * 16 * 2 * 16 * 4
    s = size_kv_cache(bytes_per_block=per, block_size=16, max_model_len=128, num_gpu_blocks_override=20,
                      kv_cache_memory_bytes=1 << 30)
    assert s.num_blocks == 20 and s.source == "override"
    assert s.token_capacity == 19 * 16 and s.max_concurrency == 19 / 8
    s = size_kv_cache(bytes_per_block=per, block_size=16, max_model_len=128,
                      kv_cache_memory_bytes=per * 50 + 7)
    assert s.num_blocks == 50 and s.source == "budget"
    s = size_kv_cache(bytes_per_block=per, block_size=16, max_model_len=128)
    assert s.source == "cpu_default" and s.num_blocks == (256 << 20) // per
    capped = size_kv_cache(bytes_per_block=per, block_size=16, max_model_len=128, max_num_seqs=4)
    assert capped.source == "cpu_default+cap" and capped.num_blocks == 4 * 8 + 1
    big = size_kv_cache(bytes_per_block=per * 1000, block_size=16, max_model_len=128, max_num_seqs=4)
    assert big.source == "cpu_default" and big.num_blocks == (256 << 20) // (per * 1000)
    assert "blocks" in s.describe() and s.as_dict()["token_capacity"] == s.token_capacity
    with pytest.raises(ConfigError, match="max_model_len"):
        size_kv_cache(bytes_per_block=per, block_size=16, max_model_len=1024, num_gpu_blocks_override=20)
    with pytest.raises(ConfigError):
        size_kv_cache(bytes_per_block=per, block_size=16, max_model_len=16, num_gpu_blocks_override=1)
    with pytest.raises(ConfigError):
        size_kv_cache(bytes_per_block=per, block_size=16, max_model_len=16, kv_cache_memory_bytes=0)


def test_sizing_counts_every_group_of_a_request():
    """A request holds blocks in every KV-cache group of the shared pool: the cap is
    max_num_seqs x (the blocks of all groups) + the null block, and the "one request fits"
    check counts them all (a Bamba-9B-like pool, 10 state groups + 1 attention block, was
    capped at 5 blocks for 4 requests: each needs 11, none could run)."""
    per = 1 << 20
    capped = size_kv_cache(bytes_per_block=per, block_size=1040, max_model_len=280, max_num_seqs=4,
                           blocks_per_request=11)
    assert capped.source == "cpu_default+cap" and capped.num_blocks == 4 * 11 + 1
    with pytest.raises(ConfigError, match="needs 12 .over all KV-cache groups"):
        size_kv_cache(bytes_per_block=per, block_size=1040, max_model_len=280,
                      num_gpu_blocks_override=11, blocks_per_request=11)
    assert size_kv_cache(bytes_per_block=per, block_size=1040, max_model_len=280,
                         num_gpu_blocks_override=12, blocks_per_request=11).num_blocks == 12


def test_fitted_max_model_len_splits_what_fixed_groups_leave():
    from pagedkv.core.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec
    from pagedkv.engine.memory import fitted_max_model_len

    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float32")
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float32",
                            sliding_window=32)
    state = MambaSpec(block_size=4096, shapes=((2, 3),), dtypes=("float32",))
    g = lambda spec, name: KVCacheGroupSpec((name,), spec)  # noqa: E731
    # one full group: the whole pool (30 blocks of 16)
    assert fitted_max_model_len([g(full, "a")], 30, 64, 16, 4096) == 480
    # + a window of 32 (cdiv(31 + 64, 16) + 1 = 7 blocks) and a state (1): (30 - 8) x 16
    assert fitted_max_model_len([g(full, "a"), g(swa, "b"), g(state, "c")], 30, 64, 16,
                                4096) == 22 * 16
    # two full groups split it; never longer than asked; nothing fits
    assert fitted_max_model_len([g(full, "a"), g(full, "b")], 30, 64, 16, 4096) == 15 * 16
    assert fitted_max_model_len([g(full, "a")], 30, 64, 16, 100) == 100
    assert fitted_max_model_len([g(swa, "b"), g(state, "c")], 5, 64, 16, 4096) == 0


def test_llm_sizes_pool_from_budget(tiny_dir):
    from engine_helpers import make_llm

    llm = make_llm(tiny_dir("qwen3"), kv_cache_memory_bytes=1 << 20, max_model_len=128)
    s = llm.kv_cache_sizing
    assert isinstance(s, KVCacheSizing) and s.source == "budget"
    assert llm.scheduler.kv_cache_config.num_blocks == s.num_blocks == (1 << 20) // s.bytes_per_block
    assert sum(t.numel() * t.element_size() for t in llm.runner.kv_caches) == s.kv_cache_bytes
    with pytest.raises(ConfigError, match="max_model_len"):
        make_llm(tiny_dir("qwen3"), num_gpu_blocks_override=4, kv_cache_memory_bytes=None, max_model_len=128)


# ----- CUDA-graph sizes (CPU-checkable part) ------------------------------------------------------

def test_default_capture_sizes():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(3) == [1, 2, 3]
    assert default_capture_sizes(8) == [1, 2, 4, 8]
    assert default_capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    s = default_capture_sizes(256)
    assert s[:6] == [1, 2, 4, 8, 16, 24] and s[-1] == 256 and all(b - a == 8 for a, b in zip(s[3:], s[4:]))


def test_cpu_runner_never_captures(ck):
    model = ck.model
    sc = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    runner = ModelRunner(model, _kv(model, num_blocks=8), sc, enforce_eager=False)
    assert runner.capture_cuda_graphs() == 0 and runner.cuda_graphs is None


def test_default_max_model_len_is_fitted_to_the_pool(tiny_dir):
    from engine_helpers import make_llm

    path = tiny_dir("qwen3")
    roomy = make_llm(path, max_model_len=None)  # 2 MiB: the whole 256 positions fit
    assert roomy.engine.max_model_len == 256
    per = roomy.kv_cache_sizing.bytes_per_block
    small = make_llm(path, max_model_len=None, kv_cache_memory_bytes=per * 10)
    assert small.engine.max_model_len == 9 * 16 == small.kv_cache_sizing.max_model_len
    assert small.scheduler.max_model_len == 144
    out = small.generate([5] * 140, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


class EagerReplay:
    """Stand-in for ``CudaGraphCapture`` on CPU: "replay" re-executes the captured call (same
    metadata object, same persistent-buffer views) into the static output tensor."""

    def synchronize(self):
        pass

    def capture(self, fn):
        out = fn()
        return (lambda: out.copy_(fn())), out


def test_graph_manager_padding_and_buffers_on_cpu(tiny_dir, hf_ref):
    """The decode-graph path (bucket choice, padded preparation, replay reading the persistent
    buffers, static output) driven on CPU through the torch reference backend."""
    from engine_helpers import make_llm

    from pagedkv.worker.cuda_graphs import CudaGraphManager

    path = tiny_dir("qwen3")
    llm = make_llm(path, max_num_seqs=8)
    runner = llm.runner
    mgr = CudaGraphManager(runner, [1, 2, 4, 8], graph_capture=EagerReplay())
    # stale values in the persistent buffers: the capture's padding must overwrite them
    bt = runner.input_batch.block_table
    bt.block_table.gpu.fill_(7)
    bt.slot_mappings.fill_(5)
    runner.preparer.seq_lens.gpu.fill_(9)
    ids, pos, _, md = mgr._capture_inputs(8)
    assert md.query_start_loc.tolist() == [0] * 9 and md.seq_lens.tolist() == [0] * 8
    assert md.block_table_tensor.tolist() == [[0] * bt.block_table.gpu.shape[1]] * 8
    assert md.slot_mapping.tolist() == [-1] * 8 and pos.tolist() == [0] * 8
    assert (md.num_reqs, md.num_actual_reqs, md.num_actual_tokens, md.max_query_len,
            md.max_seq_len) == (8, 8, 8, 1, runner.max_model_len)
    mgr.capture()
    runner.cuda_graphs = mgr
    replays = record_replays(mgr)
    prompts = TEXTS + TEXTS[:1]  # 5 requests -> bucket 8, then fewer as none finish early
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)
    assert runner.num_graph_steps > 0 and {size for size, _ in replays} == {8}
    ref = hf_ref(path)
    for o in outs:
        assert o.outputs[0].token_ids == ref.greedy(o.prompt_token_ids, 10)
    assert [mgr.padded_size(n) for n in range(0, 10)] == [None, 1, 2, 4, 4, 8, 8, 8, 8, None]


def test_graph_variants_for_balanced_lengths_on_cpu(tiny_dir, hf_ref):
    """One decode graph per (size, balanced lengths) where the Triton backend's decode launch
    depends on it (interpreted on CPU, its rule widened to these tiny batches): equal-length
    requests replay the balanced graphs, mixed lengths the others; tokens as transformers'."""
    import dataclasses

    from engine_helpers import make_llm

    from pagedkv.attention.triton_backend import TritonAttentionBackend
    from pagedkv.attention.triton_decode import INTERPRET_DECODE_CONFIG
    from pagedkv.worker.cuda_graphs import CudaGraphManager

    cfg = dataclasses.replace(INTERPRET_DECODE_CONFIG, balanced_min_programs_per_sm=0.0,
                              wave_programs_per_sm=1.0)
    path = tiny_dir("qwen3")
    llm = make_llm(path, max_num_seqs=4, attention_backend=TritonAttentionBackend(decode_config=cfg))
    runner = llm.runner
    mgr = CudaGraphManager(runner, [2, 4], graph_capture=EagerReplay())
    assert [mgr.variants(s) for s in mgr.sizes] == [(False, True)] * 2 and mgr.num_graphs == 4
    mgr.capture()
    runner.cuda_graphs = mgr
    seen = record_replays(mgr)
    ref = hf_ref(path)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for prompts, balanced in (([list(range(5 + i, 45 + i)) for i in range(3)], True),  # 40 each
                              ([[7, 8, 9], list(range(10, 50)), [11] * 6], False)):
        seen.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert seen and {v for _, v in seen} == {balanced} and {s for s, _ in seen} == {4}
        for o in outs:
            assert o.outputs[0].token_ids == ref.greedy(o.prompt_token_ids, 5)


def test_warning_when_other_engines_hold_device_memory():
    """A GPU-profiled pool below its cap while another engine of the process holds KV memory
    (a notebook rebinding llm = LLM(...)) is reported, with the way out."""
    from pagedkv.engine.memory import GiB, KVCacheSizing, warn_if_others_hold_memory

    small = KVCacheSizing(num_blocks=5066, block_size=16, bytes_per_block=1 << 20,
                          max_model_len=4096, source="gpu_profile")
    msg = warn_if_others_hold_memory(small, 65537, 116 * GiB)
    assert msg and "116.0 GiB" in msg and "5,066 blocks" in msg and "shutdown()" in msg
    assert warn_if_others_hold_memory(small, 65537, 0) is None
    assert warn_if_others_hold_memory(small, 5066, 116 * GiB) is None  # got its cap
    budget = KVCacheSizing(num_blocks=10, block_size=16, bytes_per_block=1, max_model_len=64,
                           source="budget")
    assert warn_if_others_hold_memory(budget, 100, GiB) is None  # sized by the user


def test_live_engines_are_counted_per_device(tiny_dir):
    import gc

    from engine_helpers import make_llm

    from pagedkv.engine.memory import kv_bytes_held_by_other_engines

    gc.collect()
    base = kv_bytes_held_by_other_engines(torch.device("cpu"))
    llm = make_llm(tiny_dir("llama"))
    held = llm.engine.runner.kv_cache_bytes
    assert kv_bytes_held_by_other_engines(torch.device("cpu")) == base + held
    del llm
    assert kv_bytes_held_by_other_engines(torch.device("cpu")) == base


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_runner_serves_several_kv_cache_groups(tiny_dir, hf_ref, async_scheduling):
    """The layers split into two full-attention KV-cache groups (even / odd layers): one
    scheduler, one runner, two block tables and slot mappings committed and computed together,
    one plan per group handed to its layers; tokens equal transformers' with a small pool
    (preemption), chunked prefill and prefix hits; every block comes back."""
    from pagedkv import LLM
    from pagedkv.config import CacheConfig
    from pagedkv.engine.async_scheduler import AsyncScheduler
    from pagedkv.engine.llm_engine import LLMEngine

    path = tiny_dir("llama", num_layers=4)
    ck = load_checkpoint(path, dtype="float32")
    model = ck.model
    spec = kv_cache_spec_for(model, 16)
    names = attention_layer_names(len(model.layers))
    kv = KVCacheConfig(num_blocks=13, kv_cache_groups=(KVCacheGroupSpec(names[0::2], spec),
                                                       KVCacheGroupSpec(names[1::2], spec)))
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96)
    cc = CacheConfig(block_size=16, num_gpu_blocks=13)
    sched = (AsyncScheduler if async_scheduling else Scheduler)(sc, kv, cc)
    runner = ModelRunner(model, kv, sc, cc)
    assert runner.input_batch.block_table.num_groups == 2
    # the two groups share tensors by position: layer 0 (group 0) and layer 1 (group 1)
    assert runner.kv_caches[0] is runner.kv_caches[1]
    assert runner.kv_cache_bytes == runner.kv_caches[0].numel() * 4 * (len(names) // 2)
    plans_seen = []
    attention_for = runner.attention_for

    def spy(*a, **k):
        attn = attention_for(*a, **k)
        plans_seen.append(attn)
        return attn

    runner.attention_for = spy
    engine = LLMEngine(model, ck.tokenizer, sched, runner, async_scheduling=async_scheduling)
    llm = LLM(path, _engine=engine)
    prompts = [ck.tokenizer.encode(t) for t in TEXTS] + [ck.tokenizer.encode(TEXTS[3])]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    ref = hf_ref(path)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == ref.greedy(p, 12)
    stats = llm.get_kv_stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["free_blocks"] == 12
    attn = plans_seen[0]
    assert attn.plans[0] is attn.plans[2] and attn.plans[1] is attn.plans[3]
    assert attn.plans[0] is not attn.plans[1]
    # each group's plan carries that group's table and slot mapping
    bt = runner.input_batch.block_table
    assert attn.plans[1].metadata.block_table_tensor.data_ptr() == \
        bt[1].get_device_tensor(1).data_ptr()


def test_hybrid_pool_cap_holds_max_num_seqs_requests():
    """A state hybrid (the tiny Bamba shape: 2 state groups + 1 attention group) sized by the
    CPU default and capped: max_num_seqs requests run at once, each holding a block in every
    group."""
    from pagedkv import LLM

    llm = LLM.from_shape("bamba-tiny", max_num_seqs=3, max_model_len=64,
                         enable_prefix_caching=False)
    s = llm.kv_cache_sizing
    assert s.source == "cpu_default+cap" and len(s.groups) == 3
    assert s.blocks_per_request == 1 + 1 + 2 and s.num_blocks == 3 * 4 + 1
    sched, running = llm.scheduler, []
    schedule = sched.schedule
    sched.schedule = lambda: running.append(len(sched.running)) or schedule()
    outs = llm.generate([[5, 6, 7, 8], [9, 10, 11], [12, 13]],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4, 4]
    assert max(running) == 3
    llm.shutdown()
