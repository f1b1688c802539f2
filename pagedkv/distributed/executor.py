"""The driver's side of tensor parallelism: worker processes behind the runner's interface.

``TensorParallelExecutor`` starts one worker process per rank (``multiprocessing`` spawn,
``pagedkv.distributed.worker``), agrees on the pool (every rank sizes its shard's KV cache;
the scheduler gets the minimum) and then stands where the engine's ``ModelRunner`` stands:
``execute_model_async`` sends the step's ``SchedulerOutput`` to every rank, ``get_output``
returns rank 0's ``RunnerOutput``; the scheduler and the output processing stay in this
process (``LLMEngine`` unchanged).

Failures: every call waits for every rank's answer, polling the worker processes. A rank that
exits (killed, crashed) or reports an exception fails the call with ``WorkerError`` naming the
rank, its exit code or its exception, and the traceback; a rank that does not answer within
``distributed_timeout_s`` (a hang, or a peer stuck in a collective) fails it as hung (start-up:
at least ``STARTUP_TIMEOUT_S``, for loading and profiling). The
workers are then stopped and the engine refuses further calls with the same error
(``WorkerError``), instead of hanging.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import socket
import time
from typing import Any

from pagedkv.errors import WorkerError


@dataclasses.dataclass
class RemoteModel:
    """The driver's handle on the model the ranks hold: its config (vocabulary, EOS ids) for
    the engine's request checks, its dtype; ``compiled`` as the shards are (eager)."""

    config: Any
    dtype: Any = None
    compiled: bool = False


class _Graphs:
    def __init__(self, sizes):
        self.sizes = tuple(sizes)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelExecutor:
    """``world_size`` worker processes serving the runner interface the engine calls
    (``execute_model_async`` / ``get_output`` / ``execute_model`` / ``reset_requests`` /
    ``eos_token_ids`` / the step counters)."""

    POLL_S = 0.02
    STARTUP_TIMEOUT_S = 1800.0

    def __init__(self, spec, world_size: int):
        from pagedkv.distributed.worker import worker_main

        self.world_size = world_size
        self.timeout_s = float(spec.engine_config.distributed_timeout_s)
        self._error: WorkerError | None = None
        self._seq = 0
        self.step_check = None
        self.num_steps = 0
        self.num_graph_steps = 0
        self._eos: tuple = ()
        ctx = mp.get_context("spawn")
        init = f"tcp://127.0.0.1:{_free_port()}"
        self._conns, self._procs = [], []
        try:
            for rank in range(world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=worker_main, args=(rank, world_size, init, child, spec),
                                   name=f"pagedkv-tp{rank}", daemon=True)
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            # start-up (imports, loading, profiling, graph capture) may take minutes
            startup = max(self.timeout_s, self.STARTUP_TIMEOUT_S)
            blocks = self._collect(-1, all_values=True, timeout_s=startup)
            for c in self._conns:
                c.send(min(blocks))
            plan, self.block_size, sizes = self._collect(-1, timeout_s=startup)
        except BaseException:
            self.shutdown()
            raise
        self.plan = plan
        self.cuda_graphs = None if sizes is None else _Graphs(sizes)
        # rank 0's device and pool (what engine-level reports and the memory registry read)
        import torch

        self.device = (torch.device("cuda", 0) if spec.device_type == "cuda"
                       else torch.device("cpu"))
        self.kv_cache_bytes = plan.sizing.kv_cache_bytes

    # ---- the runner interface ----------------------------------------------------------
    def execute_model_async(self, scheduler_output) -> int:
        seq = self._call("exec", scheduler_output)
        self.num_steps += 1
        return seq

    def get_output(self, handle: int):
        out, graph_steps = self._call_value("get", handle)
        self.num_graph_steps += graph_steps
        return out

    def execute_model(self, scheduler_output):
        return self.get_output(self.execute_model_async(scheduler_output))

    def reset_requests(self) -> None:
        self._call("reset", None)

    def synchronize(self) -> None:
        """Nothing to wait for here: every answer the engine read came after the ranks' work
        (``get_output`` returns once rank 0 synchronized)."""

    def capture_cuda_graphs(self) -> int:
        """Done by every rank at start-up; the number of graph sizes."""
        return 0 if self.cuda_graphs is None else len(self.cuda_graphs.sizes)

    @property
    def eos_token_ids(self) -> tuple:
        return self._eos

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self._eos = tuple(ids)
        self._call("eos", self._eos)

    # ---- calls -------------------------------------------------------------------------
    def _call(self, kind: str, arg) -> int:
        self._call_value(kind, arg)
        return self._seq

    def _call_value(self, kind: str, arg):
        if self._error is not None:
            raise self._error
        self._seq += 1
        seq = self._seq
        for rank, c in enumerate(self._conns):
            try:
                c.send((kind, seq, arg))
            except (BrokenPipeError, EOFError, OSError):
                self._fail(rank, self._died_text(rank))
        return self._collect(seq)

    def _collect(self, seq: int, all_values: bool = False, timeout_s: float | None = None):
        """Every rank's answer to call ``seq`` (answers of older calls, left by an interrupted
        one, are dropped); rank 0's value, or every rank's with ``all_values``."""
        values: list = [None] * self.world_size
        pending = set(range(self.world_size))
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while pending:
            progressed = False
            for rank in sorted(pending):
                c = self._conns[rank]
                while c.poll():
                    try:
                        msg = c.recv()
                    except (EOFError, OSError):
                        self._fail(rank, self._died_text(rank))
                    if msg[0] == "error":
                        # a peer's death (the root cause) first: its collective partner
                        # may notice before this process sees the exit
                        dead = self._dead_rank(exclude=rank)
                        text = msg[2] if dead is None else (
                            f"{self._died_text(dead)}; then {msg[2]}")
                        self._fail(rank, text, msg[4], msg[3])
                    if msg[1] == seq:
                        values[rank] = msg[2]
                        pending.discard(rank)
                        progressed = True
                        break
            if not pending:
                break
            for rank, p in enumerate(self._procs):
                if p.exitcode is not None and not self._conns[rank].poll():
                    self._fail(rank, self._died_text(rank))
            if time.monotonic() > deadline:
                ranks = ", ".join(map(str, sorted(pending)))
                self._fail(min(pending), f"rank{'s' if len(pending) > 1 else ''} {ranks} did "
                           f"not answer within {timeout_s:g} s (distributed_timeout_s; hung, "
                           "or waiting in a collective for a rank that is)")
            if not progressed:
                self._conns[min(pending)].poll(self.POLL_S)
        return values if all_values else values[0]

    def _dead_rank(self, exclude: int, grace_s: float = 0.5) -> int | None:
        """A rank other than ``exclude`` whose process exited (waiting up to ``grace_s``)."""
        deadline = time.monotonic() + grace_s
        while True:
            for r, p in enumerate(self._procs):
                if r != exclude and p.exitcode is not None:
                    return r
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    def _died_text(self, rank: int) -> str:
        p = self._procs[rank]
        p.join(timeout=1.0)
        return f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"

    def _fail(self, rank: int, text: str, tb: str | None = None, config_error=None) -> None:
        """Stop every worker and raise: the rank's ``ConfigError`` as itself (bad options,
        found while a rank planned its pool), anything else as ``WorkerError``."""
        msg = f"tensor-parallel worker failed: {text}"
        if tb:
            msg += f"\n--- the rank's traceback ---\n{tb}"
        self._error = WorkerError(msg)
        self.shutdown()
        if config_error is not None:
            raise config_error
        raise self._error

    # ---- life cycle --------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every worker (a polite ``stop``, then terminate / kill what is left)."""
        procs, self._procs = self._procs, []
        conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.send(("stop", -2, None))
            except Exception:
                pass
        deadline = time.monotonic() + 5.0
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        for c in conns:
            try:
                c.close()
            except Exception:
                pass
        if self._error is None and procs:
            self._error = WorkerError("the tensor-parallel workers were shut down")

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]


