"""A stand-in engine process for the serving front's CPU benchmark (bench_serve_front_cpu.py).

It speaks the engine-core pipe protocol of ``pagedkv.entrypoints.engine_core`` (the front
starts it with ``EngineCoreClient(engine_module="bench.synthetic_engine")``): it answers
``("ready", info)``, applies ``add`` / ``abort`` / ``stats`` / ``stop`` commands, and every
``step_ms`` milliseconds, while requests run, sends one ``("outs", deltas, gauges)`` message
with one :class:`~pagedkv.engine.outputs.OutputDelta` per running request (one token each,
finished with ``"length"`` at the request's ``max_tokens``) - the message a real engine step
sends, on a fixed clock and with no model behind it.

Token ``k`` of every request is id ``synthetic_token(k)``; its text is ``" t<id>"`` (what the
synthetic word-level tokenizer of a ``--shape`` server decodes), so a client can check the
text it got. Configured by the environment variable ``PAGEDKV_SYNTHETIC_ENGINE`` (JSON:
``step_ms``, ``vocab_size``, ``max_model_len``), which the front's environment passes on.
Its gauges count the steps it made (``synthetic_steps``: on a loaded machine it may step
slower than asked) and the seconds its step messages took to send (``synthetic_send_s``: a
front that does not read fast enough blocks the engine there).
"""

from __future__ import annotations

import json
import os
import sys
import time

from pagedkv.engine.outputs import OutputDelta
from pagedkv.sampling.params import SamplingParams

ENV = "PAGEDKV_SYNTHETIC_ENGINE"
DEFAULTS = {"step_ms": 10.0, "vocab_size": 32000, "max_model_len": 4096}


def synthetic_token(k: int, vocab_size: int) -> int:
    """The id of every request's ``k``-th output token."""
    return (k * 7919 + 13) % vocab_size


def synthetic_text(k: int, vocab_size: int) -> str:
    return f" t{synthetic_token(k, vocab_size)}"


def config() -> dict:
    cfg = dict(DEFAULTS)
    cfg.update(json.loads(os.environ.get(ENV, "{}")))
    return cfg


def synthetic_engine_main(spec, conn) -> None:
    """The child's main (``engine_core._child_main(address, synthetic_engine_main)``)."""
    cfg = config()
    step_s = float(cfg["step_ms"]) / 1e3
    vocab = int(cfg["vocab_size"])
    conn.send(("ready", dict(
        vocab_size=vocab, max_model_len=int(cfg["max_model_len"]),
        default_params=SamplingParams(), sizing="synthetic engine (no model)",
        model_name=spec.shape or spec.model, num_blocks=1, pid=os.getpid())))
    reqs: dict[str, list] = {}  # id -> [max_tokens, generated, t_sched, t_first]
    tokens = steps = 0
    blocked = 0.0  # seconds spent in conn.send of step messages (the front not reading)
    texts = [synthetic_text(k, vocab) for k in range(int(cfg["max_model_len"]))]

    def gauges() -> dict:
        return dict(running=len(reqs), waiting=0, kv_usage=0.0, queries=0, hits=0,
                    preemptions=0, tokens=tokens, failed=0, group_usage=None, free_blocks=1,
                    num_blocks=1, unfinished=bool(reqs), synthetic_steps=steps,
                    synthetic_send_s=blocked)

    next_step = time.monotonic()
    try:
        while True:
            timeout = None if not reqs else max(0.0, next_step - time.monotonic())
            if conn.poll(timeout):
                while conn.poll(0):
                    cmd = conn.recv()
                    kind = cmd[0]
                    if kind == "add":
                        _, rid, (_, _, params) = cmd
                        if not reqs:
                            next_step = time.monotonic() + step_s
                        reqs[rid] = [params.max_tokens, 0, time.monotonic(), None]
                    elif kind == "abort":
                        reqs.pop(cmd[1], None)
                    elif kind == "stats":
                        conn.send(("stats", cmd[1], gauges()))
                    elif kind == "stop":
                        return
                continue
            now = time.monotonic()
            deltas = []
            for rid, r in list(reqs.items()):
                k = r[1]
                r[1] = k + 1
                if r[3] is None:
                    r[3] = now
                done = r[1] >= r[0]
                if done:
                    del reqs[rid]
                deltas.append(OutputDelta((
                    rid, [synthetic_token(k, vocab)],
                    texts[k] if k < len(texts) else synthetic_text(k, vocab), None, None,
                    "length" if done else None, None, r[2], r[3], now, now if done else None,
                    0, 0)))
            tokens += len(deltas)
            steps += 1
            t_send = time.monotonic()
            conn.send(("outs", deltas, gauges()))
            blocked += time.monotonic() - t_send
            next_step += step_s
            if next_step < now:  # fell behind (a loaded machine): keep the period from now
                next_step = now + step_s
    except (EOFError, OSError):  # the front went away
        pass


if __name__ == "__main__":
    from pagedkv.entrypoints.engine_core import _child_main

    _child_main(sys.argv[1], synthetic_engine_main)
