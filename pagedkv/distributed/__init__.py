"""Tensor parallelism over ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

``LLM(path, tensor_parallel_size=N)`` keeps the scheduler in this process and starts N worker
processes, each holding one rank's shard of the model and its own KV pool:

* ``group``: a rank's collectives (all-reduce, vocabulary-parallel embedding, logits gather);
* ``shard``: Megatron's layout of a ``DecoderForCausalLM`` over the ranks;
* ``worker``: a rank's process (start-up, the call loop);
* ``executor``: the driver's side, standing where the engine's ``ModelRunner`` stands.
"""

from pagedkv.distributed.executor import (
    TensorParallelExecutor,
    WorkerError,
    build_tensor_parallel_engine,
)
from pagedkv.distributed.group import TPGroup
from pagedkv.distributed.shard import check_tensor_parallel, local_config, shard_decoder

__all__ = ["TPGroup", "TensorParallelExecutor", "WorkerError", "build_tensor_parallel_engine",
           "check_tensor_parallel", "local_config", "shard_decoder"]
