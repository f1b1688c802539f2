"""DeepSeek-V4 end to end (CPU, fp32, ``sanitize=True`` on every step): ``pagedkv.LLM`` greedy
tokens equal transformers' ``generate`` for batches of prompts of different lengths (longer
than the window and than several compression groups; the real HCA ratio 128 on ~300-token
prompts), chunked prefill on a 16-token budget mixed with decodes, preemption on a small pool,
prefix-cache hits; the runner's groups get the DeepSeek-V4 builders (``metadata_builder_for``),
and every step of a real run is checked channel by channel: compressed groups' slots written
only by the tokens closing a group, at the index layer's slot, the indexer's top-k only
entries its own request has written (``(p + 1) // C`` of them at most), the window lists of
the sliding-window latents and of the compressor states exactly the window's slots of the
token's own blocks. The index layer's kernels run as their twins except in one interpreted
run; GPU tests (fp32 tokens, bf16 teacher-forced) are marked."""

import os
import sys

import pytest
import torch
import transformers
from engine_helpers import TEXTS, check_greedy, greedy, log_scheduled_steps, make_llm

pytest.importorskip("transformers.models.deepseek_v4")  # transformers >= 5.24

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "models"))
from deepseek_v4_helpers import CSA, HCA, SWA, build_tiny_dsv4, use_twins  # noqa: E402

from pagedkv.attention.dsv4 import Dsv4Backend  # noqa: E402
from pagedkv.core.spec import AttentionSpec, SlidingWindowMLASpec  # noqa: E402
from pagedkv.worker.attn_builders import CommonMetadataBuilder  # noqa: E402
from pagedkv.worker.dsv4_builders import (  # noqa: E402
    CompressedMLAMetadataBuilder,
    SlidingWindowMLAMetadataBuilder,
)

VARIANTS = {
    "default": {},  # sliding, CSA 4, HCA 16, CSA; window 8
    "hca-128": dict(num_hidden_layers=3, layer_types=[HCA, SWA, CSA],
                    compress_rates={CSA: 4, HCA: 128}, mlp_layer_types=["moe", "hash_moe", "moe"],
                    sliding_window=16, index_topk=8, hc_mult=2),
    # sliding + CSA only: the groups' block sizes stay small enough (lcm 512) for prefix hits
    "csa-only": dict(num_hidden_layers=2, layer_types=[SWA, CSA], mlp_layer_types=["hash_moe", "moe"],
                     max_position_embeddings=2048),
}
LONG = " ".join(TEXTS[2:] * 3)  # ~290 tokens


@pytest.fixture
def twins(monkeypatch):
    use_twins(monkeypatch)


@pytest.fixture(scope="module")
def dsv4_dir(tiny_cache):
    return lambda name: build_tiny_dsv4(tiny_cache, **VARIANTS[name])


@pytest.mark.parametrize("name", ["default", "hca-128"])
def test_batched_greedy_matches_transformers(dsv4_dir, hf_ref, twins, name):
    path = dsv4_dir(name)
    prompts = TEXTS if name == "default" else [LONG, TEXTS[3], TEXTS[0]]
    llm = make_llm(path, max_model_len=512)
    assert isinstance(llm.engine.model.attn_backend, Dsv4Backend)
    outs = check_greedy(llm, hf_ref(path), prompts, 10)
    lens = [len(o.prompt_token_ids) for o in outs]
    x = llm.engine.model.config.dsv4
    assert max(lens) > 2 * max(x.compress_ratios) and max(lens) > 4 * x.sliding_window


def test_runner_groups_get_the_dsv4_builders(dsv4_dir, tiny_dir):
    """The runner asks the backend for each group's builder (``metadata_builder_for``): the
    compressed groups the compressed builder, the sliding-window latents (windows and states)
    the window-list builder; a backend without per-spec builders keeps the common one."""
    llm = make_llm(dsv4_dir("default"))
    runner = llm.engine.runner
    groups = runner.kv_cache_config.kv_cache_groups
    kinds = set()
    for g, ags in zip(groups, runner.attn_groups):
        spec, cls = g.kv_cache_spec, ags[0].builder_cls
        if isinstance(spec, AttentionSpec) and spec.compress_ratio > 1:
            assert cls is CompressedMLAMetadataBuilder
            kinds.add(("compressed", spec.compress_ratio))
        else:
            assert isinstance(spec, SlidingWindowMLASpec) and cls is SlidingWindowMLAMetadataBuilder
            kinds.add(("window", spec.sliding_window))
    assert kinds == {("compressed", 4), ("compressed", 16), ("window", 8), ("window", 16)}
    from pagedkv.attention.torch_ref import TorchRefBackend

    assert TorchRefBackend().metadata_builder_for(groups[0].kv_cache_spec) is None
    other = make_llm(tiny_dir("llama"))
    assert all(ags[0].builder_cls is CommonMetadataBuilder for ags in other.engine.runner.attn_groups)


