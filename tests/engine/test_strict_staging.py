"""Strict staging mode (``pagedkv.worker.buffers``): a copy out of a staging buffer's host bytes
makes its numpy views read-only until ``wait_for_copy()``, so a writer that would race a
pending non-blocking host -> device copy on a GPU (design rule 7) raises on the CPU at the
write itself.

The engine then runs with async scheduling (step k+1 prepared before step k's output is read)
over chunked prefills beside decodes, prefix-cache hits, preemption and aborts, on one
KV-cache group and on the multi-group paths (full + sliding-window attention, attention +
Mamba state groups, DeepSeek-V4's groups), with strict mode on: nothing may raise.
"""

import os
import sys

import numpy as np
import pytest
import torch
from engine_helpers import TEXTS, churn_prompts, make_llm, run_churn

from pagedkv import SamplingParams
from pagedkv.worker import buffers
from pagedkv.worker.block_table import MultiGroupBlockTable
from pagedkv.worker.buffers import CpuGpuBuffer, StagingArea
from pagedkv.worker.inputs import InputPreparer

READ_ONLY = "read-only"


@pytest.fixture
def strict():
    prev = buffers.set_strict_staging(True)
    yield
    buffers.set_strict_staging(prev)


# ----- the mode itself ----------------------------------------------------------------------

def test_off_by_default_and_no_lock_when_off():
    assert os.environ.get("PAGEDKV_STRICT_STAGING") or not buffers.strict_staging()
    prev = buffers.set_strict_staging(False)
    try:
        b = CpuGpuBuffer(4, 3, dtype=torch.int32, device="cpu")
        b.copy_to_gpu(2)
        b.np[0] = 1  # no lock: production writers pay nothing
        assert not b._locked
    finally:
        buffers.set_strict_staging(prev)


def test_copy_locks_views_until_wait(strict):
    b = CpuGpuBuffer(4, 6, dtype=torch.int32, device="cpu")
    kept = b.host_view((slice(None), slice(2, 4)))  # a view made before the copy
    b.np[:2] = 5
    b.copy_to_gpu(2)
    derived = b.np[1:]  # a view made while the copy is pending inherits the lock
    for arr in (b.np, kept, derived):
        with pytest.raises(ValueError, match=READ_ONLY):
            arr[0] = 1
    with pytest.raises(ValueError, match=READ_ONLY):
        np.add(b.np[:1], 1, out=b.np[:1])  # ufunc outputs too
    b.wait_for_copy()
    b.np[0] = 7
    kept[3] = 9
    assert b.np[0, 0] == 7 and b.np[3, 2] == 9
    assert torch.equal(b.gpu[:2], torch.full((2, 6), 5, dtype=torch.int32))


def test_host_view_needs_a_view(strict):
    from pagedkv.errors import ConfigError

    b = CpuGpuBuffer(4, 6, dtype=torch.int32, device="cpu")
    with pytest.raises(ConfigError, match="basic indexing"):
        b.host_view(([0, 1],))  # fancy indexing copies


def test_staging_area_locks_every_field_until_any_field_waits(strict):
    area = StagingArea([("a", 4, torch.int64), ("b", 3, torch.int32)], device="cpu")
    area["a"].np[:] = 2
    area.copy_to_gpu({"a": 1})  # a CPU device copies through numpy: locked as well
    for name in ("a", "b"):  # the whole area is one buffer: every field waits for it
        with pytest.raises(ValueError, match=READ_ONLY):
            area[name].np[0] = 1
    area["b"].wait_for_copy()
    area["a"].np[0] = 3
    area["b"].np[0] = 4
    area.copy_to_gpu({"b": 1})
    area.wait_for_copy()
    area["a"].np[1] = 5


@pytest.mark.parametrize("groups", [1, 2])
def test_block_table_commit_locks_until_a_writer_waits(strict, groups):
    """The block tables' commit (a CPU device copies through numpy; a group's own commit
    copies its columns) locks the table and every group's column view; the row operations
    wait before they write, so they succeed; a write that skips the wait raises."""
    bt = MultiGroupBlockTable(4, 16, "cpu", False, [16] * groups, [4] * groups)
    bt.append_row([[1, 2]] * groups, 0)
    for commit in (bt.commit_block_table, bt[groups - 1].commit_block_table):
        commit(1)
        with pytest.raises(ValueError, match=READ_ONLY):
            bt[0].block_table.np[0, 0] = 9
        with pytest.raises(ValueError, match=READ_ONLY):
            bt.block_table.np[1, 0] = 9
        bt.append_row([[3]] * groups, 0)  # waits first
        bt.swap_row(0, 1)
        bt.move_row(1, 0)
    assert bt[0].block_table.np[0, :4].tolist() == [1, 2, 3, 3]


