"""Programmatic dependent launch (``pagedkv.kernels.pdl``).

CPU: when a launch takes PDL (never off CUDA or under the interpreter); the decode and
prefill kernels compiled for sm_90 (``pagedkv.tools.sm90_report``, no device) wait for the
previous grid before their first global-memory instruction when compiled for PDL, and carry no
grid-dependency instruction otherwise. GPU: a decode layer's chain of PDL launches (the fused
q/k norm + RoPE + K/V write, split decode, its reduce, a cascade merge; four layers sharing one
partials workspace, so a later layer's kernels overwrite what an earlier one's read), eager
and as CUDA-graph replays, bitwise equal to the same chain without PDL.
"""

import json

import pytest
import torch

from pagedkv.kernels import pdl


def test_no_pdl_off_cuda(monkeypatch):
    from pagedkv.attention.triton_decode import _decode_kernel

    monkeypatch.setattr(pdl, "PDL_ENABLED", True)
    assert not pdl.pdl_supported(torch.device("cpu"))
    assert not pdl.use_pdl(_decode_kernel, torch.device("cpu"))
    assert pdl.pdl_launch_args(_decode_kernel, torch.device("cpu")) == {"PDL": 0}
    monkeypatch.setattr(pdl, "PDL_ENABLED", False)
    assert pdl.pdl_launch_args(_decode_kernel, torch.device("cpu")) == {"PDL": 0}


@pytest.mark.parametrize("kernel", ["decode", "decode-flat", "prefill"])
def test_sm90_pdl_waits_before_any_global_access(kernel, compiled_run):
    def report(*args: str) -> dict:
        return json.loads(compiled_run("-m", "pagedkv.tools.sm90_report", *args, "--json"))

    on, off = report(kernel, "--pdl"), report(kernel)
    assert on["gdc_wait"] == 1 and on["gdc_launch"] == 1
    assert on["global_before_wait"] == 0
    assert off["gdc_wait"] == 0 and off["gdc_launch"] == 0
    assert off["global_before_wait"] > 10  # the counter sees the kernel's loads and stores
    # the same kernel otherwise: registers, shared memory, pipelining
    for key in ("regs", "shared", "waits", "local"):
        assert on[key] == off[key], key


# ---------------------------------------------------------------------------------------------
# GPU


