"""Group formation, scheduler config and block-size resolution (semantics sec. 1)."""

import pytest

from pagedkv.core.planning import (
    generate_scheduler_kv_cache_config,
    get_kv_cache_groups,
    resolve_kv_cache_block_sizes,
    unify_kv_cache_spec_page_size,
)
from pagedkv.core.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaCacheMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from pagedkv.errors import ConfigError

FULL = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64)
SWA = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=64, sliding_window=64)


def layers(prefix, n, spec, start=0):
    return {f"{prefix}.{i}": spec for i in range(start, start + n)}


def test_no_layers_no_groups():
    assert get_kv_cache_groups({}) == []


def test_same_spec_one_group():
    groups = get_kv_cache_groups(layers("l", 4, FULL))
    assert len(groups) == 1
    assert groups[0].layer_names == ("l.0", "l.1", "l.2", "l.3")
    assert groups[0].kv_cache_spec == FULL


def test_same_type_different_heads_uniform_type_group():
    other = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128)
    specs = {"a": FULL, "b": other, "c": FULL}
    groups = get_kv_cache_groups(specs)
    assert len(groups) == 1
    spec = groups[0].kv_cache_spec
    assert isinstance(spec, UniformTypeKVCacheSpecs)
    assert spec.block_size == 16
    assert dict(spec.specs) == specs
    assert groups[0].layer_names == ("a", "b", "c")
    # MLA is a full-attention subclass but a different type: hybrid, not uniform.
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=1024)
    assert len(get_kv_cache_groups({"a": FULL, "m": mla})) == 2


def test_same_type_needs_same_block_size_and_window():
    # Different block sizes are not one type: hybrid path, page sizes differ by 2x ->
    # the smaller page's block size is doubled, after which the specs are equal.
    small = FullAttentionSpec(block_size=8, num_kv_heads=8, head_size=64)
    groups = get_kv_cache_groups({"a": FULL, "b": small})
    assert [g.kv_cache_spec for g in groups] == [FULL]
    assert groups[0].layer_names == ("a", "b")
    w2 = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=64, sliding_window=128)
    groups = get_kv_cache_groups({"a": SWA, "b": w2})
    assert len(groups) == 2


def test_hybrid_equal_buckets():
    specs = {}
    for i in range(6):  # interleaved full / swa
        specs[f"l.{i}"] = FULL if i % 2 == 0 else SWA
    groups = get_kv_cache_groups(specs)
    assert [(g.layer_names, g.kv_cache_spec) for g in groups] == [
        (("l.0", "l.2", "l.4"), FULL),
        (("l.1", "l.3", "l.5"), SWA),
    ]


def test_hybrid_group_size_smallest_bucket():
    # 2 full + 6 swa: max 6 >= 1.5 * 2, so group_size = 2: full -> 1 group, swa -> 3 groups
    specs = {**layers("f", 2, FULL), **layers("s", 6, SWA)}
    groups = get_kv_cache_groups(specs)
    assert [g.layer_names for g in groups] == [
        ("f.0", "f.1"),
        ("s.0", "s.3"),
        ("s.1", "s.4"),
        ("s.2", "s.5"),
    ]
    assert [g.kv_cache_spec for g in groups] == [FULL, SWA, SWA, SWA]


def test_hybrid_group_size_largest_bucket_with_padding():
    # 4 full + 5 swa: 5 < 1.5 * 4 -> group_size 5: one group each (full padded by 1).
    specs = {**layers("f", 4, FULL), **layers("s", 5, SWA)}
    groups = get_kv_cache_groups(specs)
    assert [g.layer_names for g in groups] == [
        ("f.0", "f.1", "f.2", "f.3"),
        ("s.0", "s.1", "s.2", "s.3", "s.4"),
    ]
    # 3 full + 7 swa: 7 >= 4.5 -> group_size 3: swa splits into 3 groups [i::3]
    specs = {**layers("f", 3, FULL), **layers("s", 7, SWA)}
    groups = get_kv_cache_groups(specs)
    assert [g.layer_names for g in groups] == [
        ("f.0", "f.1", "f.2"),
        ("s.0", "s.3", "s.6"),
        ("s.1", "s.4"),
        ("s.2", "s.5"),
    ]


def test_hybrid_page_size_unification():
    # SWA with 2 heads has a quarter of the full page: its block size becomes 64.
    swa_small = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, sliding_window=64)
    specs = {"f.0": FULL, "s.0": swa_small}
    unified = unify_kv_cache_spec_page_size(specs)
    assert unified["f.0"] == FULL
    assert unified["s.0"].block_size == 64
    assert unified["s.0"].page_size_bytes == FULL.page_size_bytes
    groups = get_kv_cache_groups(specs)
    assert [g.kv_cache_spec.block_size for g in groups] == [16, 64]
    assert len({g.kv_cache_spec.page_size_bytes for g in groups}) == 1


