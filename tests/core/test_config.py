"""CacheConfig / SchedulerConfig validation."""

import dataclasses

import pytest

from pagedkv.config import CacheConfig, SchedulerConfig
from pagedkv.errors import ConfigError


def test_defaults():
    c = CacheConfig()
    assert (c.block_size, c.num_gpu_blocks, c.enable_prefix_caching) == (16, None, True)
    assert c.prefix_caching_hash_algo == "sha256"
    s = SchedulerConfig()
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.policy) == (256, 8192, "fcfs")
    assert s.enable_chunked_prefill and s.scheduler_reserve_full_isl
    assert s.token_budget == 8192
    assert SchedulerConfig(max_num_scheduled_tokens=100).token_budget == 100


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CacheConfig().block_size = 32
    s = dataclasses.replace(SchedulerConfig(), max_num_seqs=8)
    assert s.max_num_seqs == 8


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_size=0),
        dict(block_size=True),
        dict(block_size=16.0),
        dict(num_gpu_blocks=1),
        dict(enable_prefix_caching=1),
        dict(prefix_caching_hash_algo="md5"),
        dict(gpu_memory_utilization=0.0),
        dict(gpu_memory_utilization=1.5),
        dict(prefix_match_unit=0),
        dict(mamba_cache_mode="fast"),
        dict(cache_dtype=""),
    ],
)
def test_cache_config_invalid(kwargs):
    with pytest.raises(ConfigError):
        CacheConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_num_seqs=0),
        dict(max_num_batched_tokens=0),
        dict(max_model_len=1),
        dict(long_prefill_token_threshold=-1),
        dict(policy="lifo"),
        dict(num_lookahead_tokens=-1),
        dict(watermark=1.0),
        dict(watermark=-0.1),
        dict(max_num_scheduled_tokens=0),
        dict(max_num_scheduled_tokens=9000),
        dict(max_num_seqs=512, max_num_batched_tokens=256),
        dict(enable_chunked_prefill=False, max_num_batched_tokens=1024, max_model_len=2048),
        dict(enable_chunked_prefill="yes"),
        dict(enable_chunked_prefill=False, max_num_batched_tokens=4096, max_model_len=2048,
             max_num_scheduled_tokens=1024),
    ],
)
def test_scheduler_config_invalid(kwargs):
    with pytest.raises(ConfigError) as e:
        SchedulerConfig(**kwargs)
    assert "SchedulerConfig" in str(e.value) or "chunked" in str(e.value)


def test_error_messages_say_what_to_do():
    with pytest.raises(ConfigError, match="raise max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=512, max_num_batched_tokens=256)
    with pytest.raises(ConfigError, match="enable chunked prefill"):
        SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=1024, max_model_len=2048)
