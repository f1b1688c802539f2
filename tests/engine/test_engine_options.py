"""First-contact options and input checks of ``LLM``: generation_config.json (EOS lists and
default sampling), ``tokenizer=DIR``, ``max_model_len`` against the trained context, empty and
malformed prompt arguments, unknown devices."""

import json
import os
import shutil

import pytest
from engine_helpers import TEXTS, make_llm, pool_is_idle

from pagedkv import LLM, SamplingParams
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.models.generation_config import GenerationDefaults, load_generation_defaults


def _copy(src: str, dst: str, drop=()) -> str:
    shutil.copytree(src, dst)
    for name in drop:
        os.remove(os.path.join(dst, name))
    return dst


def test_generation_config_eos_list_and_default_sampling(tiny_dir, tmp_path):
    src = tiny_dir("qwen3")
    free_run = make_llm(src).generate(
        [TEXTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    toks = free_run[0].outputs[0].token_ids
    stop_at = next(i for i in range(2, 12) if toks[i] not in toks[:i])  # first new token >= pos 2
    d = _copy(src, str(tmp_path / "m"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    primary = cfg.get("eos_token_id")
    # an instruct-style list: config.json's id plus an end-of-turn id the model emits
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [primary, toks[stop_at]] if primary is not None else [toks[stop_at]],
                   "temperature": 0.0, "top_p": 0.5, "max_new_tokens": 12}, f)
    gd = load_generation_defaults(d)
    assert toks[stop_at] in gd.eos_token_ids and gd.sampling["max_tokens"] == 12
    llm = make_llm(d)
    assert toks[stop_at] in llm.engine.eos_token_ids
    out = llm.generate([TEXTS[2]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.token_ids == toks[: stop_at + 1] and c.finish_reason == "stop"
    # no SamplingParams: the file's values (greedy, 12 tokens) instead of SamplingParams()'s
    dp = llm.engine.default_sampling_params()
    assert (dp.temperature, dp.max_tokens) == (0.0, 12)
    out = llm.generate([TEXTS[2]], use_tqdm=False)[0]
    assert out.outputs[0].token_ids == toks[: stop_at + 1]
    # ignore_eos skips the whole list
    out = llm.generate([TEXTS[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == toks
    assert pool_is_idle(llm)


def test_generation_config_errors(tmp_path):
    assert load_generation_defaults(tmp_path) == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(ConfigError, match="eos_token_id"):
        load_generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="JSON"):
        load_generation_defaults(tmp_path)


def test_tokenizer_from_another_directory(tiny_dir, tmp_path):
    src = tiny_dir("llama")
    bare = _copy(src, str(tmp_path / "weights"), drop=["tokenizer.json"])
    assert make_llm(bare).tokenizer is None  # "auto": none in the model directory
    llm = make_llm(bare, tokenizer=src)  # vLLM's spelling: LLM(model=d, tokenizer=d2)
    assert llm.tokenizer is not None
    a = llm.generate([TEXTS[1]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    b = make_llm(src).generate([TEXTS[1]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert a.outputs[0].text == b.outputs[0].text and a.prompt_token_ids == b.prompt_token_ids
    with pytest.raises(ConfigError, match="tokenizer directory"):
        make_llm(bare, tokenizer=str(tmp_path / "missing"))


def test_max_model_len_beyond_trained_context(tiny_dir, monkeypatch):
    path = tiny_dir("llama")  # max_position_embeddings 256
    with pytest.raises(ConfigError, match="trained context.*allow_long_max_model_len"):
        make_llm(path, max_model_len=512)
    assert make_llm(path, max_model_len=512, allow_long_max_model_len=True).engine.max_model_len == 512
    monkeypatch.setenv("PAGEDKV_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert make_llm(path, max_model_len=512).engine.max_model_len == 512


def test_max_trained_len_counts_rope_scaling():
    from pagedkv.models.config import ModelArchConfig

    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=1,
                num_attention_heads=4, intermediate_size=128, vocab_size=100,
                max_position_embeddings=4096)
    assert ModelArchConfig.from_dict(base).max_trained_len == 4096
    lin = dict(base, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert ModelArchConfig.from_dict(lin).max_trained_len == 8192
    yarn = dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 2048})
    assert ModelArchConfig.from_dict(yarn).max_trained_len == 8192
    l3 = dict(base, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 512})
    assert ModelArchConfig.from_dict(l3).max_trained_len == 4096


def test_prompt_arguments(tiny_dir):
    llm = make_llm(tiny_dir("llama"))
    assert llm.generate([]) == [] and llm.generate(()) == []
    for bad in (5, 2.5, None, b"bytes", object()):
        with pytest.raises(InvalidRequestError, match="prompts must be"):
            llm.generate(bad)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]])
    assert pool_is_idle(llm)


@pytest.mark.parametrize("device", ["tpu", "mps:0", "cuda:7", "nonsense", 3.5])
def test_unknown_devices_are_config_errors(tiny_dir, device):
    import torch

    if str(device).startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(ConfigError, match="device"):
        LLM(tiny_dir("llama"), device=device)


def test_engine_config_owns_the_options(tiny_dir):
    """One frozen EngineConfig: LLM(**options) and LLM(config=...) build the same engine; an
    unknown option names the closest one; device-dependent defaults resolve per device; bad
    values are typed errors before any model is loaded."""
    import dataclasses

    from pagedkv.config import EngineConfig

    path = tiny_dir("qwen3")
    opts = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                kv_cache_memory_bytes=1 << 20, block_size=32, seed=3)
    a = LLM(path, dtype="float32", device="cpu", attention_backend="torch_ref", **opts)
    b = LLM(path, dtype="float32", device="cpu", attention_backend="torch_ref",
            config=EngineConfig(**opts))
    assert a.engine.engine_config == b.engine.engine_config
    ec = a.engine.engine_config
    assert ec.block_size == 32 and ec.async_scheduling is False and ec.compile_model is False
    p = SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True)
    assert a.generate(TEXTS[1], p, use_tqdm=False)[0].outputs[0].token_ids == \
        b.generate(TEXTS[1], p, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ConfigError, match="unknown engine option 'max_num_seq'.*'max_num_seqs'"):
        LLM(path, device="cpu", max_num_seq=4)
    with pytest.raises(ConfigError, match="not both"):
        LLM(path, device="cpu", config=EngineConfig(), block_size=16)
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="sanitize must be True or False"):
        EngineConfig(sanitize="yes")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ec.block_size = 16
    cuda = EngineConfig().resolved("cuda")
    assert (cuda.async_scheduling, cuda.compile_model, cuda.warmup) == (True, True, True)
    cpu = EngineConfig(async_scheduling=True).resolved("cpu")
    assert (cpu.async_scheduling, cpu.compile_model, cpu.warmup) == (True, False, False)
    assert EngineConfig(cuda_graph_sizes=[1, 2, 8]).cuda_graph_sizes == (1, 2, 8)


def test_block_size_default_follows_the_device(tiny_dir):
    """``block_size=None`` (the default): pages of 64 on CUDA, 16 elsewhere; an explicit value
    always wins, and the DCP interleave rule is checked on the resolved size."""
    import torch

    from pagedkv.config import EngineConfig, default_block_size

    assert EngineConfig().block_size is None
    assert EngineConfig().resolved("cpu").block_size == 16
    assert EngineConfig().resolved("cuda").block_size == 64
    assert EngineConfig().resolved(torch.device("cuda", 1)).block_size == 64
    assert EngineConfig(block_size=16).resolved("cuda").block_size == 16
    assert EngineConfig(block_size=128).resolved("cpu").block_size == 128
    assert default_block_size("cuda:0") == 64 and default_block_size(torch.device("cpu")) == 16
    with pytest.raises(ConfigError, match="block_size must be an int >= 1"):
        EngineConfig(block_size=0)
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=True)
    # interleave 32 fits CUDA's 64-token pages but not CPU's 16
    assert EngineConfig(dcp_kv_cache_interleave_size=32).resolved("cuda").block_size == 64
    with pytest.raises(ConfigError, match="must divide block_size=16"):
        EngineConfig(dcp_kv_cache_interleave_size=32).resolved("cpu")
    # the engine runs with the resolved size
    llm = make_llm(tiny_dir("qwen3"))
    groups = llm.engine.scheduler.kv_cache_config.kv_cache_groups
    assert groups[0].kv_cache_spec.block_size == 16 and llm.engine.runner.block_size == 16


def test_max_num_batched_tokens_default_follows_the_device(tiny_dir, monkeypatch):
    """``max_num_batched_tokens=None`` (the default): 16,384 on a CUDA GPU of >= 70 GiB that
    is not an A100 (vLLM's ``LLM`` rule), 8,192 elsewhere; an explicit value always wins."""
    import types

    import torch

    from pagedkv.config import EngineConfig, default_max_num_batched_tokens, large_gpu

    gib = 1024**3
    assert large_gpu(141 * gib, "NVIDIA H200") and large_gpu(80 * gib, "NVIDIA H100 80GB HBM3")
    assert not large_gpu(80 * gib, "NVIDIA A100-SXM4-80GB")  # A100s keep the smaller default
    assert not large_gpu(69 * gib, "NVIDIA H100 NVL") and not large_gpu(24 * gib, "NVIDIA L4")
    assert large_gpu(70 * gib, "x")  # the boundary is inclusive
    assert EngineConfig().max_num_batched_tokens is None
    assert EngineConfig().resolved("cpu").max_num_batched_tokens == 8192
    assert EngineConfig(max_num_batched_tokens=512).resolved("cpu").max_num_batched_tokens == 512
    assert default_max_num_batched_tokens(torch.device("cpu")) == 8192
    # a stand-in CUDA runtime: the device's name and memory decide
    props = {0: ("NVIDIA H200", 141 * gib), 1: ("NVIDIA A100-SXM4-80GB", 80 * gib)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name=props[i][0], total_memory=props[i][1]))
    assert default_max_num_batched_tokens("cuda") == 16384
    assert default_max_num_batched_tokens(torch.device("cuda", 1)) == 8192
    assert EngineConfig().resolved(torch.device("cuda", 0)).max_num_batched_tokens == 16384
    assert EngineConfig(max_num_batched_tokens=8192).resolved("cuda").max_num_batched_tokens == 8192
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)
    # the engine reports the value it scheduled with
    monkeypatch.undo()
    llm = make_llm(tiny_dir("qwen3"), max_num_batched_tokens=None)
    assert llm.get_kv_stats()["max_num_batched_tokens"] == 8192
    assert make_llm(tiny_dir("qwen3")).get_kv_stats()["max_num_batched_tokens"] == 256


