"""The models on a CUDA GPU (skipped without one): fp32 parity on the tiny checkpoints, and
bf16 closeness on a full Qwen3-0.6B-shaped checkpoint with random weights (slow)."""

import pytest
import torch

from pagedkv.models.harness import PagedHarness
from pagedkv.models.loader import load_checkpoint

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "Hello",
    "The block table maps a request row",
    "Chunked prefill splits a long prompt over several steps so that decode requests keep moving.",
]


def _hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt], device="cuda")
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_cuda_fp32_parity(tiny_dir, family):
    path = tiny_dir(family)
    ck = load_checkpoint(path, dtype="float32", device="cuda")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    prompts = [ck.tokenizer.encode(t) for t in PROMPTS]
    h = PagedHarness(ck.model, block_size=16, num_blocks=32)
    ours = h.greedy_generate(prompts, 10, chunk_size=8)
    with torch.no_grad():
        for p, o in zip(prompts, ours):
            assert o == _hf_greedy(hf, p, 10)
            ref = hf(torch.tensor([p], device="cuda")).logits[0].float()
            torch.testing.assert_close(h.prompt_logits(p), ref, atol=2e-4, rtol=2e-4)


@pytest.mark.gpu
@pytest.mark.slow
def test_qwen3_0_6b_shape_bf16(tiny_cache):
    """bf16 on a Qwen3-0.6B-shaped checkpoint with random weights (std 0.02) through the paged
    harness. Random bf16 weights make near-ties common, so greedy paths part after a few
    tokens (measured on the H200: 7, 4 and 9 of 32); the criterion is teacher-forced instead
    (``teacher_forced_check``): every token we chose is transformers' argmax on our own prefix
    or within a bf16 margin of it, and most are its argmax; plus prompt logits close."""
    from pagedkv.models.harness import teacher_forced_check
    from pagedkv.models.tiny import build_tiny_checkpoint, shape_spec_options

    family, opts = shape_spec_options("qwen3-0.6b", dtype="bfloat16", init_std=0.02)
    path = build_tiny_checkpoint(family, tiny_cache, **opts)
    ck = load_checkpoint(path, device="cuda")
    assert ck.model.embed_tokens.dtype == torch.bfloat16
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 151936, (n,), generator=g).tolist() for n in (17, 200, 1000)]
    h = PagedHarness(ck.model, block_size=16, num_blocks=128)
    n_new = 32
    ours = h.greedy_generate(prompts, n_new)
    margins, exact = [], 0
    with torch.no_grad():
        for p, o in zip(prompts, ours):
            assert len(o) == n_new
            tf = teacher_forced_check(hf, p, o)
            margins += tf.margins
            exact += tf.exact
            r = _hf_greedy(hf, p, n_new)
            same = next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), n_new)
            ref = hf(torch.tensor([p], device="cuda")).logits[0].float()
            mine = h.prompt_logits(p)
            cos = torch.nn.functional.cosine_similarity(mine, ref, dim=-1)
            top1 = (mine.argmax(-1) == ref.argmax(-1)).float().mean().item()
            print(f"prompt {len(p)}: first divergence {same}/{n_new}, teacher-forced argmax "
                  f"{tf.exact}/{n_new}, max margin {tf.max_margin:.4f}, max|dlogit| "
                  f"{(mine - ref).abs().max().item():.4f}, min cos {cos.min().item():.5f}, "
                  f"top1 {top1:.3f}")
            assert cos.min() > 0.99
            assert top1 > 0.8
    # bf16 logits of magnitude < 8 are spaced <= 0.0625 apart: a few steps of rounding
    assert max(margins) < 0.25, "a generated token is far below transformers' top logit"
    assert exact >= 0.8 * len(margins)