def test_input_preparer_without_its_wait_raises(strict, monkeypatch):
    """The detector on a real writer: ``InputPreparer.prepare`` writes the staging area after
    ``wait_for_copy``; with that wait gone its second step raises at the first write."""
    from pagedkv.worker.input_batch import CachedRequestState, InputBatch

    batch = InputBatch(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=16, device="cpu",
                       pin_memory=False, block_sizes=[16], max_num_blocks_per_req=[4])
    batch.add_request(CachedRequestState(req_id="a", prompt_token_ids=list(range(1, 9)),
                                         sampling_params=None, block_ids=([1],),
                                         num_computed_tokens=0, output_token_ids=[]))
    prep = InputPreparer.for_batch(batch)
    prep.prepare(batch, {"a": 4})
    prep.prepare(batch, {"a": 4})  # waited: fine
    monkeypatch.setattr(StagingArea, "wait_for_copy", lambda self: None)
    with pytest.raises(ValueError, match=READ_ONLY):
        prep.prepare(batch, {"a": 4})


# ----- the engine, async scheduling, strict mode --------------------------------------------

def _dsv4_path(tiny_cache, monkeypatch):
    pytest.importorskip("transformers.models.deepseek_v4")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(here, "models"))
    from deepseek_v4_helpers import build_tiny_dsv4, use_twins

    use_twins(monkeypatch)
    return build_tiny_dsv4(tiny_cache)


