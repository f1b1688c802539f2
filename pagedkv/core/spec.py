"""KV-cache specs, KV-cache groups and the KV-cache config.

A *spec* says how one layer's KV memory is managed: how many tokens one block holds
(``block_size``), whether prefix caching applies, whether the worker computes a per-token
slot mapping for it, and how many bytes one block takes. Layers with the same spec share
one block table (one *KV-cache group*); each layer keeps its own KV tensor.

Pure Python: no torch import (control plane).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from pagedkv.errors import ConfigError

# Bytes per element of the dtypes a KV cache may use (names as torch spells them).
DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def dtype_size(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ConfigError(
            f"unknown KV-cache dtype {dtype!r}; use one of {sorted(DTYPE_SIZES)}"
        ) from None


class SlotMappingMode(enum.Enum):
    """How the worker turns a group's block table into per-token write positions."""

    TOKEN_TO_KV_SLOT = "token_to_kv_slot"  # one flat KV slot per scheduled token
    NONE = "none"  # Mamba-style state groups: the block table holds state indices


class MambaCacheMode(str, enum.Enum):
    NONE = "none"  # one block holds the whole state (prefix caching off)
    ALIGN = "align"  # state checkpoints at block boundaries (prefix caching on)
    ALL = "all"


@dataclass(frozen=True)
class KVCacheSpec:
    """Base spec. ``block_size`` is the number of tokens one (manager) block covers."""

    block_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(f"block_size must be a positive int, got {self.block_size!r}")

    # The kind name groups specs into buckets for hybrid group formation.
    @property
    def type_id(self) -> str:
        return type(self).__name__

    @property
    def prefix_cacheable(self) -> bool:
        return True

    @property
    def uses_slot_mapping(self) -> bool:
        return True

    @property
    def slot_mapping_mode(self) -> SlotMappingMode:
        return SlotMappingMode.TOKEN_TO_KV_SLOT if self.uses_slot_mapping else SlotMappingMode.NONE

    @property
    def page_size_bytes(self) -> int:
        raise ConfigError(f"{type(self).__name__} has no page size; use a concrete spec class")

    def max_num_blocks_per_req(self, max_model_len: int) -> int:
        return cdiv(max_model_len, self.block_size)

    def copy_with_new_block_size(self, block_size: int) -> "KVCacheSpec":
        return replace(self, block_size=block_size)


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """Paged attention KV: K and V of ``num_kv_heads`` x ``head_size`` per token."""

    num_kv_heads: int = 1
    head_size: int = 64
    dtype: str = "bfloat16"
    head_size_v: int | None = None
    # Compressed KV (DeepSeek-V4 style): one stored state per ``compress_ratio`` tokens.
    compress_ratio: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_kv_heads", "head_size", "compress_ratio"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        dtype_size(self.dtype)
        if self.block_size % self.compress_ratio:
            raise ConfigError(
                f"block_size {self.block_size} must be a multiple of compress_ratio "
                f"{self.compress_ratio}"
            )

    @property
    def storage_block_size(self) -> int:
        """States stored per block: ``block_size // compress_ratio``."""
        return self.block_size // self.compress_ratio

    @property
    def v_size(self) -> int:
        return self.head_size if self.head_size_v is None else self.head_size_v

    @property
    def page_size_bytes(self) -> int:
        per_token = self.num_kv_heads * (self.head_size + self.v_size) * dtype_size(self.dtype)
        return self.storage_block_size * per_token


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole context: a block for every token."""


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent vector per token (no separate V).

    With ``compress_ratio`` C > 1 only the token closing each group of C tokens writes, and
    a block of ``block_size`` tokens stores ``block_size // C`` states.
    """

    @property
    def page_size_bytes(self) -> int:
        return self.storage_block_size * self.num_kv_heads * self.head_size * dtype_size(self.dtype)


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last ``sliding_window`` tokens; older blocks are released."""

    sliding_window: int = 0
    extra_retained_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be a positive int, got {self.sliding_window!r}")


@dataclass(frozen=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """DeepSeek-V4 style sliding-window MLA cache (one latent per token)."""

    @property
    def page_size_bytes(self) -> int:
        return self.storage_block_size * self.num_kv_heads * self.head_size * dtype_size(self.dtype)


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attention within fixed chunks of ``attention_chunk_size`` tokens."""

    attention_chunk_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.attention_chunk_size, int) or self.attention_chunk_size < 1:
            raise ConfigError(
                f"attention_chunk_size must be a positive int, got {self.attention_chunk_size!r}"
            )


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """Recurrent state (Mamba / linear attention). No per-token slot mapping: the block
    table holds state indices."""

    shapes: tuple[tuple[int, ...], ...] = ((1,),)
    dtypes: tuple[str, ...] = ("float32",)
    mamba_cache_mode: MambaCacheMode = MambaCacheMode.NONE
    num_speculative_blocks: int = 0
    # the page the pool gives one state block when it is larger than the state (a hybrid
    # model's pages are equal across groups: the state page is padded to the attention page)
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.shapes) != len(self.dtypes):
            raise ConfigError("MambaSpec needs one dtype per state shape")
        for d in self.dtypes:
            dtype_size(d)
        object.__setattr__(self, "mamba_cache_mode", MambaCacheMode(self.mamba_cache_mode))
        if self.page_size_padded is not None and self.page_size_padded < self.state_bytes:
            raise ConfigError(f"MambaSpec.page_size_padded ({self.page_size_padded}) is smaller "
                              f"than the state ({self.state_bytes} bytes)")

    @property
    def uses_slot_mapping(self) -> bool:
        return False

    @property
    def prefix_cacheable(self) -> bool:
        return self.mamba_cache_mode == MambaCacheMode.ALIGN

    @property
    def state_bytes(self) -> int:
        """Bytes of one state block: every state tensor, unpadded."""
        return sum(math.prod(s) * dtype_size(d) for s, d in zip(self.shapes, self.dtypes))

    @property
    def page_size_bytes(self) -> int:
        return self.state_bytes if self.page_size_padded is None else self.page_size_padded

    def max_num_blocks_per_req(self, max_model_len: int) -> int:
        if self.mamba_cache_mode != MambaCacheMode.ALIGN:
            return 1 + self.num_speculative_blocks
        return cdiv(max_model_len, self.block_size) + self.num_speculative_blocks


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers of one attention type with different shapes (e.g. head counts) sharing one
    block table. ``specs`` maps layer name -> its own spec (all with ``block_size``)."""

    specs: tuple[tuple[str, KVCacheSpec], ...] = ()

    @property
    def type_id(self) -> str:
        return self.specs[0][1].type_id if self.specs else "UniformTypeKVCacheSpecs"

    @property
    def page_size_bytes(self) -> int:
        return sum(s.page_size_bytes for _, s in self.specs)

    def representative(self) -> KVCacheSpec:
        """The member spec the scheduler uses in place of this one."""
        return self.specs[0][1]


def with_kv_cache_dtype(spec: KVCacheSpec, dtype: str | None) -> KVCacheSpec:
    """``spec`` as the engine serves it with the attention caches in ``dtype`` (a torch dtype
    name; None: unchanged): paged K/V specs (full attention, sliding window, chunked local)
    take ``dtype``; MLA latent caches (``MLAAttentionSpec``, ``SlidingWindowMLASpec``, any
    compressed spec) and state specs keep theirs (an FP8 KV cache quantizes K and V only);
    a ``UniformTypeKVCacheSpecs`` converts its members."""
    if dtype is None:
        return spec
    dtype_size(dtype)
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return replace(spec, specs=tuple((n, with_kv_cache_dtype(s, dtype)) for n, s in spec.specs))
    if (isinstance(spec, AttentionSpec) and spec.compress_ratio == 1
            and not isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec))):
        return replace(spec, dtype=dtype)
    return spec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table and one slot mapping."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))

    def layer_spec(self, name: str) -> KVCacheSpec:
        """The spec of the group's layer ``name``: its member spec in a
        ``UniformTypeKVCacheSpecs`` group, else the group's spec."""
        spec = self.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            return dict(spec.specs).get(name, spec)
        return spec


@dataclass(frozen=True)
class KVCacheConfig:
    """The pool (``num_blocks`` blocks, block 0 is the null block) and its groups.

    The position of a group in ``kv_cache_groups`` is its group id.
    """

    num_blocks: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))
        if not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be a positive int, got {self.num_blocks!r}")

    @property
    def num_groups(self) -> int:
        return len(self.kv_cache_groups)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(g.kv_cache_spec.block_size for g in self.kv_cache_groups)