def _chain_case(layers=4, batch=24, seed=3, dev="cuda", max_len=3000):
    from pagedkv.attention.triton_decode import paged_decode_attention
    from pagedkv.attention.merge_states import merge_attention_states
    from pagedkv.kernels.qk_norm_rope_cache import qk_norm_rope_cache

    H, HKV, D, BS = 16, 8, 128, 16
    g = torch.Generator(device=dev).manual_seed(seed)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    lens = torch.randint(1, max_len, (batch,), generator=g, device=dev, dtype=torch.int32)
    width = max_len // BS + 1
    nb = 1 + layers * batch * width
    caches = [torch.randn((2, nb, BS, HKV, D), generator=g, device=dev, dtype=dt)
              for _ in range(layers)]
    perm = torch.randperm(nb - 1, generator=g, device=dev).to(torch.int32) + 1
    table = perm[: batch * width].view(batch, width)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    pos = lens.long() - 1
    slots = table.gather(1, (pos // BS)[:, None]).squeeze(1).long() * BS + pos % BS
    ang = pos[:, None].float() * torch.rand(D // 2, generator=g, device=dev)[None, :]
    cos, sin = ang.cos(), ang.sin()
    qkv = [torch.randn((batch, (H + 2 * HKV) * D), generator=g, device=dev, dtype=dt)
           for _ in range(layers)]
    qw = torch.rand(D, generator=g, device=dev, dtype=dt) + 0.5
    kw = torch.rand(D, generator=g, device=dev, dtype=dt) + 0.5
    other = torch.randn((batch, H, D), generator=g, device=dev, dtype=torch.float32)
    other_lse = torch.randn((batch, H), generator=g, device=dev, dtype=torch.float32)
    q_out = [torch.empty((batch, H, D), device=dev, dtype=dt) for _ in range(layers)]
    att = [torch.empty((batch, H, D), device=dev, dtype=dt) for _ in range(layers)]
    lse = [torch.empty((batch, H), device=dev, dtype=torch.float32) for _ in range(layers)]
    merged = [torch.empty((batch, H, D), device=dev, dtype=dt) for _ in range(layers)]
    workspace: dict = {}

    def run():
        for i in range(layers):
            qk_norm_rope_cache(qkv[i], H, HKV, D, qw, kw, 1e-6, cos, sin, slots,
                               caches[i][0], caches[i][1], q_out=q_out[i])
            paged_decode_attention(q_out[i], caches[i], table, qsl, lens, batch, D ** -0.5,
                                   att[i], num_splits=6, workspace=workspace, lse=lse[i])
            merge_attention_states(merged[i], other, other_lse, att[i], lse[i], batch)

    def poison():
        for t in q_out + att + lse + merged:
            t.fill_(float("nan"))

    return run, poison, lambda: [t.clone() for t in q_out + att + lse + merged + caches]


@pytest.mark.gpu
def test_pdl_chain_bitwise_equal_eager_and_graph(monkeypatch):
    if not pdl.pdl_supported(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0+")
    run, poison, snapshot = _chain_case()
    _assert_pdl_bitwise_equal(monkeypatch, run, snapshot, poison)


def _assert_pdl_bitwise_equal(monkeypatch, run, snapshot, poison=lambda: None):
    """``run()`` with PDL gives the bits it gives without: eager (3 runs) and over 20 replays
    of a CUDA graph captured with PDL on (``poison()`` before each run / replay)."""
    monkeypatch.setattr(pdl, "PDL_ENABLED", False)
    poison()
    run()
    torch.cuda.synchronize()
    want = snapshot()
    monkeypatch.setattr(pdl, "PDL_ENABLED", True)
    for _ in range(3):
        poison()
        run()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(snapshot(), want))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(20):
        poison()
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(snapshot(), want))


def test_inductor_pdl_follows_the_switch(monkeypatch):
    """``PAGEDKV_PDL=1`` on a device with PDL also turns on inductor's PDL codegen for the
    compiled regions; off the switch or off such a device it stays as it is."""
    from pagedkv.models.decoder import _inductor_pdl

    ind = torch._inductor.config.triton
    if not hasattr(ind, "enable_pdl"):
        pytest.skip("this torch's inductor has no enable_pdl")
    monkeypatch.setattr(ind, "enable_pdl", False)
    monkeypatch.setattr(pdl, "PDL_ENABLED", True)
    _inductor_pdl(torch.device("cpu"))
    assert ind.enable_pdl is False
    monkeypatch.setattr(pdl, "pdl_supported", lambda device: True)
    monkeypatch.setattr(pdl, "PDL_ENABLED", False)
    _inductor_pdl(torch.device("cuda"))
    assert ind.enable_pdl is False
    monkeypatch.setattr(pdl, "PDL_ENABLED", True)
    _inductor_pdl(torch.device("cuda"))
    assert ind.enable_pdl is True


def test_launch_args_by_trigger(monkeypatch):
    """The kernels' ``PDL`` constexpr per trigger placement (1: wait then trigger early, 2:
    wait only), the launch attribute with it, and a typed error for an unknown placement."""
    from pagedkv.errors import ConfigError

    monkeypatch.setattr(pdl, "use_pdl", lambda kernel, device: True)
    monkeypatch.setattr(pdl, "PDL_TRIGGER", "early")
    assert pdl.pdl_launch_args(None, torch.device("cuda")) == {"PDL": 1, "launch_pdl": True}
    monkeypatch.setattr(pdl, "PDL_TRIGGER", "exit")
    assert pdl.pdl_launch_args(None, torch.device("cuda")) == {"PDL": 2, "launch_pdl": True}
    monkeypatch.setattr(pdl, "PDL_TRIGGER", "late")
    with pytest.raises(ConfigError, match="PAGEDKV_PDL_TRIGGER"):
        pdl.pdl_launch_args(None, torch.device("cuda"))


@pytest.mark.parametrize("args", [("qkv-rope", "16,64,4,4,4", "--ln"),
                                  ("qkv-rope", "64,64,4,4,1", "--ln"),
                                  ("gate-up", "64,32,64,4,4,1", "--ln"),
                                  ("splitk-residual", "64,64,64,4,5,4")],
                         ids=["qkv_split", "qkv", "gate_up", "residual"])
def test_sm90_chain_kernels_prefetch_weights_before_the_wait(args, compiled_run):
    """The fused decode chain's kernels under PDL: their only instructions before the grid
    wait are L2 prefetches of their weight lines (no load or store), then the wait and the
    early trigger; without PDL neither."""
    def report(*extra: str) -> dict:
        return json.loads(compiled_run("-m", "pagedkv.tools.sm90_report", *args, *extra,
                                       "--json"))

    on, off = report("--pdl"), report()
    assert on["gdc_wait"] == 1 and on["gdc_launch"] == 1, on
    assert on["global_before_wait"] == 0 and on["prefetch_before_wait"] > 0, on
    assert off["gdc_wait"] == 0 and off["prefetch_before_wait"] == 0, off
    assert on["local"] == 0 and on["waits"] == off["waits"], (on, off)


def test_prefetch_lines_by_hand():
    assert pdl.prefetch_lines(256, 2) == (4, 64)  # 256 bf16 columns: 4 lines of 64
    assert pdl.prefetch_lines(1024, 2) == (16, 64)
    assert pdl.prefetch_lines(200, 2) == (4, 64)  # 3.1 lines -> 4
    assert pdl.prefetch_lines(96, 4) == (4, 32)  # fp32: 32 a line, 3 lines -> 4
    assert pdl.prefetch_lines(1, 2) == (1, 64)


@pytest.mark.gpu
def test_pdl_fused_decode_chain_bitwise_equal_eager_and_graph(monkeypatch):
    """Four layers of the fused decode chain's kernels (QKV with the norm on the fly, o with
    the residual, gate/up with the norm, down with the residual) with PDL and the weight
    prefetch against the same chain without PDL: bitwise equal, eager and over 20 graph
    replays."""
    if not pdl.pdl_supported(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0+")
    from pagedkv.kernels.gate_up_silu import fused_gate_up_silu
    from pagedkv.kernels.qkv_rope_cache import qkv_rope_cache
    from pagedkv.kernels.splitk_gemm import splitk_residual

    H, HKV, D, HID, INTER, BS, NB, T = 16, 8, 128, 1024, 3072, 16, 64, 24
    g = torch.Generator(device="cuda").manual_seed(5)
    bf = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(shape, generator=g, device="cuda") * scale).to(bf)

    layers = [dict(qkv=rnd((H + 2 * HKV) * D, HID, scale=0.03), o=rnd(HID, H * D, scale=0.02),
                   gu=rnd(2 * INTER, HID, scale=0.03), down=rnd(HID, INTER, scale=0.02),
                   ln1=rnd(HID, scale=0.1) + 1, ln2=rnd(HID, scale=0.1) + 1,
                   kv=torch.zeros(2, NB, BS, HKV, D, device="cuda", dtype=bf))
              for _ in range(4)]
    qn, kn = rnd(D, scale=0.1) + 1, rnd(D, scale=0.1) + 1
    x0 = rnd(T, HID)
    ang = torch.rand(T, D // 2, generator=g, device="cuda") * 6
    cos, sin = ang.cos().to(bf), ang.sin().to(bf)
    slots = torch.randperm(NB * BS, generator=g, device="cuda")[:T]
    outs = []

    def run():
        outs.clear()
        h = x0
        for ly in layers:
            q = qkv_rope_cache(h, ly["qkv"], None, H, HKV, D, qn, kn, 1e-6, cos, sin, slots,
                               ly["kv"][0], ly["kv"][1], ln_weight=ly["ln1"], ln_eps=1e-6)
            h = splitk_residual(q.reshape(T, -1), ly["o"], None, h, 4)
            act = fused_gate_up_silu(h, ly["gu"], None, None, ly["ln2"], 1e-6)
            h = splitk_residual(act, ly["down"], None, h, 4)
            outs.extend([q, act, h])

    def snapshot():
        return [t.clone() for t in outs] + [ly["kv"].clone() for ly in layers]

    def poison():  # a finite pattern: unwritten cache slots keep it on both sides (equal bits)
        for t in outs + [ly["kv"] for ly in layers]:
            t.fill_(7.0)

    _assert_pdl_bitwise_equal(monkeypatch, run, snapshot, poison)