# family -> (checkpoint options, engine options, expected KV-cache group kinds)
CASES = {
    "qwen3": ("qwen3", {}, dict(num_gpu_blocks_override=9,
                                       max_model_len=96)),
    "gemma2-window": ("gemma2", dict(sliding_window=8, num_layers=4),
                      dict(num_gpu_blocks_override=14, max_model_len=96)),
    "bamba-state": ("bamba", dict(num_layers=3),
                    dict(num_gpu_blocks_override=12, max_model_len=144)),
    "deepseek_v4": (None, None, dict(num_gpu_blocks_override=30, max_model_len=192, max_num_seqs=8,
                                     max_num_batched_tokens=8)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_async_engine_writes_nothing_under_a_pending_copy(tiny_dir, tiny_cache, monkeypatch,
                                                          strict, case):
    family, ckpt, opts = CASES[case]
    path = (_dsv4_path(tiny_cache, monkeypatch) if family is None
            else tiny_dir(family, **ckpt))
    kw = dict(async_scheduling=True, max_num_seqs=4, max_num_batched_tokens=24,
              kv_cache_memory_bytes=None, sanitize=False)
    kw.update(opts)
    llm = make_llm(path, **kw)
    engine = llm.engine
    assert engine.async_scheduling
    groups = llm.scheduler.kv_cache_config.kv_cache_groups
    if case != "qwen3":
        assert len(groups) > 1  # the multi-group paths
    copies = []
    for buf in (llm.runner.input_batch.block_table.block_table, llm.runner.preparer._area._raw):
        orig = buf.note_copy
        buf.note_copy = (lambda orig=orig: (copies.append(1), orig())[1])

    if family is None:
        # DeepSeek-V4's requests hold few blocks once their prompts are in (windows release
        # theirs, compressed blocks are long): eight chunked requests grow into each other
        prompts = [llm.tokenizer.encode(t) for t in TEXTS + TEXTS]
        params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 8
    else:
        # shared leading blocks (prefix-cache hits); unshared long outputs: preemption
        prompts, params = churn_prompts(shared_len=64, n_shared=4, shared_base=70,
                                        unshared_base=80, unshared_len=40)
    stats = run_churn(llm, prompts, params, abort_tokens=12)
    assert len(copies) > 60
    assert stats["preemptions"] > 0, stats
    if case != "deepseek_v4":  # its groups' common block is longer than the shared prefix
        assert stats["prefix_cache_hits"] > 0, stats


# ----- on a GPU: the device held back, so the host runs ahead ------------------------------
#
# Under load (several processes on one GPU) a step's kernels start late and the host prepares
# the next step while they wait: the window in which a writer that skips ``wait_for_copy``
# would change bytes a queued copy has not read yet. Here a sleep kernel queued before every
# step's copies (``torch.cuda._sleep``) opens that window on purpose, every step; strict mode
# is on, so a writer without its wait raises, and one that waits must block (counted: the
# window was open). Tokens must still equal transformers'.

SLEEP_CYCLES = 20_000_000  # ~10 ms at the H200's clock


def _count_blocking_waits(buf: CpuGpuBuffer, counts: dict) -> None:
    """Count the waits that found their copy still queued (the device behind the host)."""
    inner = buf.wait_for_copy

    def wait_for_copy():
        ev = buf._pending
        if ev is not None and not ev.query():
            counts["blocked"] = counts.get("blocked", 0) + 1
        inner()

    buf.wait_for_copy = wait_for_copy


def _delay_each_step(runner) -> None:
    """Queue a sleep kernel on the runner's stream before every step's copies."""
    prepare = runner.preparer.prepare

    def delayed(*args, **kwargs):
        torch.cuda._sleep(SLEEP_CYCLES)
        return prepare(*args, **kwargs)

    runner.preparer.prepare = delayed


@pytest.mark.gpu
@pytest.mark.parametrize("strict_mode", [True, False], ids=["strict", "as-served"])
@pytest.mark.parametrize("family", ["mistral", "llama"])
def test_gpu_host_ahead_of_a_held_back_device_matches_transformers(tiny_dir, family,
                                                                   strict_mode):
    """Also with strict mode off, as the engine serves: strict mode's read-only views made
    ``ModelRunner._to_device`` copy the prefill logits rows, which hid the race that mode
    exists to show (see test_gpu_prefill_logits_rows_with_the_device_behind)."""
    transformers = pytest.importorskip("transformers")
    from pagedkv import LLM

    prev = buffers.set_strict_staging(strict_mode)
    try:
        _host_ahead_matches_transformers(tiny_dir, family, transformers, LLM)
    finally:
        buffers.set_strict_staging(prev)


def _host_ahead_matches_transformers(tiny_dir, family, transformers, LLM) -> None:
    """The held-back device run of the test above and its comparison with transformers."""
    path = tiny_dir(family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    # test_engine_gpu's parity configuration: async scheduling, compiled regions and CUDA
    # graphs by default on CUDA, chunked prefill mixed with decodes
    llm = LLM(path, dtype="float32", device="cuda", max_num_seqs=16, max_num_batched_tokens=32,
              max_model_len=256, num_gpu_blocks_override=256, attention_backend="triton")
    runner = llm.runner
    assert llm.engine.async_scheduling
    counts: dict = {}
    _count_blocking_waits(runner.preparer._area._raw, counts)
    _count_blocking_waits(runner.input_batch.block_table.block_table, counts)
    _delay_each_step(runner)
    n = 12
    outs = llm.generate(TEXTS * 3, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)
    assert counts.get("blocked", 0) > 5, counts  # the host did run ahead of the device
    with torch.no_grad():
        for o in outs:
            ids = torch.tensor([o.prompt_token_ids], device="cuda")
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            assert o.outputs[0].token_ids == want[0, ids.shape[1]:].tolist(), o.prompt


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gpu_prefill_logits_rows_with_the_device_behind(tiny_dir, enforce_eager):
    """A prefill step in which every request samples hands its logits rows (rows of the pinned
    staging area) to a non-blocking copy queued after the forward pass. A sleep kernel queued
    before that copy holds the device back while the host prepares the next step, which
    rewrites those staging rows (strict mode off, as served). Eight prompts (a CUDA-graph size,
    so the graph engine pads nothing either). Before ``ModelRunner._to_device`` copied its
    input, the step projected the next step's rows 0-7: request i's first token was the
    prediction after the first prompt's first i + 1 tokens (the twenty-seventh session's eager
    failure at pages of 64: 199 where transformers says 139). Tokens must equal transformers'."""
    transformers = pytest.importorskip("transformers")
    from pagedkv import LLM

    path = tiny_dir("qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    llm = LLM(path, dtype="float32", device="cuda", max_num_seqs=16, max_num_batched_tokens=512,
              max_model_len=256, num_gpu_blocks_override=256, attention_backend="triton",
              enforce_eager=enforce_eager)
    runner = llm.runner
    assert llm.engine.async_scheduling
    rows = runner._logits_rows

    def held_back(r):
        torch.cuda._sleep(SLEEP_CYCLES)
        return rows(r)

    runner._logits_rows = held_back
    prompts = [[5 + (i * 7 + j) % 300 for j in range(40)] for i in range(8)]
    n = 6
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)
    with torch.no_grad():
        for o in outs:
            ids = torch.tensor([o.prompt_token_ids], device="cuda")
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            assert o.outputs[0].token_ids == want[0, ids.shape[1]:].tolist(), o.prompt_token_ids[:3]
