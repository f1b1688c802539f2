"""The longest-first decode launch through the engine (``DecodeConfig.use_order``): the runner
stages ``decode_order`` only for a backend that reads it, and the tokens equal the row-order
engine's (Triton kernels interpreted on CPU; the GPU twin of the kernel check is in
tests/attention/test_triton_decode.py)."""

import dataclasses

from engine_helpers import make_llm, pool_is_idle

from pagedkv import SamplingParams
from pagedkv.attention.triton_backend import TritonAttentionBackend
from pagedkv.attention.triton_decode import INTERPRET_DECODE_CONFIG


def test_engine_with_decode_order_equals_row_order(tiny_dir, monkeypatch):
    """Mixed lengths (3-40-token prompts, 6 output tokens, chunked prefill at a 32-token
    budget): every decode launch of the ordered engine runs over a longest-first order that
    the preparer staged, and its greedy tokens are the row-order engine's."""
    path = tiny_dir("qwen3")
    # the per-request launch (no flat split, no one-range policy), ordered and in row order
    ordered_cfg = dataclasses.replace(INTERPRET_DECODE_CONFIG, use_order=True, flat_split=False,
                                      lpt_one_range=False)
    row_cfg = dataclasses.replace(ordered_cfg, use_order=False)
    prompts = [[3 + i] * n for i, n in enumerate((3, 40, 7, 22, 1, 15))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs, seen, launched = [], [], []
    import pagedkv.attention.triton_backend as tb
    inner_decode = tb.paged_decode_attention

    def decode(*a, **kw):
        launched.append(kw.get("order") is not None)
        return inner_decode(*a, **kw)

    monkeypatch.setattr(tb, "paged_decode_attention", decode)
    for cfg in (ordered_cfg, row_cfg):
        launched.clear()
        backend = TritonAttentionBackend(decode_config=cfg, cascade=None)
        llm = make_llm(path, attention_backend=backend, max_num_batched_tokens=32)
        prep = llm.runner.preparer
        assert prep.decode_order_enabled == (cfg is ordered_cfg)
        inner = prep.prepare

        def prepare(*a, _inner=inner, **kw):
            step = _inner(*a, **kw)
            if step.decode_order is not None:
                n = step.num_reqs_padded
                seq = step.seq_lens_cpu[:n].tolist()
                order = step.decode_order.tolist()
                assert sorted(order[:n]) == list(range(n))
                assert [seq[i] for i in order[:n]] == sorted(seq, reverse=True)
                seen.append(n)
            return step

        prep.prepare = prepare
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)])
        assert pool_is_idle(llm)
        assert launched and set(launched) == {cfg is ordered_cfg}  # the backend passes it on
    assert seen and max(seen) == len(prompts)
    assert outs[0] == outs[1]


def test_engine_with_longest_first_one_range_equals_default(tiny_dir, monkeypatch):
    """``DecodeConfig.lpt_one_range`` through the engine, its bounds scaled to the tiny model
    (one program slot, from one program on): decode-only steps whose lengths pass the bound
    launch one range per request longest first (``balanced=True``), the others split; the
    greedy tokens equal the per-request launch's (row order, no one-range policy)."""
    path = tiny_dir("qwen3")
    lpt = dataclasses.replace(INTERPRET_DECODE_CONFIG, use_order=True, lpt_one_range=True,
                              balanced_min_programs_per_sm=0.0, wave_programs_per_sm=1.0 / 132,
                              lpt_load_fraction=2.0)
    prompts = [[3 + i] * n for i, n in enumerate((3, 40, 7, 22, 1, 15))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    import pagedkv.attention.triton_backend as tb
    inner_decode = tb.paged_decode_attention
    balanced = []

    def decode(*a, **kw):
        balanced.append(bool(kw.get("balanced")))
        return inner_decode(*a, **kw)

    monkeypatch.setattr(tb, "paged_decode_attention", decode)
    outs = []
    plain = dataclasses.replace(INTERPRET_DECODE_CONFIG, use_order=False, lpt_one_range=False,
                                flat_split=False, balanced_min_programs_per_sm=0.0,
                                wave_programs_per_sm=1.0 / 132)
    for cfg in (lpt, plain):
        balanced.clear()
        llm = make_llm(path, attention_backend=TritonAttentionBackend(decode_config=cfg, cascade=None),
                       max_num_batched_tokens=32)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)])
        assert pool_is_idle(llm)
        if cfg is lpt:  # both launches met
            assert True in balanced and False in balanced
        else:
            assert True not in balanced
    assert outs[0] == outs[1]
