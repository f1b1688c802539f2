"""Helpers of the MLA attention tests: random mixed batches over a NaN-poisoned latent cache
with shuffled blocks, and a dense float64 MLA reference built from the same weights."""

import random

import torch

from pagedkv.attention.metadata import build_attention_metadata
from pagedkv.attention.mla import MLAWeights, allocate_mla_kv_caches, write_latent

H, L, R, NOPE, V = 4, 32, 8, 16, 12
D = L + R


def dense_mla(q, c, k_pe, kv_b, scale, nope=NOPE):
    """float64 causal attention of one request: ``q [q_len, H, nope + R]`` (the last q_len
    positions), ``c [S, L]``, ``k_pe [S, R]``; keys ``[W_UK c | k_pe]``, values ``W_UV c``."""
    q, c, k_pe, kv_b = (t.double() for t in (q, c, k_pe, kv_b))
    s, q_len, heads, rope = c.shape[0], q.shape[0], q.shape[1], k_pe.shape[1]
    kv = (c @ kv_b.T).view(s, heads, -1)
    k = torch.cat([kv[..., :nope], k_pe[:, None].expand(s, heads, rope)], dim=-1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(s - q_len, s, device=q.device)
    future = torch.arange(s, device=q.device)[None, :] > q_pos[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hqk,khv->qhv", torch.softmax(scores, dim=-1), kv[..., nope:])


class Batch:
    """Requests ``(cached context, new tokens)``: context latents written beforehand, new
    latents passed to the backend; each request owns shuffled blocks (never block 0).
    ``dims``: ``(heads, kv_lora_rank, qk_rope, qk_nope, v_head_dim)``; tensors on ``device``
    (random values drawn on the CPU)."""

    def __init__(self, reqs, block_size, dtype=torch.float32, pad=0, seed=0,
                 dims=(H, L, R, NOPE, V), device="cpu"):
        heads, rank, rope, nope, vdim = dims
        width_d = rank + rope
        self.dims, self.nope, self.rank = dims, nope, rank
        gen = torch.Generator().manual_seed(seed)
        self.reqs, self.block_size, self.dtype = reqs, block_size, dtype
        lens = [c + n for c, n in reqs]
        width = max(-(-s // block_size) for s in lens) + 1
        num_blocks = sum(-(-s // block_size) for s in lens) + 3
        free = list(range(1, num_blocks))
        random.Random(seed).shuffle(free)
        table = torch.zeros(len(reqs), width, dtype=torch.int32)
        for r, s in enumerate(lens):
            for j in range(-(-s // block_size)):
                table[r, j] = free.pop()
        self.unused = free
        (self.cache,) = allocate_mla_kv_caches(1, num_blocks, block_size, width_d, dtype=dtype,
                                               device=device, fill=float("nan"))
        self.kv_b = torch.randn(heads * (nope + vdim), rank, generator=gen) * (3.0 / rank ** 0.5)
        self.weights = MLAWeights(self.kv_b.to(device=device, dtype=dtype), heads, nope, rope, vdim)
        self.c = [torch.randn(s, rank, generator=gen) for s in lens]
        self.k_pe = [torch.randn(s, rope, generator=gen) for s in lens]
        self.q = [torch.randn(n, heads, nope + rope, generator=gen) for _, n in reqs]
        self.scale = (nope + rope) ** -0.5
        ctx_slots, ctx_lat, new_slots, new_lat = [], [], [], []
        for r, ((ctx, n), s) in enumerate(zip(reqs, lens)):
            lat = torch.cat([self.c[r], self.k_pe[r]], dim=-1)
            for p in range(s):
                slot = int(table[r, p // block_size]) * block_size + p % block_size
                (ctx_slots if p < ctx else new_slots).append(slot)
                (ctx_lat if p < ctx else new_lat).append(lat[p])
        if ctx_slots:
            write_latent(torch.stack(ctx_lat).to(device=device, dtype=dtype), self.cache,
                         torch.tensor(ctx_slots, device=device), writer="ref")
        self.new_latent = torch.stack(new_lat + [torch.full((width_d,), 7.0)] * pad).to(
            device=device, dtype=dtype)
        self.slots = torch.tensor(new_slots + [-1] * pad, dtype=torch.int64, device=device)
        self.q_all = torch.cat(self.q + [torch.full((pad, heads, nope + rope), 3.0)]).to(
            device=device, dtype=dtype)
        self.metadata = build_attention_metadata([n for _, n in reqs], lens, table.to(device),
                                                 self.slots, device=device)
        self.lens = lens

    def expected(self) -> torch.Tensor:
        """float64 on the CPU, the requests' rows (no padding)."""
        return torch.cat([dense_mla(self.q[r].to(self.dtype), self.c[r].to(self.dtype),
                                    self.k_pe[r].to(self.dtype), self.kv_b.to(self.dtype),
                                    self.scale, self.nope)
                          for r in range(len(self.reqs)) if self.reqs[r][1]])


MIXED = [(0, 5), (20, 1), (0, 1), (37, 9), (15, 17), (3, 1), (33, 1)]
