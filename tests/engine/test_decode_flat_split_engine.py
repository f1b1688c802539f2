"""The flat split of the decode kernel through the engine (``DecodeConfig.flat_split``): every
decode launch of the flat engine takes the flat kernels, and its greedy tokens equal the
per-request launch's (Triton kernels interpreted on CPU). The GPU check against transformers,
with CUDA graphs, is ``tests/engine/test_engine_gpu.py::test_flat_split_engine_matches_transformers``."""

import dataclasses

from engine_helpers import make_llm, pool_is_idle

from pagedkv import SamplingParams
from pagedkv.attention.triton_backend import TritonAttentionBackend
from pagedkv.attention.triton_decode import INTERPRET_DECODE_CONFIG


def test_engine_with_flat_split_equals_per_request_launch(tiny_dir, monkeypatch):
    """Mixed lengths (1-40-token prompts, 6 output tokens, chunked prefill at a 32-token budget:
    decodes in mixed steps and in decode-only steps) over 3 programs a KV head with shares of
    at least one 16-position tile: requests cut across programs and merged. The default
    configuration (``decode_config=None``: flat split, longest-first order and one range on)
    takes the flat launches too; both give the per-request launch's tokens."""
    import pagedkv.attention.triton_decode as td

    path = tiny_dir("qwen3")
    flat = dataclasses.replace(INTERPRET_DECODE_CONFIG, flat_split=True,
                               flat_programs_per_sm=6.5 / 132, flat_min_split_tokens=16)
    prompts = [[3 + i] * n for i, n in enumerate((3, 40, 7, 22, 1, 15))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    inner = td._flat_decode
    launches = []

    def counted(*a, **kw):
        launches.append(a[5])  # num_reqs
        return inner(*a, **kw)

    monkeypatch.setattr(td, "_flat_decode", counted)
    outs = []
    per_request = dataclasses.replace(INTERPRET_DECODE_CONFIG, flat_split=False, use_order=False,
                                      lpt_one_range=False)
    for cfg in (flat, None, per_request):
        launches.clear()
        llm = make_llm(path, attention_backend=TritonAttentionBackend(decode_config=cfg, cascade=None),
                       max_num_batched_tokens=32)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert pool_is_idle(llm)
        assert bool(launches) == (cfg is not per_request)
    assert outs[0] == outs[1]


def test_engine_with_fused_reduce_equals_the_reduce_launches(tiny_dir):
    """``DecodeConfig.fused_reduce`` through the engine (flat and per-request launches, no
    reduce kernel): the same greedy tokens as with the reduce launches, the pool idle after."""
    path = tiny_dir("qwen3")
    flat = dataclasses.replace(INTERPRET_DECODE_CONFIG, flat_split=True,
                               flat_programs_per_sm=6.5 / 132, flat_min_split_tokens=16)
    per_request = dataclasses.replace(INTERPRET_DECODE_CONFIG, flat_split=False, use_order=False,
                                      lpt_one_range=False)
    prompts = [[3 + i] * n for i, n in enumerate((3, 40, 7, 22, 1, 15))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for base in (flat, per_request):
        outs = []
        for fused in (False, True):
            cfg = dataclasses.replace(base, fused_reduce=True) if fused else base.unfused()
            llm = make_llm(path, max_num_batched_tokens=32,
                           attention_backend=TritonAttentionBackend(decode_config=cfg,
                                                                    cascade=None))
            outs.append([o.outputs[0].token_ids
                         for o in llm.generate(prompts, params, use_tqdm=False)])
            assert pool_is_idle(llm)
        assert outs[0] == outs[1]
