"""Tiny random DeepSeek-V4 checkpoints and a step driver over the model's own channels.

Checkpoints are written by transformers' own ``DeepseekV4ForCausalLM`` (``save_pretrained``,
``checkpoint_helpers.build_hf_checkpoint``: the tiny llama checkpoint's tokenizer). Weights
come from one seeded generator in parameter-name order: matrices ~ N(0, 0.1), norm weights and
mHC scales 1 + N(0, 0.1), mHC bases ~ N(0, 0.1), sinks ~ N(0, 1), compressor position biases ~
N(0, 0.5) (so the gates matter), routers ~ N(0, 0.5); buffers: ``e_score_correction_bias`` ~
N(0, 0.05), hash tables ``tid2eid`` k distinct experts per token. The default layout
(:data:`DSV4_TINY`): 4 layers (sliding, CSA ratio 4, HCA ratio 16, CSA), window 8, 16 indexer
heads (ties of zero scores stay improbable) with top-4, two hash layers then two top-k ones,
a SwiGLU limit of 0.5 so the clamps act.

:class:`Dsv4Driver` runs steps of the model without the engine: each distinct cache spec is one
group with its own block table, blocks drawn from one shuffled pool (never block 0, reused
after a request finishes), the caches NaN-poisoned, the metadata of each group built by the
backend's DeepSeek-V4 builders, as the runner does.
"""

from __future__ import annotations

import random

import torch
from checkpoint_helpers import build_hf_checkpoint

from pagedkv.attention.backend import StepAttention
from pagedkv.worker.metadata import CommonAttentionMetadata

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
DSV4_TINY = dict(
    vocab_size=320, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, head_dim=32, q_lora_rank=16, partial_rotary_factor=0.25,
    num_experts_per_tok=2, n_routed_experts=8, layer_types=[SWA, CSA, HCA, CSA],
    compress_rates={CSA: 4, HCA: 16}, hc_mult=4, sliding_window=8, o_groups=2, o_lora_rank=16,
    index_n_heads=16, index_head_dim=16, index_topk=4,
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], swiglu_limit=0.5,
    max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, tie_word_embeddings=False)


def _fill(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed * 1000 + 977)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "sinks":
                vals = torch.randn(p.shape, generator=gen)
            elif leaf == "position_bias":
                vals = 0.5 * torch.randn(p.shape, generator=gen)
            elif name.endswith("mlp.gate.weight"):
                vals = 0.5 * torch.randn(p.shape, generator=gen)
            elif leaf in ("base", "hc_base"):
                vals = 0.1 * torch.randn(p.shape, generator=gen)
            elif p.dim() >= 2:
                vals = 0.1 * torch.randn(p.shape, generator=gen)
            else:  # norm weights, mHC scales
                vals = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(vals.to(p.dtype))
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                e = gate.weight.shape[0]
                r = torch.rand(gate.tid2eid.shape[0], e, generator=gen)
                gate.tid2eid.copy_(r.argsort(dim=-1)[:, : gate.tid2eid.shape[1]])
            else:
                gate.e_score_correction_bias.copy_(
                    0.05 * torch.randn(gate.e_score_correction_bias.shape, generator=gen))


def build_tiny_dsv4(cache_dir: str, *, seed: int = 0, dtype: str = "float32",
                    save_original_format: bool = True, **config) -> str:
    """Path of the tiny DeepSeek-V4 checkpoint with ``DeepseekV4Config`` keys ``config`` over
    :data:`DSV4_TINY` (``save_original_format=False``: transformers' module names)."""
    return build_hf_checkpoint(cache_dir, "dsv4", "DeepseekV4ForCausalLM",
                               {**DSV4_TINY, **config}, _fill, seed=seed, dtype=dtype,
                               save_original_format=save_original_format)


