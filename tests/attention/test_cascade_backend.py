"""Cascade attention in the Triton backend == plain paged attention, on random batches whose
requests share their first k blocks (the same physical blocks), decode-only and mixed with
chunked prefills, with CUDA-graph padding; plus the backend's host decision, its graph
variants and the plan's checks. Interpreted on CPU (tiny shapes, fp32/fp16), native on CUDA.

Every slot no request may read holds NaN (the null block, spare blocks, block tails, table
columns past a request's blocks), so a suffix table shifted wrong or a prefix read past its
length shows up as NaN."""

import random

import pytest
import torch

from test_triton_cases import make_case

from pagedkv.attention import TorchRefBackend, build_attention_metadata
from pagedkv.attention.backend import AttentionLayout
from pagedkv.attention.metadata import SimpleAttentionMetadata
from pagedkv.attention.triton_backend import (
    CASCADE,
    CascadeConfig,
    TritonAttentionBackend,
)
from pagedkv.errors import ConfigError, InvalidRequestError, InvariantError
from pagedkv.kernels.reshape_and_cache import reshape_and_cache_ref

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
# cascade on any shared block; the prefix split over keys as much as the tiny batches allow
ALWAYS = CascadeConfig(min_prefix_tokens=1, min_reqs=1, min_saved_us=0.0,
                       min_prefix_split_tokens=1)
ONE_SPLIT = CascadeConfig(min_prefix_tokens=1, min_reqs=1, min_saved_us=0.0,
                          max_prefix_splits=1)


def make_shared_case(reqs, *, shared_blocks, block_size, prefix_len=None, **kw):
    """Requests ``(own_context, query_len)`` after a shared prefix of ``shared_blocks``
    blocks: ``make_case`` with contexts ``P + own_context`` (``P = shared_blocks x
    block_size``), then every row's first ``shared_blocks`` table entries pointed at request
    0's blocks (the same physical blocks, as prefix caching shares them) and the blocks they
    replaced poisoned. ``prefix_len``: the metadata's ``common_prefix_len`` (default ``P``);
    ``kw``: ``make_case``'s options."""
    P = shared_blocks * block_size
    case = make_case([(P + c, ql) for c, ql in reqs], block_size=block_size, **kw)
    table, cache = case["meta"].block_table_tensor, case["cache"]
    for r in range(1, len(reqs)):
        cache[:, table[r, :shared_blocks].long()] = float("nan")
        table[r, :shared_blocks] = table[0, :shared_blocks]
    case["meta"].common_prefix_len = P if prefix_len is None else prefix_len
    case["n"] = sum(ql for _, ql in reqs)
    return case


def run(backend, case, sinks=None):
    return backend.forward_with_metadata(0, case["q"], case["k"], case["v"], case["cache"],
                                         case["meta"], case["scale"], sinks=sinks)


def check_cascade(reqs, *, dtype=torch.float32, sinks=False, config=ALWAYS, split=True, **kw):
    """Cascade (forced on) vs the torch reference and vs the plain Triton path, on twin cases:
    outputs, the KV cache written, zero padding rows; the plan took cascade, its prefix split
    over keys (``split`` True: the tiny batches with ``ALWAYS``; False: one range; None: not
    checked)."""
    cases = [make_shared_case(reqs, dtype=dtype, **kw) for _ in range(3)]
    a, b, c = cases
    cascade = TritonAttentionBackend(cascade=config)
    plan = cascade.plan(a["meta"], AttentionLayout.of(a["q"], a["cache"]))
    assert plan.cascade, "the plan must take cascade attention"
    splits = plan.cascade_parts(a["q"], a["cache"]).splits
    if split is not None:
        assert (splits > 1) == split
    s = None
    if sinks:
        s = torch.randn(a["q"].shape[1], generator=torch.Generator().manual_seed(7)).to(a["q"].device)
    out = run(cascade, a, sinks=s)
    plain = run(TritonAttentionBackend(cascade=None), b, sinks=s)
    c["cache"] = c["cache"].float()
    ref = TorchRefBackend(writer="ref").forward_with_metadata(
        0, c["q"].float(), c["k"].float(), c["v"].float(), c["cache"], c["meta"], c["scale"],
        sinks=s)
    n = a["n"]
    assert out.dtype == dtype and not torch.isnan(out[:n].float().cpu()).any()
    torch.testing.assert_close(out[:n].float().cpu(), ref[:n].float().cpu(), atol=TOL[dtype],
                               rtol=TOL[dtype])
    torch.testing.assert_close(out[:n].float().cpu(), plain[:n].float().cpu(), atol=TOL[dtype],
                               rtol=TOL[dtype])
    assert torch.all(out[n:] == 0), "rows past the batch must be zero"
    torch.testing.assert_close(a["cache"].float().cpu().nan_to_num(-9.0),
                               c["cache"].float().cpu().nan_to_num(-9.0), atol=0, rtol=0)
    return out


