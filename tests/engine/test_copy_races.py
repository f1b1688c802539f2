"""Design rule 7 on the CPU: no pinned staging bytes are written while a copy out of them may
still be pending. On a GPU ``copy_to_gpu`` is a non-blocking copy that runs when the stream
reaches it (with async scheduling, after the previous step's kernels), so a writer that
changes the host bytes before ``wait_for_copy()`` races the copy: the device may read the next
step's values. Such a race shows only under some timings (a loaded host or device), and only
on a GPU.

The detector here makes it visible on the CPU: every host -> device copy of a
``CpuGpuBuffer`` or ``StagingArea`` keeps a snapshot of the bytes it copied until the buffer's
``wait_for_copy()``; before each later copy and after every engine step, any snapshot that no
longer matches its bytes is a write that did not wait, i.e. a race on the GPU. The tensors the
runner's ``_to_device`` returns (small host arrays sent by their own non-blocking copies) are
watched as well: each must keep the values of its call. The engine then
runs a workload with every staging path busy (async scheduling, chunked prefills beside
decodes, prefix-cache hits, preemption, aborts, a request finishing while others run)."""

import pytest
import torch
from engine_helpers import churn_prompts, make_llm, run_churn

from pagedkv import SamplingParams
from pagedkv.worker.block_table import MultiGroupBlockTable
from pagedkv.worker.buffers import CpuGpuBuffer, StagingArea


class RaceDetector:
    """Snapshots of copied host bytes until their buffer waits (see the module docstring)."""

    def __init__(self, monkeypatch):
        self.pending: dict[int, tuple[CpuGpuBuffer, torch.Tensor, torch.Tensor, str]] = {}
        self.violations: list[str] = []
        self.copies = 0
        self.rows: list = []  # [tensor, its values at the call, checks so far] (watch_device_rows)
        self.rows_made = 0
        self._monkeypatch = monkeypatch
        det = self
        orig_copy = CpuGpuBuffer.copy_to_gpu
        orig_wait = CpuGpuBuffer.wait_for_copy
        orig_area_copy = StagingArea.copy_to_gpu

        def copy_to_gpu(buf, n=None, columns=None):
            det.check("before a copy")
            src = buf.cpu if n is None else buf.cpu[:n]
            if columns is not None:
                src = src[:, columns]
            det.track(buf, src)
            return orig_copy(buf, n, columns)

        def wait_for_copy(buf):
            det.pending.pop(id(buf), None)
            return orig_wait(buf)

        def area_copy(area, used):
            det.check("before a copy")
            end = 0
            for name, n in used.items():
                off, length, size = area._layout[name]
                end = max(end, off + n * size)
            if end:
                det.track(area._raw, area._raw.cpu[:end])
            return orig_area_copy(area, used)

        orig_commit = MultiGroupBlockTable.commit_block_table

        def commit_block_table(table, num_reqs):
            # the block tables' commit (a CPU device copies through numpy views instead of
            # copy_to_gpu: the same bytes, tracked here)
            if table._device_table_np is not None:
                det.check("before a copy")
                det.track(table.block_table, table.block_table.cpu[:num_reqs])
            return orig_commit(table, num_reqs)

        monkeypatch.setattr(MultiGroupBlockTable, "commit_block_table", commit_block_table)
        monkeypatch.setattr(CpuGpuBuffer, "copy_to_gpu", copy_to_gpu)
        monkeypatch.setattr(CpuGpuBuffer, "wait_for_copy", wait_for_copy)
        monkeypatch.setattr(StagingArea, "copy_to_gpu", area_copy)

    def watch_device_rows(self) -> None:
        """Also watch ``ModelRunner._to_device`` (small host arrays on the device: a
        non-blocking copy on CUDA, see the last test) of the engines built after this call
        (their pieces keep the bound method): every tensor it returns must keep the values of
        its call; :meth:`check_rows` compares them (each over its next three checks)."""
        from pagedkv.worker.model_runner import ModelRunner

        inner = ModelRunner._to_device
        det = self

        def to_device(runner, values):
            t = inner(runner, values)
            det.rows.append([t, t.clone(), 0])
            det.rows_made += 1
            return t

        self._monkeypatch.setattr(ModelRunner, "_to_device", to_device)

    def check_rows(self, when: str) -> None:
        for entry in self.rows:
            now, then, _ = entry
            if not torch.equal(now, then):
                self.violations.append(f"{when}: a device row tensor of ModelRunner._to_device "
                                       f"changed after its call: {then.tolist()[:8]} -> "
                                       f"{now.tolist()[:8]}")
            entry[2] += 1
        self.rows = [e for e in self.rows if e[2] < 3]

    def track(self, buf, src: torch.Tensor) -> None:
        import traceback

        self.copies += 1
        where = "".join(traceback.format_stack(limit=6)[:-2])
        # a later copy of the same buffer replaces the snapshot (it waits for nothing on the
        # GPU either: two copies of one buffer are stream-ordered, the writes between them
        # are what check() looks at)
        self.pending[id(buf)] = (buf, src, src.clone(), where)

    def check(self, when: str) -> None:
        for key, (buf, src, snap, where) in list(self.pending.items()):
            if not torch.equal(src, snap):
                self.violations.append(
                    f"{when}: host bytes of a {type(buf).__name__} {tuple(buf.cpu.shape)} changed "
                    f"after its copy, without wait_for_copy(); the copy was made at\n{where}")
                del self.pending[key]


