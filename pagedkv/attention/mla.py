"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache: the contract.

The cache stores, as vLLM lays it out, one latent vector per token and no separate V: a
layer's KV tensor is ``[num_blocks, block_size, latent_dim]`` with ``latent_dim =
kv_lora_rank + qk_rope_head_dim`` (576 at DeepSeek-V3's size), the row of token ``t`` is
``[c_t | k_pe_t]``: its latent ``c`` after ``kv_a_layernorm`` and its rotary key part after
RoPE. The KV-cache spec of such a layer is ``MLAAttentionSpec(num_kv_heads=1,
head_size=latent_dim)``; slot ``s = block * block_size + offset`` as for every layout.

One call per layer and step, ``MLABackend.forward(layer_idx, q, latent, kv_cache, plan, scale,
weights)``:

- ``q [T, H, qk_nope_head_dim + qk_rope_head_dim]``: per head ``[q_nope | q_pe]``, RoPE
  applied to ``q_pe``;
- ``latent [T, latent_dim]`` (or None: already written), the step's new rows, written at the
  plan's slot mapping (``slot < 0`` skipped, token count from the slot mapping);
- ``weights``: the layer's :class:`MLAWeights` (``kv_b_proj``: the up-projection of the
  latent to per-head ``[k_nope | v]``);
- returns ``[T, H, v_head_dim]``; rows past ``query_start_loc[num_reqs]`` are zero.

For query head ``h`` and a cached token ``t``, ``k_h(t) = [W_UK[h] c_t | k_pe_t]`` and
``v_h(t) = W_UV[h] c_t`` (``W_UK [H, nope, L]``, ``W_UV [H, v, L]``: the rows of
``kv_b_proj.weight`` per head). A backend computes either form of the same attention:

- *up-projected* (prefill / extend): ``k_nope, v = kv_b_proj(c)`` for the request's cached
  latents, standard causal attention with ``qk_head_dim``-wide keys (what transformers does);
- *absorbed* (decode): ``q_nope`` is absorbed into the latent space, ``ql_h = W_UK[h]^T
  q_nope_h`` (``L`` wide), the scores are ``[ql_h | q_pe_h] . [c_t | k_pe_t]`` over the latent
  rows as they are (all heads read one "KV head"), the output ``W_UV[h] (sum_t p_t c_t)``.

Backends: ``mla_torch_ref.TorchRefMLABackend`` (the reference, CPU and GPU) and
``mla_triton_backend.TritonMLABackend`` (the Triton latent decode kernel, CUDA-graph safe
decode steps). :func:`mla_backend_for` maps an engine's attention backend to its MLA
counterpart.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from pagedkv.attention.backend import AttentionBackend, AttentionPlan
from pagedkv.errors import ConfigError, InvariantError


def mla_kv_cache_shape(num_blocks: int, block_size: int, latent_dim: int) -> tuple[int, int, int]:
    """``(num_blocks, block_size, latent_dim)``: the latent cache of one MLA layer."""
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                    ("latent_dim", latent_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"MLA KV cache {name} must be a positive integer, got {v!r}")
    return (num_blocks, block_size, latent_dim)


def allocate_mla_kv_caches(num_layers: int, num_blocks: int, block_size: int, latent_dim: int, *,
                           dtype: torch.dtype, device: str | torch.device = "cpu",
                           fill: float | None = 0.0) -> list[torch.Tensor]:
    """One latent cache per layer (``fill=None``: uninitialized; tests poison with NaN)."""
    shape = mla_kv_cache_shape(num_blocks, block_size, latent_dim)
    caches = []
    for _ in range(num_layers):
        t = torch.empty(shape, dtype=dtype, device=device)
        if fill is not None:
            t.fill_(fill)
        caches.append(t)
    return caches


def check_mla_cache(kv_cache: torch.Tensor, latent_dim: int | None = None) -> None:
    if kv_cache.dim() != 3 or (latent_dim is not None and kv_cache.shape[2] != latent_dim):
        raise InvariantError("kv-cache-shape", "an MLA KV cache is [num_blocks, block_size, "
                             "latent_dim]", cache_shape=tuple(kv_cache.shape),
                             latent_dim=latent_dim)


def write_latent(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                 writer: str = "auto") -> None:
    """``kv_cache[slot // B, slot % B] = latent[t]`` for every ``t < len(slot_mapping)`` with
    ``0 <= slot < num_blocks * B`` (the index layer's writer with one head and no value:
    ``reshape_and_cache`` on ``[T, 1, D]`` / ``[N, B, 1, D]`` views; ``writer`` as
    ``write_kv``'s: "auto" = the Triton kernel for CUDA caches, the torch twin for CPU ones)."""
    from pagedkv.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

    check_mla_cache(kv_cache)
    if latent.dim() != 2 or latent.shape[1] != kv_cache.shape[2]:
        raise InvariantError("mla-latent-shape", "latent must be [T, latent_dim] of the cache",
                             latent_shape=tuple(latent.shape), cache_shape=tuple(kv_cache.shape))
    if writer == "auto":
        fn = reshape_and_cache if kv_cache.is_cuda else reshape_and_cache_ref
    elif writer == "kernel":
        fn = reshape_and_cache
    elif writer == "ref":
        fn = reshape_and_cache_ref
    else:
        raise ConfigError(f"unknown KV writer {writer!r}; use one of auto, kernel, ref")
    fn(latent.unsqueeze(1), None, kv_cache.unsqueeze(2), None, slot_mapping)