def test_cli_batched_tokens_and_mixed_graph_defaults():
    """``pagedkv generate`` / ``bench`` leave the step budget to the engine (the device's
    default), ``pagedkv serve`` keeps vLLM's API-server value 8,192; mixed-step CUDA graphs
    are on everywhere unless turned off."""
    from pagedkv.cli import _engine_kwargs, build_parser

    parser = build_parser()
    gen = parser.parse_args(["generate", "--model", "m", "--prompt", "x"])
    serve = parser.parse_args(["serve", "m"])
    bench = parser.parse_args(["bench"])
    assert gen.max_num_batched_tokens is None and bench.max_num_batched_tokens is None
    assert serve.max_num_batched_tokens == 8192
    # mixed-step CUDA graphs: on by default (the config's and every command's), off by flag
    assert _engine_kwargs(gen)["mixed_cuda_graphs"] is True
    assert _engine_kwargs(serve)["mixed_cuda_graphs"] is True
    off = parser.parse_args(["serve", "m", "--no-mixed-cuda-graphs", "--max-num-batched-tokens",
                             "4096"])
    assert _engine_kwargs(off)["mixed_cuda_graphs"] is False and off.max_num_batched_tokens == 4096
    from pagedkv.config import EngineConfig

    assert EngineConfig().mixed_cuda_graphs is True
    assert EngineConfig(mixed_cuda_graphs=False).mixed_cuda_graphs is False
    with pytest.raises(ConfigError, match="mixed_cuda_graphs"):
        EngineConfig(mixed_cuda_graphs="yes")