DECODES = [(0, 1), (3, 1), (9, 1), (16, 1), (25, 1), (40, 1)]


@pytest.mark.parametrize("block_size,shared,heads,dtype,config", [
    (4, 3, (4, 2), torch.float32, ALWAYS),
    (16, 2, (8, 1), torch.float32, ONE_SPLIT),
    (5, 4, (4, 4), torch.float16, ALWAYS),
    (16, 1, (4, 2), torch.float16, ONE_SPLIT),
    (16, 4, (4, 2), torch.float32, ALWAYS),  # 64 shared keys: 4 key splits hold keys
])
def test_cascade_decode_equals_plain(kernel_device, block_size, shared, heads, dtype, config):
    check_cascade(DECODES, shared_blocks=shared, block_size=block_size, num_heads=heads[0],
                  num_kv_heads=heads[1], dtype=dtype, device=kernel_device,
                  seed=block_size + shared, config=config, split=config is ALWAYS)


def test_cascade_packed_prefix_counts_head_programs(kernel_device):
    """A prefix launch packing 2 query heads a program (group 4 -> 2 heads a program): its key
    splits are sized by the launch's 4 head programs, not the 8 query heads, and the result
    equals the plain path and the reference. By hand: 6 rows, block_m 16 -> 1 row tile;
    prefix_waves 0.1 x 132 SMs -> 13 programs wanted; ceil(13 / (1 x 4)) = 4 splits (8 query
    heads would give ceil(13 / 8) = 2); the 12-key prefix allows up to 12."""
    import dataclasses

    from pagedkv.attention.triton_prefill import PrefillConfig

    cfg = dataclasses.replace(ALWAYS, prefix_waves=0.1, max_prefix_splits=64,
                              prefix_config=PrefillConfig(block_m=16, block_n=16, num_warps=1,
                                                          num_stages=1, pack_heads=2))
    case = make_shared_case(DECODES, shared_blocks=3, block_size=4, num_heads=8, num_kv_heads=2,
                            device=kernel_device, seed=21, write_new=True)
    plan = TritonAttentionBackend(cascade=cfg).plan(case["meta"],
                                                    AttentionLayout.of(case["q"], case["cache"]))
    assert plan.cascade_parts(case["q"], case["cache"]).splits == 4
    check_cascade(DECODES, config=cfg, shared_blocks=3, block_size=4, num_heads=8,
                  num_kv_heads=2, device=kernel_device, seed=21, write_new=True)


def test_cascade_decode_with_graph_padding(kernel_device):
    check_cascade(DECODES[:4], shared_blocks=2, block_size=4, device=kernel_device,
                  pad_tokens=3, padded_reqs=3, seed=11)


# decode rows, a chunked prefill over own context, a request whose queries start right after
# the prefix (own context 0), a speculative-like 2-token row, a long chunk across key tiles
MIXED = [(5, 1), (6, 9), (0, 7), (21, 1), (2, 2), (13, 20)]


