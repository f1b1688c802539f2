"""Checks of a tiny checkpoint through the paged harness against transformers, shared by the
model tests of several families: a test module defines a module-scoped ``ref`` fixture (a
``test_deepseek_v3.Ref`` of its checkpoint) and imports the ``test_*`` functions here, which
pytest then runs in that module."""

import pytest
import torch
from test_deepseek_v3 import NEW_TOKENS


def check_every_layer(ref, prompt) -> None:
    """The hidden states after each decoder layer equal transformers' for ``prompt``."""
    ours, theirs = [], []
    hooks = [layer.register_forward_hook(lambda m, a, out: ours.append(out))
             for layer in ref.ck.model.layers]
    hooks += [layer.register_forward_hook(lambda m, a, out: theirs.append(out[0]))
              for layer in ref.hf.model.layers]
    try:
        ref.harness(16).prompt_logits(prompt)
        with torch.no_grad():
            ref.hf(torch.tensor([prompt]))
    finally:
        for h in hooks:
            h.remove()
    assert len(ours) == len(theirs) == len(ref.ck.model.layers)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def check_prompt_logits(ref, block_size: int) -> None:
    h = ref.harness(block_size)
    for p in ref.prompts:
        with torch.no_grad():
            want = ref.hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(h.prompt_logits(p), want, atol=1e-4, rtol=1e-4)


def check_greedy(ref, block_size: int, chunk: int | None) -> None:
    """Batched greedy tokens equal transformers' generate; with ``chunk``: prompts in chunks
    of ``chunk`` on a 16-token budget beside decode tokens (some step mixes both), 3 padding
    tokens per step."""
    h = ref.harness(block_size)
    kw = {} if chunk is None else dict(chunk_size=chunk, token_budget=16, pad_tokens=3)
    assert h.greedy_generate(ref.prompts, NEW_TOKENS, **kw) == ref.generations
    mixed = [s for s in h.step_log if {done >= plen for _, done, _, plen in s} == {True, False}]
    assert bool(mixed) == (chunk is not None)


def test_every_layer_matches_transformers(ref):
    """The hidden states after each decoder layer, for the longest prompt (past the window)."""
    check_every_layer(ref, ref.prompts[3])


@pytest.mark.parametrize("block_size", [16, 32])
def test_prompt_logits_match_transformers(ref, block_size):
    check_prompt_logits(ref, block_size)


@pytest.mark.parametrize("block_size,chunk", [(16, None), (32, None), (16, 7)])
def test_greedy_tokens_match_transformers(ref, block_size, chunk):
    check_greedy(ref, block_size, chunk)
