"""cuDNN's paged attention path (``pagedkv.attention.cudnn_paged``): the declared shapes and the
per-step inputs by hand on the CPU, the backend's option and its fallback where the path is
unavailable; natively (GPU, with the ``nvidia-cudnn-frontend`` package) the launch against the
torch reference on NaN-poisoned caches, eager and replayed in a CUDA graph."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.attention.cudnn_paged import (
    CudnnPagedGraph,
    cudnn_paged_available,
    cudnn_paged_block_size_ok,
    cudnn_paged_inputs,
    declared_shape,
    frontend,
)
from pagedkv.attention.torch_ref import paged_attention_ref
from pagedkv.attention.triton_backend import TritonAttentionBackend
from pagedkv.errors import ConfigError


def test_declared_shape_by_hand():
    assert declared_shape(1, 5) == (8, 1024)
    assert declared_shape(8, 1024) == (8, 1024)
    assert declared_shape(9, 1025) == (16, 2048)
    assert declared_shape(200, 16384) == (256, 16384)
    assert declared_shape(256, 9000) == (256, 16384)


def test_inputs_by_hand():
    """Four requests: a decode (1 token), a 3-token chunk after 4 cached, an empty one, a
    5-token fresh prefill; declared for 8: only requests 1 and 3 get lengths, offsets are the
    rows times the token stride, padding starts at the end, table rows past 4 are zero."""
    qsl = torch.tensor([0, 1, 4, 4, 9], dtype=torch.int32)
    seq = torch.tensor([10, 7, 0, 5], dtype=torch.int32)
    table = torch.arange(12, dtype=torch.int32).view(4, 3) + 1
    got = cudnn_paged_inputs(qsl, seq, table, 4, 8, q_token_stride=100, o_token_stride=7)
    assert got["seq_q"].flatten().tolist() == [0, 3, 0, 5, 0, 0, 0, 0]
    assert got["seq_kv"].flatten().tolist() == [0, 7, 0, 5, 0, 0, 0, 0]
    assert got["q_off"].flatten().tolist() == [0, 100, 400, 400, 900, 900, 900, 900, 900]
    assert got["o_off"].flatten().tolist() == [0, 7, 28, 28, 63, 63, 63, 63, 63]
    t = got["table"]
    assert t.shape == (8, 1, 3, 1) and t.dtype == torch.int32
    assert t[:4, 0, :, 0].tolist() == table.tolist() and not t[4:].any()
    for k in ("seq_q", "seq_kv", "q_off", "o_off"):
        assert got[k].dtype == torch.int32
    with pytest.raises(ConfigError):
        cudnn_paged_inputs(qsl, seq, table, 4, 3, 1, 1)


def _inputs_twin(q_lens, seq_lens, table, batch, q_stride, o_stride):
    """The per-step inputs one request at a time (plain Python)."""
    n = len(q_lens)
    starts = [sum(q_lens[:r]) for r in range(n + 1)]
    starts += [starts[-1]] * (batch - n)
    seq_q = [q if q > 1 else 0 for q in q_lens] + [0] * (batch - n)
    seq_kv = [s if q > 1 else 0 for q, s in zip(q_lens, seq_lens)] + [0] * (batch - n)
    rows = [list(r) for r in table] + [[0] * len(table[0])] * (batch - n)
    return seq_q, seq_kv, [x * q_stride for x in starts], [x * o_stride for x in starts], rows


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 30)), min_size=1, max_size=12),
       st.integers(0, 4), st.integers(1, 300), st.integers(1, 300), st.integers(1, 6))
def test_inputs_match_their_twin(reqs, extra, q_stride, o_stride, width):
    """Random batches (decodes, empty requests, chunks after context, padding) against the
    one-request-at-a-time twin."""
    q_lens = [q for q, _ in reqs]
    seq_lens = [q + c for q, c in reqs]
    n = len(reqs)
    batch = n + extra
    table = [[(7 * r + c) % 97 + 1 for c in range(width)] for r in range(n)]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    got = cudnn_paged_inputs(qsl, torch.tensor(seq_lens, dtype=torch.int32),
                             torch.tensor(table, dtype=torch.int32), n, batch, q_stride,
                             o_stride)
    seq_q, seq_kv, q_off, o_off, rows = _inputs_twin(q_lens, seq_lens, table, batch,
                                                     q_stride, o_stride)
    assert got["seq_q"].flatten().tolist() == seq_q
    assert got["seq_kv"].flatten().tolist() == seq_kv
    assert got["q_off"].flatten().tolist() == q_off
    assert got["o_off"].flatten().tolist() == o_off
    assert got["table"][:, 0, :, 0].tolist() == rows


def test_backend_option_and_fallback():
    with pytest.raises(ConfigError, match="paged_prefill"):
        TritonAttentionBackend(paged_prefill="flash")
    # the default: cuDNN where it runs (the layout check below decides per layer)
    assert TritonAttentionBackend().paged_prefill == "cudnn"
    assert TritonAttentionBackend(paged_prefill="triton").paged_prefill == "triton"
    b = TritonAttentionBackend(paged_prefill="cudnn")
    assert b.paged_prefill == "cudnn"
    from pagedkv.attention.backend import AttentionLayout

    cpu = AttentionLayout(4, 2, 16, torch.float32, torch.device("cpu"))
    assert not cudnn_paged_available(torch.bfloat16, torch.device("cpu"), 128)
    assert not b.wants_cudnn_paged(cpu)  # no CUDA here: the Triton / reference path


def test_block_size_check_by_hand():
    """cuDNN's paged load takes pages of a power of two tokens (its graph rejects others:
    "block size needs to be non-zero and a power of 2"); the graph says so before it asks for
    the frontend, so the check runs here without CUDA."""
    assert [b for b in range(0, 130) if cudnn_paged_block_size_ok(b)] == [1, 2, 4, 8, 16, 32,
                                                                           64, 128]
    kw = dict(dtype=torch.bfloat16, num_heads=4, head_dim=64, batch=8, max_q=1024, width=4,
              q_token_stride=256, o_token_stride=256, scale=0.125, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="pages of 48 tokens"):
        CudnnPagedGraph(cache_shape=(10, 48, 2, 64), cache_strides=(6144, 128, 64, 1), **kw)
    with pytest.raises(ConfigError, match="cache"):  # heads before pages
        CudnnPagedGraph(cache_shape=(10, 48, 3, 64), cache_strides=(9216, 192, 64, 1), **kw)


def test_cpu_engine_with_cudnn_asked_matches_default(tiny_dir):
    """Asked for where it cannot run (CPU), the backend serves prefills as the default does."""
    from pagedkv import LLM, SamplingParams

    path = tiny_dir("qwen3")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [12] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = []
    for mode in ("triton", "cudnn"):
        llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=64,
                  num_gpu_blocks_override=64,
                  attention_backend=TritonAttentionBackend(paged_prefill=mode))
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)])
    assert outs[0] == outs[1]


def _case(q_lens, ctx_lens, bs, H, HKV, D, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    seq = [c + n for c, n in zip(ctx_lens, q_lens)]
    pages = [-(-s // bs) for s in seq]
    nb = 1 + sum(pages) + 3
    cache = torch.full((2, nb, bs, HKV, D), float("nan"), dtype=dtype)
    perm = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    width = max(pages) + 2
    table = torch.zeros(len(seq), width, dtype=torch.int32)
    at = 0
    for i, p in enumerate(pages):
        table[i, :p] = torch.tensor(perm[at:at + p], dtype=torch.int32)
        at += p
    cache[:, 0] = 0  # the null block, and the owned pages' unwritten tails: zero (the runner's)
    cache[:, table[table > 0].long()] = 0
    for i, s in enumerate(seq):
        pos = torch.arange(s)
        slot = table[i, pos // bs].long() * bs + pos % bs
        cache[0].view(-1, HKV, D)[slot] = torch.randn(s, HKV, D, generator=g).to(dtype)
        cache[1].view(-1, HKV, D)[slot] = torch.randn(s, HKV, D, generator=g).to(dtype)
    T = sum(q_lens)
    # q as a view into a wider projection row (token stride > H D), like a fused qkv output
    wide = torch.randn(T, (H + 2 * HKV) * D, generator=g).to(dtype)
    q = wide[:, : H * D].view(T, H, D)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, cache, table, qsl, torch.tensor(seq, dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cudnn_paged_matches_reference_gpu(dtype, bs):
    """Mixed requests (a decode, a fresh prefill, a chunk after context, an empty one; lengths
    off the page size), pages of 16 or 64 (the engine's default block and the larger one the
    H200 prefers: 451 against 418 TFLOP/s) in shuffled order, NaN in every page no request
    owns, q a strided view: the prefill rows equal the fp32 reference, the decode / padding
    rows are left alone; the same launch replayed in a CUDA graph."""
    if frontend() is None:
        pytest.skip("nvidia-cudnn-frontend not installed (or cuDNN < 9.5)")
    H, HKV, D = 8, 2, 128
    q_lens, ctx = [1, 300, 77, 0, 129], [40, 0, 500, 0, 1]
    q, cache, table, qsl, seq = (t.cuda() for t in _case(q_lens, ctx, bs, H, HKV, D, dtype))
    n = len(q_lens)
    batch, max_q = declared_shape(n, q.shape[0])
    out = torch.full((q.shape[0], H, D), 7.0, dtype=dtype, device="cuda")
    g = CudnnPagedGraph(dtype=dtype, num_heads=H, head_dim=D, batch=batch, max_q=max_q,
                        cache_shape=tuple(cache[0].shape), cache_strides=tuple(cache[0].stride()),
                        width=table.shape[1], q_token_stride=q.stride(0),
                        o_token_stride=out.stride(0), scale=D ** -0.5, device=q.device)
    inputs = cudnn_paged_inputs(qsl, seq, table, n, batch, q.stride(0), out.stride(0))
    g(q, cache, out, inputs)
    torch.cuda.synchronize()
    md = SimpleNamespace(query_start_loc_cpu=qsl.cpu(), num_reqs=n, seq_lens_cpu=seq.cpu(),
                         block_table_tensor=table)
    ref = paged_attention_ref(q.float(), cache, md, D ** -0.5)
    rows = torch.zeros(q.shape[0], dtype=torch.bool)
    for r in range(n):
        if q_lens[r] > 1:
            rows[int(qsl[r]):int(qsl[r + 1])] = True
    rows = rows.cuda()
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=2e-2, rtol=2e-2)
    assert (out[~rows] == 7.0).all()  # the decode row: the decode kernel's
    # replayed in a CUDA graph (inputs made inside the capture)
    out2 = torch.full_like(out, 7.0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g(q, cache, out2, cudnn_paged_inputs(qsl, seq, table, n, batch, q.stride(0),
                                             out2.stride(0)))
        with torch.cuda.graph(cg, stream=s):
            g(q, cache, out2, cudnn_paged_inputs(qsl, seq, table, n, batch, q.stride(0),
                                                 out2.stride(0)))
    torch.cuda.current_stream().wait_stream(s)
    out2.fill_(7.0)
    cg.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out2, out)


def test_triton_cudnn_backend_name_and_cli():
    """``attention_backend="triton+cudnn"``: the Triton backend asking for cuDNN's paged
    prefills; the command line offers exactly the engine's names."""
    import argparse

    from pagedkv.cli import _engine_args
    from pagedkv.engine.llm_engine import ATTENTION_BACKENDS, make_attention_backend

    b = make_attention_backend("triton+cudnn", torch.device("cpu"))
    assert isinstance(b, TritonAttentionBackend) and b.paged_prefill == "cudnn"
    assert make_attention_backend("triton", torch.device("cpu")).paged_prefill == "cudnn"
    p = argparse.ArgumentParser()
    _engine_args(p)
    action = next(a for a in p._actions if a.dest == "attention_backend")
    assert tuple(action.choices) == ATTENTION_BACKENDS
    assert p.parse_args(["--attention-backend", "triton+cudnn"]).attention_backend == \
        "triton+cudnn"
    with pytest.raises(ConfigError, match="attention_backend"):
        make_attention_backend("cudnn", torch.device("cpu"))