@pytest.mark.parametrize("block_size,shared,dtype,config", [
    (4, 3, torch.float32, ALWAYS), (16, 1, torch.float32, ONE_SPLIT),
    (3, 5, torch.float16, ALWAYS),
])
def test_cascade_mixed_batch_equals_plain(kernel_device, block_size, shared, dtype, config):
    check_cascade(MIXED, shared_blocks=shared, block_size=block_size, dtype=dtype,
                  device=kernel_device, pad_tokens=2, padded_reqs=1, seed=block_size * shared,
                  config=config, split=config is ALWAYS)


def test_cascade_prefix_shorter_than_the_shared_blocks(kernel_device):
    """A common_prefix_len of fewer blocks than the requests share (the runner's cap) is
    exact too: the rest of the shared blocks count as each request's own."""
    check_cascade(MIXED, shared_blocks=4, block_size=4, prefix_len=8, device=kernel_device,
                  seed=5)


def test_sinks_layer_takes_the_plain_path_on_a_cascade_plan(kernel_device):
    check_cascade(DECODES, shared_blocks=2, block_size=4, device=kernel_device, sinks=True,
                  seed=2)


def test_cascade_prefix_past_a_context_is_refused(kernel_device):
    case = make_shared_case([(0, 1), (3, 2)], shared_blocks=2, block_size=4,
                            device=kernel_device)
    with pytest.raises(InvalidRequestError, match="common_prefix_len"):
        build_attention_metadata([1, 2], [9, 13], case["meta"].block_table_tensor.cpu(),
                                 torch.tensor([-1, -1, -1]), common_prefix_len=9)
    meta = case["meta"]
    meta.common_prefix_len = 9  # request 0's query sits at position 8
    layout = AttentionLayout.of(case["q"], case["cache"])
    with pytest.raises(InvariantError, match="cascade-prefix"):
        TritonAttentionBackend(cascade=ALWAYS).plan(meta, layout)


def test_metadata_puts_the_shared_prefix_on_the_device_for_graph_plans():
    """``build_attention_metadata``'s ``common_prefix_len`` also on the device (a CUDA graph's
    cascade plan reads it there and refuses a plan without it); none without a prefix."""
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    meta = build_attention_metadata([1, 1], [9, 13], table, torch.tensor([-1, -1]),
                                    common_prefix_len=8)
    assert meta.common_prefix_len == 8
    assert meta.common_prefix_len_device.tolist() == [8]
    assert meta.common_prefix_len_device.dtype == torch.int32
    plain = build_attention_metadata([1, 1], [9, 13], table, torch.tensor([-1, -1]))
    assert plain.common_prefix_len_device is None


# ----- the host decision


def layout(**variant):
    return AttentionLayout(16, 8, 128, torch.bfloat16, torch.device("cpu"), **variant)


def test_use_cascade_thresholds_by_hand():
    backend = TritonAttentionBackend()  # the defaults: 256 tokens, 8 requests, 10 us saved
    lay = layout()
    # W3's decode step: 256 requests on 2048 shared tokens save 255 x 2048 x 8 x 128 x 2 x 2
    # bytes = 2.14 GB, ~501 us at 4.27 TB/s
    assert backend.use_cascade(256, 2048, lay)
    assert not backend.use_cascade(256, 240, lay)  # too short a prefix
    assert not backend.use_cascade(7, 2048, lay)  # too few requests
    # 8 requests x 256 tokens save 7 x 256 x 4096 B = 7.3 MB = 1.7 us < 10 us
    assert not backend.use_cascade(8, 256, lay)
    # 64 x 256: 63 x 256 x 4096 B = 66 MB = 15.5 us
    assert backend.use_cascade(64, 256, lay)
    assert not backend.use_cascade(256, 2048, layout(sliding_window=512))
    assert not backend.use_cascade(256, 2048, layout(logits_soft_cap=30.0))
    assert not TritonAttentionBackend(cascade=None).use_cascade(256, 2048, lay)
    assert not backend.use_cascade(256, 0, lay)