class MLAWeights:
    """One layer's up-projection as MLA attention reads it: ``kv_b`` is ``kv_b_proj.weight``
    ``[H * (nope + v), L]`` (per head ``nope`` rows of ``W_UK`` then ``v`` rows of ``W_UV``);
    ``w_uk [H, nope, L]`` and ``w_uv [H, v, L]`` are views of it (no copy: the loader fills
    the parameter in place)."""

    __slots__ = ("kv_b", "num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "kv_lora_rank")

    def __init__(self, kv_b: torch.Tensor, num_heads: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int):
        rank = kv_b.shape[1]
        if tuple(kv_b.shape) != (num_heads * (qk_nope_head_dim + v_head_dim), rank):
            raise ConfigError(f"kv_b_proj weight {tuple(kv_b.shape)} must be [num_heads * "
                              f"(qk_nope_head_dim + v_head_dim), kv_lora_rank] = "
                              f"[{num_heads * (qk_nope_head_dim + v_head_dim)}, L]")
        self.kv_b = kv_b
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = rank

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def _per_head(self) -> torch.Tensor:
        return self.kv_b.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim,
                              self.kv_lora_rank)

    @property
    def w_uk(self) -> torch.Tensor:
        """``[H, qk_nope_head_dim, L]``: ``k_nope_h = w_uk[h] @ c``."""
        return self._per_head()[:, : self.qk_nope_head_dim]

    @property
    def w_uv(self) -> torch.Tensor:
        """``[H, v_head_dim, L]``: ``v_h = w_uv[h] @ c``."""
        return self._per_head()[:, self.qk_nope_head_dim:]


class MLABackend(AttentionBackend):
    """Paged multi-head latent attention (the contract in the module docstring). The runner
    sees an ordinary backend (``plan(metadata, layout)`` per step and KV-cache group, declared
    capabilities); the MLA model calls :meth:`forward` with its latent rows and weights."""

    name = "mla"

    @abstractmethod
    def forward(self, layer_idx: int, q: torch.Tensor, latent: torch.Tensor | None,
                kv_cache: torch.Tensor, plan: AttentionPlan, scale: float,
                weights: MLAWeights) -> torch.Tensor:  # type: ignore[override]
        """Write ``latent`` at the plan's slot mapping, return ``[T, H, v_head_dim]``
        (``TorchRefMLABackend``, ``TritonMLABackend``)."""

    @staticmethod
    def check_shapes(q: torch.Tensor, latent: torch.Tensor | None, kv_cache: torch.Tensor,
                     weights: MLAWeights) -> None:
        check_mla_cache(kv_cache, weights.latent_dim)
        if q.dim() != 3 or q.shape[1] != weights.num_heads or q.shape[2] != weights.qk_head_dim:
            raise InvariantError("mla-query-shape", "q must be [T, H, qk_nope + qk_rope]",
                                 q_shape=tuple(q.shape), num_heads=weights.num_heads,
                                 qk_head_dim=weights.qk_head_dim)
        if latent is not None and (latent.dim() != 2 or latent.shape[1] != weights.latent_dim):
            raise InvariantError("mla-latent-shape", "latent must be [T, kv_lora_rank + "
                                 "qk_rope]", latent_shape=tuple(latent.shape),
                                 latent_dim=weights.latent_dim)


def mla_backend_for(backend: AttentionBackend) -> MLABackend:
    """The MLA counterpart of an engine's attention backend: an :class:`MLABackend` as it is;
    the torch reference -> ``TorchRefMLABackend`` (same KV writer); the Triton backend ->
    ``TritonMLABackend``."""
    if isinstance(backend, MLABackend):
        return backend
    from pagedkv.attention.torch_ref import TorchRefBackend
    from pagedkv.attention.triton_backend import TritonAttentionBackend

    if isinstance(backend, TorchRefBackend):
        from pagedkv.attention.mla_torch_ref import TorchRefMLABackend

        return TorchRefMLABackend(writer=backend.writer)
    if isinstance(backend, TritonAttentionBackend):
        from pagedkv.attention.mla_triton_backend import TritonMLABackend

        return TritonMLABackend()
    raise ConfigError(f"attention backend {type(backend).__name__} has no multi-head latent "
                      "attention variant; use 'torch_ref' or 'triton' (or an MLABackend)")


__all__ = ["MLABackend", "MLAWeights", "allocate_mla_kv_caches", "check_mla_cache",
           "mla_backend_for", "mla_kv_cache_shape", "write_latent"]
