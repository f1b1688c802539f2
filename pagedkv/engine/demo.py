"""``pagedkv demo``: the engine end to end on a fresh machine, offline.

Builds once, into ``$PAGEDKV_CACHE`` (or ``$PAGEDKV_CACHE_DIR``, else ``~/.cache/pagedkv``), a small
deterministic Qwen3-family checkpoint with random weights and a byte-level BPE tokenizer trained
offline (``pagedkv.models.tiny``), then runs a batch of prompts through ``LLM.generate`` and prints
each output and the KV-cache statistics: blocks, usage, prefix-cache hits, preemptions.

The prompts share a prefix (so later requests hit the prefix cache) and the pool is deliberately
small (so the scheduler preempts and recomputes). Random weights produce gibberish text: the demo
shows the machinery, not the model. Uses the GPU when there is one.
"""

from __future__ import annotations

import os
import sys
import time

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


def cache_root() -> str:
    root = os.environ.get("PAGEDKV_CACHE") or os.environ.get("PAGEDKV_CACHE_DIR")
    return root or os.path.join(os.path.expanduser("~"), ".cache", "pagedkv")


def demo_checkpoint(cache_dir: str | None = None) -> tuple[str, bool]:
    """``(path, built_now)`` of the demo checkpoint."""
    from pagedkv.models.tiny import MARKER, build_tiny_checkpoint, tiny_spec

    root = os.path.join(cache_dir or cache_root(), "tiny")
    spec = tiny_spec(DEMO_FAMILY, **DEMO_SPEC)
    existed = os.path.isfile(os.path.join(root, f"{DEMO_FAMILY}-{spec.key()}", MARKER))
    path = build_tiny_checkpoint(DEMO_FAMILY, root, **DEMO_SPEC)
    return path, not existed


def run_demo(*, cache_dir: str | None = None, device: str | None = None, num_blocks: int = 24,
             block_size: int = 16, max_tokens: int = 24, num_prompts: int = len(QUESTIONS),
             temperature: float = 0.0, out=None) -> dict:
    """Build (once) and run the demo; prints to ``out`` (stdout) and returns the KV stats."""
    import torch

    from pagedkv.engine.llm import LLM
    from pagedkv.sampling.params import SamplingParams

    out = out or sys.stdout
    t0 = time.perf_counter()
    path, built = demo_checkpoint(cache_dir)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"pagedkv demo: checkpoint {path} ({'built now' if built else 'cached'}, "
          f"{time.perf_counter() - t0:.1f}s)", file=out)
    llm = LLM(path, dtype="float32", device=dev, block_size=block_size, max_num_seqs=8,
              max_num_batched_tokens=256, max_model_len=128, num_gpu_blocks_override=num_blocks,
              seed=0)
    print(f"device {dev}, attention backend {llm.engine.model.attn_backend.name}, "
          f"{llm.kv_cache_sizing.describe()}", file=out)
    prompts = [SYSTEM_PREFIX + q for q in QUESTIONS[: max(1, min(num_prompts, len(QUESTIONS)))]]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t1
    print(f"\n{len(outs)} requests (shared prefix of {len(llm.tokenizer.encode(SYSTEM_PREFIX))} "
          f"tokens), random weights: the text is gibberish by design\n", file=out)
    for i, o in enumerate(outs):
        c = o.outputs[0]
        m = o.metrics
        print(f"[{o.request_id}] {QUESTIONS[i]!r}", file=out)
        print(f"    -> {c.text!r}", file=out)
        print(f"    {len(o.prompt_token_ids)} prompt tokens ({m.num_cached_tokens} from the prefix "
              f"cache), {len(c.token_ids)} generated, finish {c.finish_reason}, "
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
    return s


__all__ = ["QUESTIONS", "cache_root", "demo_checkpoint", "run_demo"]
