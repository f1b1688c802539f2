"""Named shapes with random weights build the right model class (``LLM.from_shape``: the
registry's class, weights finished as the loader finishes them) and generate; the full-size
entries of the benchmark shapes parse (the Gemma-3-1B and DeepSeek-V2-Lite shapes of issue
10's throughput runs), their small variants run here."""

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.models import config as model_config

SMALL = {
    "gemma-3-1b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       vocab_size=512, sliding_window=16, query_pre_attn_scalar=32),
    "deepseek-v2-lite": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                             n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32,
                             qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16,
                             vocab_size=512),
}


# 5 local : 1 global over 6 layers: vLLM's hybrid grouping gives one-layer groups (5 + 1)
@pytest.mark.parametrize("name,cls,groups", [("gemma-3-1b", "GemmaForCausalLM", 6),
                                            ("deepseek-v2-lite", "DeepseekV3ForCausalLM", 1)])
def test_shape_builds_its_family_and_generates(monkeypatch, name, cls, groups):
    full = model_config.shape_config(name)
    assert full.architecture == {"gemma-3-1b": "Gemma3ForCausalLM",
                                 "deepseek-v2-lite": "DeepseekV3ForCausalLM"}[name]
    d = model_config.shape_config_dict(name)
    d.update(SMALL[name])
    if "layer_types" in d:
        d["layer_types"] = d["layer_types"][: d["num_hidden_layers"]]
    monkeypatch.setitem(model_config.SHAPES, name + "-test", d)
    llm = LLM.from_shape(name + "-test", dtype="float32", device="cpu",
                         attention_backend="torch_ref", max_model_len=128,
                         kv_cache_memory_bytes=4 << 20, sanitize=True)
    assert type(llm.engine.model).__name__ == cls
    assert len(llm.scheduler.kv_cache_config.kv_cache_groups) == groups
    outs = llm.generate([{"prompt_token_ids": [3, 5, 7, 11] * 5}, {"prompt_token_ids": [1, 2]}],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [24, 24]