class Dsv4Driver:
    """Steps of a DeepSeek-V4 model over its own caches (see the module docstring)."""

    def __init__(self, model, *, block_size: int = 16, num_blocks: int = 512, width: int = 40,
                 seed: int = 0, poison: bool = True):
        self.model, self.block_size, self.width = model, block_size, width
        self.specs = model.kv_cache_specs(block_size)
        self.group_specs = list(dict.fromkeys(self.specs.values()))
        self.group_of = [self.group_specs.index(s) for s in self.specs.values()]
        self.caches = model.allocate_kv_caches(num_blocks, block_size,
                                               fill=float("nan") if poison else 0.0)
        free = list(range(1, num_blocks))
        random.Random(seed).shuffle(free)
        self.free = free
        self.reqs: dict[int, dict] = {}
        self._next = 0
        self.last_step: dict = {}  # the last step's StepAttention and inputs (tests look)

    def add(self, tokens) -> int:
        rid = self._next
        self._next += 1
        self.reqs[rid] = dict(tokens=list(tokens), computed=0,
                              blocks=[[] for _ in self.group_specs])
        return rid

    def finish(self, rid: int) -> None:
        for blocks in self.reqs.pop(rid)["blocks"]:
            self.free.extend(reversed(blocks))

    @torch.no_grad()
    def step(self, schedule) -> torch.Tensor:
        """Run ``[(rid, n)]`` (n new tokens each) as one batch; returns the hidden rows."""
        model, dev = self.model, self.model.device
        ids, pos, qlens, slens = [], [], [], []
        for rid, n in schedule:
            r = self.reqs[rid]
            assert 0 < n and r["computed"] + n <= len(r["tokens"])
            ids += r["tokens"][r["computed"]: r["computed"] + n]
            pos += range(r["computed"], r["computed"] + n)
            qlens.append(n)
            slens.append(r["computed"] + n)
            for g, spec in enumerate(self.group_specs):
                need = -(-slens[-1] // spec.block_size)
                while len(r["blocks"][g]) < need:
                    r["blocks"][g].append(self.free.pop())
        positions = torch.tensor(pos, dtype=torch.int64)
        qsl = torch.zeros(len(schedule) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
        sl = torch.tensor(slens, dtype=torch.int32)
        req_of = torch.repeat_interleave(torch.arange(len(schedule)), torch.tensor(qlens))
        backend = model.attn_backend
        plans_g, common0 = [], None
        for g, spec in enumerate(self.group_specs):
            rows = [self.reqs[rid]["blocks"][g] for rid, _ in schedule]
            table = torch.tensor([b + [0] * (self.width - len(b)) for b in rows], dtype=torch.int32)
            blk = table[req_of, positions // spec.block_size].to(torch.int64)
            slots = blk * spec.block_size + positions % spec.block_size
            common = CommonAttentionMetadata(
                query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=sl.to(dev),
                seq_lens_cpu=sl, num_reqs=len(schedule), num_actual_tokens=len(pos),
                max_query_len=max(qlens), max_seq_len=max(slens),
                block_table_tensor=table.to(dev), slot_mapping=slots.to(dev),
                positions=positions.to(dev))
            common0 = common0 or common
            builder = backend.metadata_builder_for(spec)(spec, (), dev, len(schedule), self.width)
            plans_g.append(backend.plan(builder.build(common), model.attention_layout(spec)))
        attn = StepAttention(common0, [plans_g[g] for g in self.group_of])
        hidden = model(torch.tensor(ids, device=dev), positions.to(dev), self.caches, attn)
        self.last_step = dict(attn=attn, positions=positions, schedule=list(schedule))
        for rid, n in schedule:
            self.reqs[rid]["computed"] += n
        return hidden

    def prompt_logits(self, prompt, chunk: int | None = None) -> torch.Tensor:
        """Logits of every prompt position, the prompt in chunks of ``chunk`` tokens."""
        rid = self.add(prompt)
        chunk = chunk or len(prompt)
        out = []
        for s in range(0, len(prompt), chunk):
            n = min(chunk, len(prompt) - s)
            out.append(self.model.compute_logits(self.step([(rid, n)])))
        self.finish(rid)
        return torch.cat(out)

    def greedy(self, prompts, n: int, chunk: int | None = None) -> list[list[int]]:
        """Batched greedy decoding: each step schedules every unfinished request (a prompt
        chunk of at most ``chunk`` tokens, or its one new token)."""
        rids = [self.add(p) for p in prompts]
        lens = {rid: len(p) for rid, p in zip(rids, prompts)}
        done: dict[int, list[int]] = {}
        while len(done) < len(rids):
            sched = []
            for rid in rids:
                if rid in done:
                    continue
                r = self.reqs[rid]
                left = len(r["tokens"]) - r["computed"]
                sched.append((rid, min(left, chunk or left)))
            hidden = self.step(sched)
            ends = torch.cumsum(torch.tensor([k for _, k in sched]), 0) - 1
            logits = self.model.compute_logits(hidden, ends)
            for (rid, _), lg in zip(sched, logits):
                r = self.reqs[rid]
                if r["computed"] < len(r["tokens"]):
                    continue  # a prompt chunk: nothing sampled yet
                r["tokens"].append(int(lg.argmax()))
                if len(r["tokens"]) - lens[rid] == n:
                    done[rid] = r["tokens"][lens[rid]:]
                    self.finish(rid)
        return [done[r] for r in rids]


def use_twins(monkeypatch) -> None:
    """The index layer's kernels DeepSeek-V4 runs every step (the runner's slot mappings of
    all its groups, window slot lists, compressed slot mapping, top-k -> slot translation) as
    their torch twins: the kernels equal the twins (their own tests run both through the
    interpreter), and the whole-model and engine tests then run in seconds."""
    from pagedkv.kernels import compressed_slot_mapping, slot_mapping, sparse_index, swa_indices

    for mod in (compressed_slot_mapping, slot_mapping, sparse_index, swa_indices):
        monkeypatch.setattr(mod, "use_triton", lambda *args: False)
