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