def test_hybrid_page_size_impossible():
    # 3 heads vs 8 heads: 8*... page not divisible by 3*... page
    odd = SlidingWindowSpec(block_size=16, num_kv_heads=3, head_size=64, sliding_window=64)
    with pytest.raises(ConfigError, match="does not divide"):
        get_kv_cache_groups({"f": FULL, "s": odd})
    # Mamba pages do not grow with the block size.
    mamba = MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",))
    with pytest.raises(ConfigError, match="does not scale"):
        get_kv_cache_groups({"f": FULL, "m": mamba})


def test_bad_specs_rejected():
    with pytest.raises(ConfigError):
        get_kv_cache_groups({"a": "full"})
    with pytest.raises(ConfigError):
        get_kv_cache_groups([("a", FULL)])
    with pytest.raises(ConfigError):
        get_kv_cache_groups({"": FULL})


def test_generate_scheduler_config_replaces_uniform_type():
    other = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128)
    groups = get_kv_cache_groups({"a": FULL, "b": other})
    cfg = KVCacheConfig(num_blocks=10, kv_cache_groups=groups)
    sched = generate_scheduler_kv_cache_config(cfg)
    assert sched.num_blocks == 10
    assert sched.kv_cache_groups[0].kv_cache_spec == FULL
    assert sched.kv_cache_groups[0].layer_names == ("a", "b")
    assert isinstance(cfg.kv_cache_groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)  # untouched
    assert generate_scheduler_kv_cache_config([cfg, cfg]) == sched
    with pytest.raises(ConfigError):
        generate_scheduler_kv_cache_config([cfg, KVCacheConfig(num_blocks=11, kv_cache_groups=groups)])
    with pytest.raises(ConfigError):
        generate_scheduler_kv_cache_config([])


def g(spec):
    return KVCacheGroupSpec(("x",), spec)


def test_block_sizes_one_group():
    assert resolve_kv_cache_block_sizes([g(FULL)], 16, True) == (16, 16)
    assert resolve_kv_cache_block_sizes([g(FULL)], 16, True, dcp=2) == (32, 32)
    assert resolve_kv_cache_block_sizes([g(FULL)], 16, False) == (16, 16)


def test_block_sizes_hybrid():
    f32 = FullAttentionSpec(block_size=32)
    s16 = SlidingWindowSpec(block_size=16, sliding_window=64)
    s48 = SlidingWindowSpec(block_size=48, sliding_window=64)
    assert resolve_kv_cache_block_sizes([g(f32), g(s16)], 16, True) == (32, 16)
    assert resolve_kv_cache_block_sizes([g(f32), g(s48)], 16, True) == (96, 16)
    # no prefix caching: hash size falls back to the scheduler size
    assert resolve_kv_cache_block_sizes([g(f32), g(s16)], 16, False) == (32, 32)
    # ... unless a connector is active
    assert resolve_kv_cache_block_sizes([g(f32), g(s16)], 16, False, kv_connector=True) == (32, 16)
    # dcp scales attention groups
    assert resolve_kv_cache_block_sizes([g(f32), g(s16)], 16, True, dcp=2) == (64, 32)
    # prefix_match_unit override
    assert resolve_kv_cache_block_sizes([g(f32), g(s16)], 16, True, prefix_match_unit=8) == (32, 8)
    with pytest.raises(ConfigError, match="must divide"):
        resolve_kv_cache_block_sizes([g(f32), g(s16)], 16, True, prefix_match_unit=32)
    chunk = ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=64)
    assert resolve_kv_cache_block_sizes([g(f32), g(chunk)], 16, True) == (32, 16)


def test_block_sizes_mamba():
    f16 = FullAttentionSpec(block_size=16)
    m_none = MambaSpec(block_size=64)
    m_align = MambaSpec(block_size=64, mamba_cache_mode=MambaCacheMode.ALIGN)
    assert resolve_kv_cache_block_sizes([g(f16), g(m_none)], 16, True) == (64, 64)
    assert resolve_kv_cache_block_sizes([g(f16), g(m_align)], 16, True) == (64, 16)


def test_block_sizes_bad_input():
    with pytest.raises(ConfigError):
        resolve_kv_cache_block_sizes([g(FULL)], 0, True)
    with pytest.raises(ConfigError):
        resolve_kv_cache_block_sizes([g(FULL)], 16, True, dcp=0)
    with pytest.raises(ConfigError):
        resolve_kv_cache_block_sizes([g(FULL), g(SWA)], 16, True, prefix_match_unit=-1)
