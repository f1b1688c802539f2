"""Tensor parallelism on two or more GPUs (NCCL; skipped with fewer): greedy tokens of TP=2 equal
TP=1 in fp32 with the Triton backend and CUDA graphs replayed (NCCL all-reduces captured in the
graphs); bf16 TP=2 against transformers in bf16, teacher-forced (each rank's partial products
round differently, so exact equality is not the criterion); DCP=2 on a single KV head holds
twice the tokens of DCP=1 and gives the TP=1 tokens (torch-reference attention)."""

import pytest
import torch

from pagedkv import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices")]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], list(range(20, 300)), list(range(100, 132)) * 3]


def _tokens(path, params, **kw):
    llm = LLM(path, device="cuda", **kw)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.get_kv_stats(), llm.kv_cache_sizing
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gpu_tp2_fp32_greedy_equals_tp1_with_graphs(tiny_dir, family):
    path = tiny_dir(family, max_position_embeddings=1024)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
              gpu_memory_utilization=0.3)
    one = _tokens(path, greedy, **kw)
    two = _tokens(path, greedy, tensor_parallel_size=2, **kw)
    assert two[0] == one[0]
    assert two[1]["cuda_graph_steps"] > 0  # decode steps replayed graphs with NCCL inside


def test_gpu_tp2_bf16_teacher_forced_against_transformers(tiny_dir):
    from pagedkv.models.harness import teacher_forced_check

    transformers = pytest.importorskip("transformers")
    path = tiny_dir("qwen3", dtype="bfloat16", init_std=0.02, hidden_size=512, num_layers=4,
                    num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1024,
                    vocab_size=1024, max_position_embeddings=1024)
    n = 24
    toks, _, _ = _tokens(path, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                         tensor_parallel_size=2, max_num_seqs=8, max_model_len=512,
                         gpu_memory_utilization=0.3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf = hf.to("cuda:0").eval()
    exact = total = 0
    worst = 0.0
    with torch.no_grad():
        for p, o in zip(PROMPTS, toks):
            tf = teacher_forced_check(hf, p, o)
            exact, total, worst = exact + tf.exact, total + n, max(worst, tf.max_margin)
    print(f"TP=2 bf16 teacher-forced: {exact}/{total}, largest margin {worst:.4f}")
    assert exact >= 0.9 * total and worst < 0.5


def test_gpu_dcp2_doubles_a_single_kv_heads_tokens(tiny_dir):
    path = tiny_dir("llama", num_kv_heads=1, max_position_embeddings=1024)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype="float32", max_num_seqs=8, max_model_len=512, attention_backend="torch_ref",
              kv_cache_memory_bytes=8 << 20, tensor_parallel_size=2)
    one = _tokens(path, greedy, dtype="float32", max_num_seqs=8, max_model_len=512,
                  attention_backend="torch_ref")
    plain = _tokens(path, greedy, **kw)
    dcp = _tokens(path, greedy, decode_context_parallel_size=2, **kw)
    assert plain[0] == one[0] and dcp[0] == one[0]
    assert dcp[2].token_capacity == 2 * plain[2].token_capacity
