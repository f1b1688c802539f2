"""Where a step's time goes: device kernels of a ``torch.profiler`` window by class.

``kernel_class(name)`` sorts a CUDA kernel's name into the classes issue 13 asks for: ``gemm``
(cuBLAS / CUTLASS / nvjet / Triton matmul kernels), ``attention`` (the paged decode / prefill /
MLA / cascade-merge kernels), ``norm_rope`` (RMSNorm, RoPE, the fused q/k-norm + RoPE + KV-write
kernel, the KV writer), ``activation`` (SiLU-and-mul, GeLU), ``moe`` (routing, expert sorting,
the fused-MoE GEMMs), ``sampling`` (argmax, softmax, top-k / top-p, the sampler's gathers),
``index`` (slot mappings, block tables, page indices), ``copy`` (memcpy / memset / fills /
copies), ``elementwise`` (torch's and inductor's fused pointwise kernels not named otherwise;
an inductor kernel with ``rsqrt`` is an RMSNorm: ``norm_rope``), ``other``.

``decode_step_fit(steps, bytes_per_token)``: a decode step's time as a line in its context
tokens (least squares over the steps): the fixed cost a step and the cost a context token, as
a bandwidth for the K/V bytes that token has.

``breakdown(events, wall_s, steps)``: the window's device time per class (self time of the
device kernels; ``events`` from ``prof.key_averages()`` or any iterable of objects with
``key`` and ``self_device_time_total`` in microseconds, or ``(name, us)`` pairs), the device
busy time, the wall time and what the device was idle (the host's share, from the device's
view), all per step.
"""

from __future__ import annotations

import re

CLASSES = ("gemm", "attention", "norm_rope", "activation", "moe", "sampling", "index", "copy",
           "elementwise", "other")

# first match wins: the specific kernels before the generic patterns
_RULES = (
    ("moe", r"fused_moe|moe_align|expert|topk_softmax|grouped_gemm"),
    ("attention", r"paged_(decode|prefill)|_decode_kernel|_decode_reduce|_prefill_kernel|"
                  r"mla_|flash|fmha|attention|merge_kernel|_merge|sparse_mla|dsa_"),
    ("norm_rope", r"rms|norm|rsqrt|rope|rotary|qk_norm|reshape_and_cache|kv_write|_write_kv"),
    ("activation", r"silu|gelu|act_and_mul|swiglu"),
    ("index", r"slot_mapping|block_table|page_ind|step_indices|_csr|compressed_slot"),
    ("sampling", r"argmax|softmax|topk|top_k|top_p|sample|gumbel|multinomial|sort|cumsum|"
                 r"penalt|logprob"),
    ("gemm", r"gemm|cutlass|cublas|nvjet|sm90_xmma|sm80_xmma|wgmma|_mm_|matmul|splitk|"
             r"ampere_|hopper_|dot_kernel"),
    ("elementwise", r"triton_poi|triton_red|triton_per"),  # inductor's fused kernels
    ("copy", r"memcpy|memset|copy|cat_|catarray|fill|index_select|gather|scatter"),
    ("elementwise", r"elementwise|vectorized|reduce_kernel|unrolled"),
)
_COMPILED = [(c, re.compile(p, re.IGNORECASE)) for c, p in _RULES]


def kernel_class(name: str) -> str:
    """The class of a device kernel named ``name`` (see the module docstring)."""
    for cls, pat in _COMPILED:
        if pat.search(name):
            return cls
    return "other"


# host-side entries of ``key_averages()`` that carry device time of kernels listed on their
# own as well (on the H200 ``aten::mm`` shows its cuBLAS kernel's time as self time, and
# ``cuLaunchKernelEx`` a launch's): counting them would count those kernels twice
_HOST_ENTRY = re.compile(r"^(aten::|cuda[A-Z]|cu[A-Z]|Torch-Compiled Region|## )")


def is_host_entry(name: str) -> bool:
    """Whether a profiler entry is a host op / runtime call, not a device kernel."""
    return bool(_HOST_ENTRY.match(name))


def is_device_event(e) -> bool:
    """Whether a ``key_averages()`` entry is a device kernel / copy: its ``device_type`` is not
    the CPU. A host entry's self device time is that of the kernels it launched, which are
    entries of their own: a Triton kernel launched from a compiled region shows up as the host
    launch record (``_silu_and_mul_kernel``, ``triton_per_fused_...``) and as the kernel
    (``_silu_and_mul_kernel_0``), both with its time. Entries without a device type (``(name,
    us)`` pairs) are kernels unless :func:`is_host_entry` says otherwise."""
    dt = getattr(e, "device_type", None)
    if dt is not None:
        return str(dt).rsplit(".", 1)[-1] != "CPU"
    name = e[0] if isinstance(e, tuple) else e.key
    return not is_host_entry(name)