def test_detector_flags_a_write_without_wait(monkeypatch):
    """By hand: a write after a copy is flagged unless the writer waited first; a second
    copy's snapshot replaces the first."""
    det = RaceDetector(monkeypatch)
    b = CpuGpuBuffer(4, 3, dtype=torch.int32, device="cpu")
    b.np[:2] = 5
    b.copy_to_gpu(2)
    b.wait_for_copy()
    b.np[0] = 7  # waited: fine
    b.copy_to_gpu(2)
    b.np[3] = 9  # outside the copied rows: fine
    det.check("by hand")
    assert det.violations == []
    b.np[1, 2] = 8  # inside the copied rows, no wait: the race
    det.check("by hand")
    assert len(det.violations) == 1 and "CpuGpuBuffer (4, 3)" in det.violations[0]
    area = StagingArea([("a", 4, torch.int64), ("b", 2, torch.int32)], device="cpu")
    area["b"].np[:] = 1
    area.copy_to_gpu({"a": 0, "b": 2})
    area["a"].np[0] = 3  # within the copied span (field a's rows precede b's)
    det.check("by hand")
    assert len(det.violations) == 2
    area.copy_to_gpu({"b": 2})
    area["b"].wait_for_copy()  # a field waits for its area's copy
    area["b"].np[1] = 4
    det.check("by hand")
    assert len(det.violations) == 2


@pytest.mark.parametrize("backend", ["torch_ref", "triton"])
def test_engine_writes_no_staging_bytes_under_a_pending_copy(tiny_dir, monkeypatch, backend):
    """~150 async-scheduled steps (the Triton backend adds its decode order and cascade
    staging): every host -> device copy's bytes unchanged until their buffer waited. (With
    the input preparer's wait removed, this test fails on its first later copy.)"""
    det = RaceDetector(monkeypatch)
    det.watch_device_rows()
    path = tiny_dir("qwen3")
    # a small pool (8 usable blocks of 16 for 4 running requests of up to ~80 tokens):
    # preemption; 24 tokens a step: chunked prefills beside decodes
    llm = make_llm(path, async_scheduling=True, max_num_seqs=4, max_num_batched_tokens=24,
                   max_model_len=96, num_gpu_blocks_override=9, kv_cache_memory_bytes=None,
                   attention_backend=backend, sanitize=False)
    engine = llm.engine
    inner = engine.step

    steps = []

    def step(*a, **kw):
        out = inner(*a, **kw)
        det.check("after a step")
        det.check_rows("after a step")
        steps.append(1)
        return out

    monkeypatch.setattr(engine, "step", step)
    # two full blocks shared (prefix-cache hits); unshared long outputs: the pool runs out
    prompts, params = churn_prompts(shared_len=32, n_shared=6, shared_base=40, unshared_base=60,
                                    unshared_len=60)
    stats = run_churn(llm, prompts, params, abort_tokens=20)
    assert det.copies > 80 and stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert det.rows_made > 20, det.rows_made
    assert det.violations == [], "\n\n".join(det.violations[:3])


@pytest.mark.parametrize("strict_staging", [False, True])
def test_runner_device_rows_keep_the_values_of_their_call(tiny_dir, monkeypatch, strict_staging):
    """The runner's small host arrays on the device (``ModelRunner._to_device``: a prefill
    step's logits rows, pending-token and penalty rows) leave by a non-blocking copy on CUDA,
    which reads its bytes when the device reaches it. So each tensor it returns must keep the
    values of its call after the host has written the next steps' staging rows.

    It did not: a prefill step in which every request samples passed its logits rows as
    ``preparer.logits_indices.np`` (the pinned staging area), and ``pin_memory()`` of memory
    already pinned returns the same memory: with async scheduling and a device behind the
    host, the step projected the next step's rows (the hidden rows of the first request's
    first tokens). On the CPU the returned tensor aliased the staging bytes the same way,
    which this test sees after the later steps. Strict staging (read-only views until the
    copy is waited for) had hidden it: a read-only array was copied."""
    from pagedkv.worker import buffers

    prev = buffers.set_strict_staging(strict_staging)
    det = RaceDetector(monkeypatch)
    det.watch_device_rows()
    try:
        llm = make_llm(tiny_dir("qwen3"), async_scheduling=True, max_num_batched_tokens=512,
                       attention_backend="triton", sanitize=False)
        # six prompts of 40 tokens: one prefill step in which every request samples (its logits
        # rows 39, 79, ..., 239), then decode steps whose preparation rewrites those rows
        prompts = [[5 + (i * 7 + j) % 300 for j in range(40)] for i in range(6)]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                            use_tqdm=False)
    finally:
        buffers.set_strict_staging(prev)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    calls = [then.tolist() for _, then, _ in det.rows]
    assert [39, 79, 119, 159, 199, 239] in calls
    det.check_rows("after the later steps")
    assert det.violations == [], det.violations[:3]