def test_plan_decision_follows_metadata_and_backend(kernel_device):
    case = make_shared_case(DECODES, shared_blocks=2, block_size=4, device=kernel_device)
    meta, lay = case["meta"], AttentionLayout.of(case["q"], case["cache"])
    assert TritonAttentionBackend(cascade=ALWAYS).plan(meta, lay).cascade
    assert not TritonAttentionBackend().plan(meta, lay).cascade  # 8 shared tokens < 256
    meta.use_cascade = False  # a graph's baked decision wins
    assert not TritonAttentionBackend(cascade=ALWAYS).plan(meta, lay).cascade
    meta.use_cascade = True
    assert TritonAttentionBackend().plan(meta, lay).cascade
    assert not TritonAttentionBackend(cascade=None).plan(meta, lay).cascade
    windowed = AttentionLayout.of(case["q"], case["cache"], sliding_window=8)
    assert not TritonAttentionBackend(cascade=ALWAYS).plan(meta, windowed).cascade


def test_graph_variants_and_capture_fields():
    dev = torch.device("cpu")
    backend = TritonAttentionBackend(cascade=CascadeConfig(min_reqs=8))
    assert CASCADE not in backend.graph_variants(4, 2, dev)
    assert backend.graph_variants(8, 2, dev)[-1] == CASCADE
    assert CASCADE not in TritonAttentionBackend(cascade=None).graph_variants(64, 2, dev)
    lens = [40, 41, 39, 40, 40, 40, 40, 40]
    assert backend.graph_variant(8, 2, lens, dev, cascade=True) == CASCADE
    assert backend.graph_variant(4, 2, lens[:4], dev, cascade=True) != CASCADE
    assert backend.graph_variant(8, 2, lens, dev) != CASCADE
    assert backend.graph_capture_fields(CASCADE) == {"decode_balanced": False,
                                                     "use_cascade": True}
    assert backend.graph_capture_fields(True) == {"decode_balanced": True, "use_cascade": False}


def test_cascade_config_errors():
    for bad in (dict(min_prefix_tokens=0), dict(min_reqs=True), dict(min_saved_us=-1.0)):
        with pytest.raises(ConfigError):
            CascadeConfig(**bad)
    with pytest.raises(ConfigError, match="cascade"):
        TritonAttentionBackend(cascade="on")


def test_graph_cascade_plan_needs_the_device_prefix():
    """Outside a capture a plan without the device copy makes one; the metadata the runner
    builds carries it (checked in tests/engine/test_cascade_engine.py)."""
    case = make_shared_case(DECODES, shared_blocks=2, block_size=4)
    meta = case["meta"]
    assert isinstance(meta, SimpleAttentionMetadata) and meta.common_prefix_len_device is None
    plan = TritonAttentionBackend(cascade=ALWAYS).plan(meta, AttentionLayout.of(case["q"],
                                                                                case["cache"]))
    parts = plan.cascade_parts(case["q"], case["cache"])
    assert parts.prefix_len.tolist() == [8]
    assert parts.suffix_seq_lens.tolist() == [1, 4, 10, 17, 26, 41]
    table = meta.block_table_tensor
    assert torch.equal(parts.suffix_table[:, :3], table[:, 2:5])


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [128, 7])
def test_cascade_gpu_bf16_qwen3_shape(shared):
    """Qwen3-0.6B's attention (16 query / 8 KV heads x 128, block 16, bf16): a W3-like batch
    of 48 decodes on ``shared`` blocks plus a mixed batch, cascade == plain."""
    rng = random.Random(shared)
    decodes = [(rng.randint(50, 300), 1) for _ in range(48)]
    check_cascade(decodes, shared_blocks=shared, block_size=16, num_heads=16, num_kv_heads=8,
                  head_dim=128, dtype=torch.bfloat16, device="cuda", seed=shared, split=None)
    mixed = decodes[:20] + [(rng.randint(0, 100), rng.randint(2, 300)) for _ in range(6)]
    check_cascade(mixed, shared_blocks=shared, block_size=16, num_heads=16, num_kv_heads=8,
                  head_dim=128, dtype=torch.bfloat16, device="cuda", seed=shared + 1,
                  pad_tokens=5, split=None)
    # the default split policy on this shape (W3's decode prefix: 4 ranges at 256 rows)
    check_cascade(decodes, shared_blocks=shared, block_size=16, num_heads=16, num_kv_heads=8,
                  head_dim=128, dtype=torch.bfloat16, device="cuda", seed=shared + 2,
                  config=CascadeConfig(min_prefix_tokens=1, min_reqs=1, min_saved_us=0.0),
                  split=None)


