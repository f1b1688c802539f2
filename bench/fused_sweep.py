"""The sweep loop the fused decode-projection benches share (``bench_qkv_rope_gpu.py``,
``bench_gate_up_silu_gpu.py``): the unfused calls timed once, then each launch config of the
fused kernel checked against the unfused output and timed, all as 28-layer CUDA graphs."""

from __future__ import annotations

from bench_attention_gpu import time_graph


def sweep(m: int, unfused_calls, fused_calls, check, configs, trials: int) -> dict:
    """``unfused_calls``: the layers' no-arg callables without the fusion; ``configs``: ``(name,
    config)`` pairs; ``fused_calls(config)``: the layers' callables with it; ``check(config)``
    raises when layer 0's fused output differs from the unfused one. Returns ``{"m", "unfused_us",
    "fused": {name: us or the error}, "best"}`` (us per layer)."""
    row = {"m": m, "unfused_us": time_graph(unfused_calls, trials=trials), "fused": {}}
    for name, cfg in configs:
        try:
            check(cfg)
            row["fused"][name] = time_graph(fused_calls(cfg), trials=trials)
        except Exception as e:  # a config that does not compile or fit
            row["fused"][name] = f"{type(e).__name__}: {str(e)[:120]}"
    timed = {k: v for k, v in row["fused"].items() if isinstance(v, float)}
    row["best"] = min(timed, key=timed.get) if timed else None
    best = timed.get(row["best"], float("nan"))
    print(f"M={m:4d} unfused {row['unfused_us']:6.2f} us/layer | best fused {row['best']} "
          f"{best:6.2f}", flush=True)
    return row


def effective_block_m(block_m: int, rows: int) -> int:
    """The row tile a launch of ``rows`` rows uses for a config's ``block_m`` (the launchers
    cap it at the rows' power of two, at least 16)."""
    return min(block_m, max(16, 1 << max(rows - 1, 0).bit_length()))