def breakdown(events, wall_s: float, steps: int) -> dict:
    """Per step: microseconds of device time by class, the busy total, the wall time and the
    idle time (``wall - busy``: the host's share as the device sees it); fractions of the
    busy time by class. Host entries (:func:`is_device_event`: torch ops, CUDA runtime / driver
    calls, compiled-region markers, Triton launch records) are left out: their device time is
    their kernels'."""
    by = dict.fromkeys(CLASSES, 0.0)
    for e in events:
        name, us = (e if isinstance(e, tuple) else (e.key, e.self_device_time_total))
        if us and is_device_event(e):
            by[kernel_class(name)] += float(us)
    steps = max(1, int(steps))
    busy = sum(by.values())
    wall_us = wall_s * 1e6
    return {"steps": steps,
            "us_per_step": {k: v / steps for k, v in by.items()},
            "busy_us_per_step": busy / steps, "wall_us_per_step": wall_us / steps,
            "idle_us_per_step": max(0.0, wall_us - busy) / steps,
            "fraction_of_busy": {k: (v / busy if busy else 0.0) for k, v in by.items()}}


def format_breakdown(label: str, b: dict) -> str:
    """One line per class (us per step, share of the device's busy time) under a header."""
    lines = [f"{label}: {b['steps']} steps, wall {b['wall_us_per_step']:.0f} us/step, device "
             f"busy {b['busy_us_per_step']:.0f}, idle {b['idle_us_per_step']:.0f}"]
    for k in CLASSES:
        us = b["us_per_step"][k]
        if us:
            lines.append(f"  {k:<12} {us:9.1f} us  {100 * b['fraction_of_busy'][k]:5.1f}%")
    return "\n".join(lines)


def decode_step_fit(steps, bytes_per_token: int | None = None) -> dict:
    """Least squares ``dt = fixed + per_token x ctx`` over decode steps (dicts with ``dt``
    seconds and ``ctx`` context tokens; steps with ``dt`` None are left out). Returns the
    fixed milliseconds a step, the nanoseconds a context token, the steps fitted, the run's
    decode seconds split into the fixed part (``fixed x steps``) and the rest, and, with
    ``bytes_per_token`` (the K and V bytes of one token over all layers), the bandwidth that
    per-token cost reads them at (TB/s). Needs two distinct context sizes."""
    pts = [(float(s["ctx"]), float(s["dt"])) for s in steps if s.get("dt") is not None]
    n = len(pts)
    if n < 2:
        raise ValueError("decode_step_fit: need at least two steps")
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        raise ValueError("decode_step_fit: every step has the same context size")
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    fixed = my - slope * mx
    out = {"steps": n, "fixed_ms": 1e3 * fixed, "ns_per_token": 1e9 * slope,
           "fixed_s_total": fixed * n, "per_token_s_total": slope * mx * n,
           "decode_s": my * n}
    if bytes_per_token:
        out["tb_per_s"] = bytes_per_token / slope / 1e12 if slope > 0 else float("inf")
    return out


__all__ = ["CLASSES", "breakdown", "decode_step_fit", "format_breakdown", "is_device_event",
           "kernel_class"]


GAP_BUCKETS_US = (2.0, 5.0, 20.0, 100.0)  # upper edges; the last bucket is open


def device_gaps(trace: dict, steps: int, top: int = 10) -> dict:
    """Where the device sat idle inside a chrome trace (``prof.export_chrome_trace``'s JSON):
    the device events (``cat`` kernel / gpu_memcpy / gpu_memset) in start order, the idle
    time between the end of everything before an event and its start. Per step: the idle
    microseconds by gap length (``<2``, ``2-5``, ``5-20``, ``20-100``, ``>=100`` us: short gaps
    are launch-to-launch latency inside a CUDA graph, long ones a device waiting for the host),
    the gap count, and the ``top`` longest gaps with the events on either side."""
    evs = sorted((e for e in trace.get("traceEvents", [])
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: float(e["ts"]))
    labels = [f"<{GAP_BUCKETS_US[0]:g}"] + [f"{a:g}-{b:g}" for a, b in
                                            zip(GAP_BUCKETS_US, GAP_BUCKETS_US[1:])] \
        + [f">={GAP_BUCKETS_US[-1]:g}"]
    by = dict.fromkeys(labels, 0.0)
    count = dict.fromkeys(labels, 0)
    gaps = []
    end = None
    prev = None
    for e in evs:
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        if end is not None and ts > end:
            g = ts - end
            i = sum(g >= b for b in GAP_BUCKETS_US)
            by[labels[i]] += g
            count[labels[i]] += 1
            gaps.append((g, prev, e["name"]))
        end = ts + dur if end is None else max(end, ts + dur)
        prev = e["name"]
    gaps.sort(key=lambda x: -x[0])
    n = max(int(steps), 1)
    return {"idle_us_per_step": {k: v / n for k, v in by.items()},
            "gaps_per_step": {k: v / n for k, v in count.items()},
            "events_per_step": len(evs) / n,
            "top": [{"us": g, "after": a, "before": b} for g, a, b in gaps[:top]]}


def format_gaps(label: str, g: dict) -> str:
    """The idle time by gap length and the longest gaps, one line each."""
    lines = [f"{label}: {g['events_per_step']:.0f} device events per step; idle us per step by "
             "gap length: " + ", ".join(f"{k} us: {v:.0f} ({g['gaps_per_step'][k]:.0f} gaps)"
                                        for k, v in g["idle_us_per_step"].items())]
    for t in g["top"]:
        lines.append(f"  {t['us']:8.1f} us after {t['after'][:60]!r} before {t['before'][:60]!r}")
    return "\n".join(lines)