@pytest.mark.gpu
def test_cascade_gpu_cuda_graph_replays_any_prefix():
    """A cascade plan captured in a CUDA graph (use_cascade baked, the prefix length read from
    the device scalar, host value 0 at capture) replays correctly for other prefix lengths
    written into that scalar (any number of the 8 shared blocks), equal to plain attention."""
    dev = "cuda"
    backend = TritonAttentionBackend(cascade=ALWAYS)
    case = make_shared_case([(40 + 3 * r, 1) for r in range(16)], shared_blocks=8,
                            block_size=16, num_heads=16, num_kv_heads=8, head_dim=128,
                            dtype=torch.bfloat16, device=dev)
    q, cache, meta = case["q"], case["cache"], case["meta"]
    reshape_and_cache_ref(case["k"], case["v"], cache[0], cache[1], meta.slot_mapping)
    plain = TritonAttentionBackend(cascade=None).forward_with_metadata(
        0, q, None, None, cache, meta, case["scale"])
    p_dev = torch.zeros(1, dtype=torch.int32, device=dev)
    meta.common_prefix_len, meta.common_prefix_len_device, meta.use_cascade = 0, p_dev, True
    lay = AttentionLayout.of(q, cache)
    static = {}

    def step():
        plan = backend.plan(meta, lay)
        assert plan.cascade
        static["out"] = backend.forward(0, q, None, None, cache, plan, case["scale"])

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for blocks in (8, 3, 1):
        static["out"].fill_(float("nan"))
        p_dev.fill_(blocks * 16)
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static["out"].float(), plain.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_cascade_gpu_concurrent_prefix_equals_serial_bitwise():
    """The prefix launch on its side stream (the default on CUDA) gives bitwise the output of
    the serial order, eagerly and as a CUDA graph whose two branches run concurrently: the
    graph replayed over new queries each time (a merge that ran before the prefix finished
    would read the previous replay's partials)."""
    import dataclasses

    dev = "cuda"
    serial = TritonAttentionBackend(cascade=dataclasses.replace(ALWAYS, concurrent_prefix=False))
    conc = TritonAttentionBackend(cascade=ALWAYS)
    rng = random.Random(3)
    case = make_shared_case([(rng.randint(20, 200), 1) for _ in range(64)], shared_blocks=32,
                            block_size=16, num_heads=16, num_kv_heads=8, head_dim=128,
                            dtype=torch.bfloat16, device=dev, seed=3)
    q, cache, meta, scale = case["q"], case["cache"], case["meta"], case["scale"]
    reshape_and_cache_ref(case["k"], case["v"], cache[0], cache[1], meta.slot_mapping)
    want = serial.forward_with_metadata(0, q, None, None, cache, meta, scale)
    got = conc.forward_with_metadata(0, q, None, None, cache, meta, scale)
    assert conc._side_streams and not serial._side_streams
    assert torch.equal(got, want)
    meta.common_prefix_len_device = torch.tensor([meta.common_prefix_len], dtype=torch.int32,
                                                 device=dev)
    lay = AttentionLayout.of(q, cache)
    static = {}

    def step():
        plan = conc.plan(meta, lay)
        assert plan.cascade
        static["out"] = conc.forward(0, q, None, None, cache, plan, scale)

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    gen = torch.Generator(device=dev).manual_seed(11)
    for _ in range(20):
        q.copy_(torch.randn(q.shape, generator=gen, device=dev, dtype=torch.float32).to(q.dtype))
        g.replay()
        want = serial.forward_with_metadata(0, q, None, None, cache, meta, scale)
        torch.cuda.synchronize()
        assert torch.equal(static["out"], want)
