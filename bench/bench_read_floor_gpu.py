"""How fast the H200 reads a decode call's K/V bytes when nothing else is asked of it: the
floor a paged decode kernel is measured against, at the sizes of the decode anchors.

For each shape, a contiguous bf16 buffer of the shape's K/V bytes (B x L positions x 8 KV
heads x 128 x 2 bytes x 2 for K and V) read by ``torch.sum`` (float32 accumulation: a
vendor reduction, one or two launches) and by ``torch.amax`` of a [rows, 128 x 1024] view
(every element read, one output per row), as CUDA-graph replays over 4 buffers (cold L2 for
the large ones), in microseconds and as a fraction of 4.27 TB/s; and one graph node of a
one-element kernel (the launch cost every kernel boundary of a decode call pays).

``--stream`` adds a plain streaming read (:func:`stream_sum`, a Triton kernel: ``programs``
programs each summing one contiguous share of the buffer in ``block``-element loads, one
float32 partial a program; twin: ``torch.sum`` of the same shares) at several grid sizes: how
close to the bytes' time a one-launch read of exactly a decode call's bytes can get, with no
paging, no products and no softmax.

    python3 bench/bench_read_floor_gpu.py --out read_floor.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_attention_gpu import time_graph  # noqa: E402
from pagedkv.attention._triton_common import interpreted  # noqa: E402
from pagedkv.tools.benchmark import environment  # noqa: E402

BW = 4.27e12
SHAPES = [(1, 512), (1, 2048), (1, 8192), (8, 8192), (64, 2048), (64, 8192)]
STREAM_PROGRAMS = (132, 264, 528, 660, 1056, 2112)  # 1, 2, 4, 5, 8, 16 an H200 SM
STREAM_BLOCKS = (2048, 8192)  # elements a load (4 / 16 KB of bf16 a program an iteration)


@triton.jit
def _stream_sum_kernel(x_ptr, out_ptr, share, n, BLOCK: tl.constexpr, RANGE_LOOP: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * share
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    if RANGE_LOOP:  # compiled
        for i in range(0, share, BLOCK):
            idx = start + i + offs
            acc += tl.load(x_ptr + idx, mask=(i + offs < share) & (idx < n),
                           other=0.0).to(tl.float32)
    else:  # the interpreter cannot iterate a range over runtime scalars
        i = 0
        while i < share:
            idx = start + i + offs
            acc += tl.load(x_ptr + idx, mask=(i + offs < share) & (idx < n),
                           other=0.0).to(tl.float32)
            i += BLOCK
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def stream_sum(x: torch.Tensor, programs: int, block: int, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """float32 sums of ``programs`` contiguous shares of the flat tensor ``x`` (the last share
    may be short), one Triton program a share."""
    n = x.numel()
    share = -(-n // programs)
    out = torch.empty(programs, dtype=torch.float32, device=x.device) if out is None else out
    _stream_sum_kernel[(programs,)](x, out, share, n, BLOCK=block,
                                    RANGE_LOOP=not interpreted(_stream_sum_kernel), num_warps=4)
    return out


def stream_sum_ref(x: torch.Tensor, programs: int) -> torch.Tensor:
    """:func:`stream_sum`'s twin: ``torch.sum`` of each share in float32."""
    flat = x.reshape(-1).float()
    share = -(-flat.numel() // programs)
    return torch.stack([flat[p * share:(p + 1) * share].sum() for p in range(programs)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="read_floor.json")
    p.add_argument("--stream", action="store_true", help="also the Triton streaming read")
    p.add_argument("--shapes", default=None, help="B/L pairs, e.g. 1/8192,2/8192 (default: all)")
    args = p.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in x.split("/"))
                                             for x in args.shapes.split(",")]
    rec = {"environment": environment(), "shapes": {}}
    one = torch.zeros(1, device="cuda")
    rec["tiny_node_us"] = time_graph([lambda: one.add_(1)])
    print(f"one graph node of a one-element kernel: {rec['tiny_node_us']:.2f} us", flush=True)
    for b, length in shapes:
        nbytes = b * length * 8 * 128 * 2 * 2
        n = nbytes // 2
        bufs = [torch.randn(n, device="cuda").bfloat16() for _ in range(4)]
        rows = n // (128 * 1024)
        s = time_graph([lambda x=x: torch.sum(x, dtype=torch.float32) for x in bufs])
        m = time_graph([lambda x=x: torch.amax(x.view(rows, -1), dim=1) for x in bufs])
        floor = nbytes / BW * 1e6
        rec["shapes"][f"B{b}/L{length}"] = {"bytes": nbytes, "floor_us": floor, "sum_us": s,
                                            "amax_rows_us": m}
        print(f"B{b}/L{length}: {nbytes / 1e6:7.1f} MB, bytes at 4.27 TB/s {floor:7.2f} us | "
              f"torch.sum {s:7.2f} us ({floor / s:4.0%}) | amax of rows {m:7.2f} us "
              f"({floor / m:4.0%})", flush=True)
        if args.stream:
            stream = {}
            for progs in STREAM_PROGRAMS:
                for block in STREAM_BLOCKS:
                    got = stream_sum(bufs[0], progs, block)
                    ref = stream_sum_ref(bufs[0], progs)
                    err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
                    assert err < 1e-3, (progs, block, err)
                    outs = [torch.empty(progs, dtype=torch.float32, device="cuda") for _ in bufs]
                    t = time_graph([lambda x=x, o=o, pr=progs, bl=block: stream_sum(x, pr, bl, o)
                                    for x, o in zip(bufs, outs)])
                    stream[f"{progs}x{block}"] = t
            best = min(stream, key=stream.get)
            rec["shapes"][f"B{b}/L{length}"]["stream_us"] = stream
            print("      stream " + "  ".join(f"{k}:{v:.2f}" for k, v in stream.items())
                  + f" | best {best} {stream[best]:.2f} us ({floor / stream[best]:4.0%})", flush=True)
        del bufs
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