def test_chunked_prefill_and_preemption(dsv4_dir, hf_ref, twins):
    """A 16-token budget (prompts split across steps and compression groups, decodes in the
    same steps), then a pool small enough to preempt."""
    path = dsv4_dir("default")
    ref = hf_ref(path)
    llm = make_llm(path, max_num_batched_tokens=16, max_num_seqs=4)
    steps = log_scheduled_steps(llm.scheduler)
    check_greedy(llm, ref, [TEXTS[3], TEXTS[2], TEXTS[1], TEXTS[0]], 10)
    assert all(sum(s.values()) <= 16 for s in steps)
    assert any(1 in s.values() and max(s.values()) > 1 for s in steps)
    # a DeepSeek-V4 request holds few blocks once its prompt is in (windows release theirs,
    # compressed blocks are long): 8 requests chunked on an 8-token budget over 30 blocks
    # grow into each other
    small = make_llm(path, num_gpu_blocks_override=30, max_model_len=192, kv_cache_memory_bytes=None,
                     max_num_batched_tokens=8)
    outs = check_greedy(small, ref, TEXTS + TEXTS, 40)
    stats = small.get_kv_stats()
    assert stats["preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats["preemptions"]


def test_prefix_hits(dsv4_dir, hf_ref, twins):
    """Two prompts sharing more than one scheduler block (the lcm of the groups' blocks):
    the second resumes from the cached compressed entries, indexer keys, states and window."""
    path = dsv4_dir("csa-only")
    llm = make_llm(path, max_model_len=1024, max_num_batched_tokens=256,
                   kv_cache_memory_bytes=8 << 20)
    unit = llm.scheduler.kv_cache_manager.block_size
    assert unit <= 512
    shared = " ".join(TEXTS * 4)
    ref = hf_ref(path)
    check_greedy(llm, ref, [shared + " First ending."], 10)
    before = llm.get_kv_stats()["prefix_cache_hits"]
    check_greedy(llm, ref, [shared + " And another, different ending!"], 10)
    assert llm.get_kv_stats()["prefix_cache_hits"] - before >= unit


class ChannelChecks:
    """Wraps a runner's ``attention_for`` and the model's ``topk_hook`` and checks every step
    (see the module docstring). Counts what it checked."""

    def __init__(self, llm):
        self.runner = runner = llm.engine.runner
        self.model = model = llm.engine.model
        self.counts = dict(closing=0, topk=0, window=0)
        self.writers: dict = {}  # (group, slot) -> (request id, entry)
        self._step = None
        inner = runner.attention_for

        def attention_for(step, *args, **kw):
            attn = inner(step, *args, **kw)
            self.check_step(step, attn)
            return attn

        runner.attention_for = attention_for
        model.topk_hook = self.check_topk
        names = runner.layer_names
        self.group_of = {n: gid for gid, g in enumerate(runner.kv_cache_config.kv_cache_groups)
                         for n in g.layer_names}
        self.comp_group = {i: self.group_of[f"model.layers.{i}.self_attn.compressor"]
                           for i, layer in enumerate(model.layers) if layer.self_attn.csa}
        self.names = names

    def check_step(self, step, attn):
        runner = self.runner
        n = runner.input_batch.num_reqs
        rows = list(runner.input_batch.req_ids[:n])
        t = int(attn.metadata.num_actual_tokens)
        qsl = attn.metadata.query_start_loc_cpu[: n + 1].tolist()
        pos = step.positions[:t].cpu().tolist()
        req_of = [r for r in range(n) for _ in range(qsl[r], qsl[r + 1])]
        self._step = (rows, pos, req_of, attn)
        for gid, g in enumerate(runner.kv_cache_config.kv_cache_groups):
            spec = g.kv_cache_spec
            md = attn.plans[self.names.index(g.layer_names[0])].metadata
            table = md.block_table.cpu()
            if isinstance(spec, AttentionSpec) and spec.compress_ratio > 1:
                c, s = spec.compress_ratio, spec.storage_block_size
                slots = md.compressed_slot_mapping.cpu().tolist()
                for k, (p, r) in enumerate(zip(pos, req_of)):
                    if (p + 1) % c:
                        assert slots[k] == -1, (gid, p)
                        continue
                    e = p // c
                    assert slots[k] == int(table[r, e // s]) * s + e % s and slots[k] >= s
                    self.writers[(gid, slots[k])] = (rows[r], e)
                    self.counts["closing"] += 1
            else:
                w, b = spec.sliding_window, spec.block_size
                idx, lens = md.swa_indices.cpu(), md.swa_lens.cpu().tolist()
                for k, (p, r) in enumerate(zip(pos, req_of)):
                    want = [int(table[r, j // b]) * b + j % b for j in range(max(0, p - w + 1), p + 1)]
                    assert lens[k] == len(want) == min(w, p + 1)
                    assert idx[k, : lens[k]].tolist() == want and (idx[k, lens[k]:] == -1).all()
                    assert all(x >= b for x in want)  # never the null block
                    self.counts["window"] += 1

    def check_topk(self, layer, topk):
        rows, pos, req_of, attn = self._step
        gid = self.comp_group[layer]
        md = attn.plans[self.names.index(f"model.layers.{layer}.self_attn.compressor")].metadata
        table, s = md.block_table.cpu(), md.storage_block_size
        topk_k = self.model.layers[layer].self_attn.indexer.topk
        c = md.compress_ratio
        for k, (p, r) in enumerate(zip(pos, req_of)):
            picks = [v for v in topk[k].tolist() if v >= 0]
            cached = (p + 1) // c
            assert len(picks) == len(set(picks)) == min(topk_k, cached)
            for e in picks:
                assert e < cached
                slot = int(table[r, e // s]) * s + e % s
                assert self.writers[(gid, slot)] == (rows[r], e)  # its own request's entry
                self.counts["topk"] += 1


def test_step_checks_of_every_channel(dsv4_dir, hf_ref, twins):
    path = dsv4_dir("default")
    llm = make_llm(path, max_num_batched_tokens=24, max_num_seqs=4, num_gpu_blocks_override=120,
                   kv_cache_memory_bytes=None, max_model_len=192)
    checks = ChannelChecks(llm)
    check_greedy(llm, hf_ref(path), TEXTS + [TEXTS[3]], 16)
    assert min(checks.counts.values()) > 100, checks.counts


def test_interpreted_kernels_in_the_engine(dsv4_dir, hf_ref):
    """The index layer's kernels and the indexer scores through the Triton interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels on CPU tensors need the Triton interpreter")
    path = dsv4_dir("default")
    llm = make_llm(path, attention_backend=Dsv4Backend("kernel", writer="kernel"))
    check_greedy(llm, hf_ref(path), [TEXTS[1], TEXTS[0]], 3)


@pytest.mark.gpu
@pytest.mark.skipif(
    tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24),
    reason="transformers < 5.24: its DeepSeek-V4 fails in bf16 inside its own forward (H200, 5.17)")
@pytest.mark.parametrize("name", ["default", "hca-128"])
def test_gpu_engine_matches_transformers(dsv4_dir, hf_ref, name):
    """On the GPU: fp32 tokens equal transformers' on the CPU (Triton index kernels, KV
    writer, indexer scores, fused-MoE kernel); bf16 tokens teacher-forced under transformers'
    bf16 model."""
    from engine_helpers import teacher_forced_agreement

    import transformers

    path = dsv4_dir(name)
    prompts = TEXTS + [LONG]
    llm = make_llm(path, device="cuda", attention_backend="triton", max_model_len=512,
                   max_num_batched_tokens=64)
    check_greedy(llm, hf_ref(path), prompts, 16)
    llm = make_llm(path, device="cuda", dtype="bfloat16", attention_backend="triton",
                   max_model_len=512, sanitize=False)
    outs = llm.generate(prompts, greedy(16), use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    exact, total, worst = teacher_forced_agreement(hf, [o.prompt_token_ids for o in outs], outs)
    assert exact >= 0.9 * total and worst < 1.0, (exact, total, worst)
