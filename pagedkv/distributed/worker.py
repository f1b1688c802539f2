"""One tensor-parallel rank: a worker process started by ``TensorParallelExecutor``.

Start-up (each step answered on the rank's pipe to the driver):

1. join the process group (``init_method``: a TCP rendezvous on the driver's host; gloo on
   CPU, NCCL on ``cuda:rank``; NVLink multicast off: ``NCCL_NVLS_ENABLE=0``,
   ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``), load the checkpoint on the CPU and keep this
   rank's shard (``shard_decoder``) on the rank's device; or, for a named shape
   (``LLM.from_shape``), build the shard at its local sizes on the device with random weights
   (``random_shard``: not a cut of the one-process random model, see there);
2. size the shard's KV pool (``plan_engine``: on a GPU it profiles, every rank in step since
   the profile's forward pass all-reduces) and send the block count;
3. receive the count every rank can hold (the minimum), build its ``ModelRunner`` on a pool of
   that many blocks, capture its CUDA graphs, send its plan.

Then it serves the driver's calls in order, each ``(kind, seq, arg)`` answered by ``("ok",
seq, value)`` (``value`` only from rank 0, None elsewhere) or ``("error", seq, text,
config_error, traceback)`` after which the worker exits (a collective may be half done): ``exec`` (``execute_model_async`` of
a ``SchedulerOutput``; its handle kept under ``seq``), ``get`` (``get_output`` of an earlier
``exec``'s handle), ``eos`` (the EOS ids), ``reset`` (``reset_requests``), ``stop``.
Every rank applies every ``SchedulerOutput`` and samples from the same gathered logits with
the same seed, so their persistent batches and sampled tokens agree; rank 0 reports.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank is told: the checkpoint (``model_dir``) or a named shape with random
    weights (``shape``; one of them), its dtype, the device kind, the attention backend (a
    name or a picklable backend), the engine options, torch threads per rank."""

    model_dir: str | None
    dtype: Any
    device_type: str
    attention_backend: Any
    engine_config: Any
    num_threads: int = 1
    shape: str | None = None

    def __post_init__(self) -> None:
        if (self.model_dir is None) == (self.shape is None):
            from pagedkv.errors import ConfigError

            raise ConfigError("a WorkerSpec names a checkpoint directory or a shape (one of them)")


def worker_main(rank: int, world_size: int, init_method: str, conn, spec: WorkerSpec) -> None:
    """The worker process's entry point (``multiprocessing`` spawn target)."""
    for k, v in MULTICAST_OFF.items():
        os.environ.setdefault(k, v)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec.num_threads)
    seq = -1
    try:
        from pagedkv.distributed.group import TPGroup
        from pagedkv.distributed.shard import random_shard, shard_decoder
        from pagedkv.engine.llm_engine import make_attention_backend, plan_engine
        from pagedkv.models.config import shape_config
        from pagedkv.models.loader import load_model, resolve_dtype
        from pagedkv.worker.model_runner import ModelRunner

        ec = spec.engine_config
        cuda = spec.device_type == "cuda"
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank,
                                world_size=world_size,
                                # the driver detects hangs (distributed_timeout_s) and stops
                                # every rank; this bounds a rendezvous or a collective alone
                                timeout=timedelta(seconds=max(ec.distributed_timeout_s, 600)))
        tp = TPGroup(rank, world_size)
        backend = make_attention_backend(spec.attention_backend, device)
        dcp = ec.decode_context_parallel_size
        cp = dict(cp_world_size=dcp, cp_rank=rank % dcp, cp_interleave=ec.dcp_kv_cache_interleave_size)
        if dcp > 1:
            backend.dcp = _dcp_group(rank, world_size, dcp, ec.dcp_kv_cache_interleave_size)
        torch.manual_seed(ec.seed)
        if spec.shape is not None:
            cfg = shape_config(spec.shape)
            model = random_shard(cfg, tp, backend=backend, dtype=resolve_dtype(spec.dtype, cfg),
                                 device=device, dcp=dcp, seed=ec.seed)
        else:
            full = load_model(spec.model_dir, dtype=spec.dtype, device="cpu", backend=backend,
                              max_model_len=ec.max_model_len)
            model = shard_decoder(full, tp, device=device, dcp=dcp)
            del full
        first = plan_engine(model, ec)
        conn.send(("ok", seq, first.sizing.num_blocks))
        num_blocks = conn.recv()
        plan = plan_engine(model, dataclasses.replace(ec, num_gpu_blocks_override=num_blocks))
        plan = dataclasses.replace(plan, sizing=dataclasses.replace(
            plan.sizing, source=f"{first.sizing.source}, min over {world_size} ranks",
            budget_bytes=first.sizing.budget_bytes,
            peak_activation_bytes=first.sizing.peak_activation_bytes,
            total_device_bytes=first.sizing.total_device_bytes,
            used_device_bytes=first.sizing.used_device_bytes))
        runner = ModelRunner(model, plan.kv, plan.sc, plan.cc, device=device, seed=ec.seed,
                             enforce_eager=not plan.graphs, cuda_graph_sizes=ec.cuda_graph_sizes,
                             mixed_cuda_graphs=ec.mixed_cuda_graphs,
                             **cp)
        runner.capture_cuda_graphs()
        sizes = None if runner.cuda_graphs is None else list(runner.cuda_graphs.sizes)
        conn.send(("ok", seq, (plan, runner.block_size, sizes)))
        _serve(rank, conn, runner)
    except BaseException as e:  # reported to the driver, which fails the engine
        from pagedkv.errors import ConfigError

        try:  # a ConfigError (options this model or pool cannot take) travels as itself
            conn.send(("error", seq, f"rank {rank}: {type(e).__name__}: {e}",
                       e if isinstance(e, ConfigError) else None, traceback.format_exc()))
        except Exception:
            pass
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _dcp_group(rank: int, world_size: int, dcp: int, interleave: int):
    """This rank's ``DCPGroup``: consecutive ranks ``[g * dcp, (g + 1) * dcp)`` (every rank
    creates every group, in the same order, as ``torch.distributed.new_group`` needs)."""
    import torch.distributed as dist

    from pagedkv.distributed.group import DCPGroup

    mine = None
    for g in range(world_size // dcp):
        ranks = list(range(g * dcp, (g + 1) * dcp))
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine = DCPGroup(rank % dcp, dcp, interleave, pg)
    return mine


def _serve(rank: int, conn, runner) -> None:
    handles: dict[int, Any] = {}
    graph_steps = 0
    while True:
        kind, seq, arg = conn.recv()
        try:
            value = None
            if kind == "exec":
                handles[seq] = runner.execute_model_async(arg)
            elif kind == "get":
                out = runner.get_output(handles.pop(arg))
                if rank == 0:  # the graph replays since the last report ride along
                    value = (out, runner.num_graph_steps - graph_steps)
                graph_steps = runner.num_graph_steps
            elif kind == "eos":
                runner.eos_token_ids = arg
            elif kind == "reset":
                handles.clear()
                runner.reset_requests()
            elif kind == "stop":
                conn.send(("ok", seq, None))
                return
            else:
                raise ValueError(f"unknown call {kind!r}")
        except BaseException as e:
            conn.send(("error", seq, f"rank {rank}: {type(e).__name__}: {e}", None,
                       traceback.format_exc()))
            return
        conn.send(("ok", seq, value))


__all__ = ["MULTICAST_OFF", "WorkerSpec", "worker_main"]
