"""The ``kv_cache_dtype`` option (vLLM's names) and what it does to each kind of KV-cache spec:
paged K/V specs take ``float8_e4m3fn`` (half the page bytes of bf16), latent, compressed and
state specs keep their dtype."""

import pytest

from pagedkv.config import CacheConfig, EngineConfig, kv_cache_dtype_name
from pagedkv.core.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    with_kv_cache_dtype,
)
from pagedkv.errors import ConfigError

F8 = "float8_e4m3fn"


def test_option_names():
    assert kv_cache_dtype_name("auto") is None
    assert kv_cache_dtype_name("fp8") == kv_cache_dtype_name("fp8_e4m3") == F8
    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig.from_options(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    assert CacheConfig(cache_dtype="fp8_e4m3").cache_dtype == "fp8_e4m3"
    with pytest.raises(ConfigError, match="e5m2 is not supported"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    for bad in ("bf16", "", None, 8):
        with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
            EngineConfig(kv_cache_dtype=bad)
        with pytest.raises(ConfigError, match="CacheConfig.cache_dtype"):
            CacheConfig(cache_dtype=bad)


def test_paged_kv_specs_take_fp8_and_halve_their_pages():
    common = dict(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    for spec in (FullAttentionSpec(**common), SlidingWindowSpec(sliding_window=128, **common),
                 ChunkedLocalAttentionSpec(attention_chunk_size=64, **common)):
        q = with_kv_cache_dtype(spec, F8)
        assert type(q) is type(spec) and q.dtype == F8
        assert q.page_size_bytes * 2 == spec.page_size_bytes == 16 * 8 * 256 * 2
        assert with_kv_cache_dtype(spec, None) is spec
        assert q == spec.__class__(**{**spec.__dict__, "dtype": F8})  # nothing else changed


def test_latent_compressed_and_state_specs_keep_their_dtype():
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="bfloat16")
    swa_mla = SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=512,
                                   dtype="bfloat16", sliding_window=128)
    compressed = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64,
                                   dtype="bfloat16", compress_ratio=4)
    state = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=("float32",))
    for spec in (mla, swa_mla, compressed, state):
        assert with_kv_cache_dtype(spec, F8) is spec
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
    uni = UniformTypeKVCacheSpecs(block_size=16, specs=(("a", full), ("b", mla)))
    got = dict(with_kv_cache_dtype(uni, F8).specs)
    assert got["a"].dtype == F8 and got["b"] is mla
    with pytest.raises(ConfigError, match="unknown KV-cache dtype"):
        with_kv_cache_dtype(full, "float8")