def scheduler_view_for_dcp(plan, dcp: int):
    """A rank's plan as the driver's scheduler sees it under decode context parallelism: a
    block spans ``block_size * dcp`` tokens (``dcp_scheduler_groups``; the rank's sizing is
    already in those units)."""
    from pagedkv.core.spec import KVCacheConfig
    from pagedkv.engine.llm_engine import dcp_scheduler_groups

    kv = KVCacheConfig(num_blocks=plan.kv.num_blocks,
                       kv_cache_groups=dcp_scheduler_groups(plan.kv.kv_cache_groups, dcp))
    cc = dataclasses.replace(plan.cc, block_size=plan.cc.block_size * dcp)
    return dataclasses.replace(plan, kv=kv, cc=cc)


def build_tensor_parallel_engine(model_dir: str | None, tokenizer, config, ec, *, dtype, device,
                                 attention_backend, generation_defaults=None,
                                 shape: str | None = None):
    """An ``LLMEngine`` whose runner is a :class:`TensorParallelExecutor` over
    ``ec.tensor_parallel_size`` ranks of ``model_dir``, or of the named ``shape`` with random
    weights (``model_dir=None``; each rank builds its shard, ``random_shard``) (``config``: its
    ``ModelArchConfig``, checked by ``check_tensor_parallel`` before any process starts)."""
    import torch

    from pagedkv.distributed.shard import check_tensor_parallel
    from pagedkv.distributed.worker import WorkerSpec
    from pagedkv.engine.llm_engine import assemble_engine

    world, dcp = ec.tensor_parallel_size, ec.decode_context_parallel_size
    check_tensor_parallel(config, world, dcp=dcp)
    if dcp > 1 and (attention_backend in ("triton", "triton+cudnn") or (attention_backend == "auto"
                                                      and device.type == "cuda")
                    or not isinstance(attention_backend, str)):
        from pagedkv.errors import ConfigError

        raise ConfigError("decode_context_parallel_size > 1 runs the torch reference attention "
                          "(attention_backend='torch_ref'); the Triton kernels have no DCP "
                          "merge yet")
    if device.type == "cuda" and torch.cuda.device_count() < world:
        from pagedkv.errors import ConfigError

        raise ConfigError(f"tensor_parallel_size={world} needs {world} GPUs; "
                          f"{torch.cuda.device_count()} visible")
    spec = WorkerSpec(model_dir=model_dir, dtype=dtype, device_type=device.type,
                      attention_backend=attention_backend, engine_config=ec,
                      num_threads=max(1, torch.get_num_threads() // world), shape=shape)
    executor = TensorParallelExecutor(spec, world)
    try:
        # the ranks planned with the agreed block count as an override; the engine reports
        # the options it was given
        plan = dataclasses.replace(executor.plan, ec=ec.resolved(device))
        if dcp > 1:
            plan = scheduler_view_for_dcp(plan, dcp)
        from pagedkv.models.loader import resolve_dtype

        return assemble_engine(RemoteModel(config, resolve_dtype(dtype, config)), tokenizer,
                               plan, executor,
                               generation_defaults=generation_defaults)
    except BaseException:
        executor.shutdown()
        raise


__all__ = ["RemoteModel", "TensorParallelExecutor", "WorkerError", "build_tensor_parallel_engine",
           "scheduler_view_for_dcp"]