_EXIT_SCRIPT = """
import atexit, sys, threading, torch
import pagedkv.attention.cudnn_paged as cudnn_paged
from pagedkv.attention.cudnn_paged import CudnnPagedGraph, cudnn_paged_inputs, declared_shape
if sys.argv[1] == "no_hook":  # the control: what the process prints without the exit hook
    atexit.unregister(cudnn_paged.release_all)
H, HKV, D, BS = 4, 2, 64, 16
batch, max_q = declared_shape(1, 32)
cache = torch.randn(2, 8, BS, HKV, D, device="cuda").to(torch.bfloat16)
q = torch.randn(32, H, D, dtype=torch.bfloat16, device="cuda")
out = torch.zeros_like(q)
table = torch.arange(1, 4, dtype=torch.int32, device="cuda").view(1, 3)
qsl = torch.tensor([0, 32], dtype=torch.int32, device="cuda")
seq = torch.tensor([32], dtype=torch.int32, device="cuda")
GRAPH = CudnnPagedGraph(dtype=q.dtype, num_heads=H, head_dim=D, batch=batch, max_q=max_q,
                        cache_shape=tuple(cache[0].shape), cache_strides=tuple(cache[0].stride()),
                        width=3, q_token_stride=q.stride(0), o_token_stride=out.stride(0),
                        scale=D ** -0.5, device=q.device)
GRAPH(q, cache, out, cudnn_paged_inputs(qsl, seq, table, 1, batch, q.stride(0), out.stride(0)))
torch.cuda.synchronize()
assert torch.isfinite(out).all() and out.abs().sum() > 0
if sys.argv[1] == "release":
    GRAPH.release()
    GRAPH.release()  # twice: a no-op
# alive at exit in the frame of a daemon thread that never returns, as an engine is in a
# server's engine loop (a module global, or a reference cycle with gc off, is freed during the
# interpreter's shutdown before the bindings' leak check and showed nothing even without the
# hook: the thirty-second session's control, H100)
stop = threading.Event()
def hold(graph=GRAPH):
    stop.wait()
threading.Thread(target=hold, daemon=True).start()
del GRAPH
print("done")
"""


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["exit", "release", "no_hook"])
def test_graph_alive_at_exit_leaks_nothing_gpu(how):
    """A process that exits with a graph alive (held by a daemon thread's frame here, by the
    engine loop in a server's engine process) prints nothing from the frontend's bindings: the
    exit hook drops every live graph first. The thirty-first session's serving run (H100) ended
    with nanobind's "leaked 65 instances!" report on stderr before the hook and with none
    after. ``no_hook``, the control, unregisters the hook and must print the report (the
    thirty-second session, H100: "leaked 13 instances!", 38 lines naming backend_graph and
    tensor instances; with the hook none): without it this test could not fail. Released by
    hand first, nothing either."""
    import os
    import subprocess
    import sys

    if frontend() is None:
        pytest.skip("nvidia-cudnn-frontend not installed (or cuDNN < 9.5)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, how], capture_output=True,
                         text=True, env=env, timeout=300, cwd=root)
    assert res.returncode == 0 and "done" in res.stdout, res.stderr[-3000:]
    leaked = "leaked" in res.stderr.lower()
    if how == "no_hook":
        assert leaked, ("without the exit hook the bindings reported no leak: the script no "
                        "longer holds a graph alive at exit, so its other cases prove nothing\n"
                        + res.stderr[-3000:])
    else:
        assert not leaked, res.stderr[-3000:]
