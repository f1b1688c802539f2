"""Typed errors. User input is validated at the boundary and rejected with one of these.

Each error says what went wrong and what to do about it. Internal invariants that
can only break through a bug in pagedkv raise ``InvariantError``.
"""


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class ConfigError(PagedKVError, ValueError):
    """A configuration value is out of range or inconsistent with another one."""


class InvalidRequestError(PagedKVError, ValueError):
    """A request cannot be accepted (too long, empty, bad token ids, bad parameters)."""


class NoFreeBlocksError(PagedKVError, ValueError):
    """The block pool has fewer free blocks than asked for.

    Subclasses ``ValueError`` because vLLM raises ``ValueError`` in the same place.
    """


class BlockStateError(PagedKVError, RuntimeError):
    """A block operation is illegal in the block's current state (double free,
    removing an unlinked block from the free queue, touching the null block ...)."""


class UnknownRequestError(PagedKVError, KeyError):
    """A request id is not known to the component that was asked about it."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown request"


class InvariantError(PagedKVError, AssertionError):
    """An index-layer invariant is broken (raised by the sanitizer and by internal checks).

    ``rule`` names the broken rule; ``details`` carries the request/row/slot involved.
    """

    def __init__(self, rule: str, message: str, **details):
        self.rule = rule
        self.details = details
        extra = ", ".join(f"{k}={v!r}" for k, v in details.items())
        super().__init__(f"[{rule}] {message}" + (f" ({extra})" if extra else ""))


class BlockTableError(PagedKVError, ValueError):
    """A block-table or persistent-batch row operation is out of range: a row index outside
    ``[0, max_num_reqs)``, more block ids than the table width, a negative block id, or a
    full batch. The table is left unchanged; raise ``max_model_len`` / ``max_num_reqs`` or
    send fewer blocks."""


class ModelOutputError(PagedKVError, ValueError):
    """A model runner output does not match the scheduler output it answers (a request
    missing from it, tokens sampled for a partial-prefill chunk, ...)."""


class UnsupportedArchitectureError(ConfigError):
    """A checkpoint's ``architectures`` names a model family pagedkv does not implement.
    The message lists the supported architectures."""


class CheckpointError(PagedKVError, ValueError):
    """A checkpoint directory is incomplete or malformed: missing or unexpected tensors, a
    tensor of the wrong shape, an unreadable safetensors file or index, a missing tokenizer.
    The message names the files and tensors involved."""


class SamplingError(PagedKVError, ValueError):
    """The sampler or the detokenizer was driven inconsistently: logits whose shape, dtype or
    device do not match the batch's ``SamplingMetadata``, or tokens fed to a detokenizer whose
    request already finished. Rebuild the metadata for the current batch composition."""


class ModelUnavailableError(CheckpointError):
    """A packaged model cannot be materialized here: the package that ships its weights (or a
    package the conversion needs, such as ``gguf``) is not installed. The message names the
    missing package and the pip command that installs it."""


class ChatTemplateError(PagedKVError, ValueError):
    """A chat template is missing, malformed, or refused the messages (the template called
    ``raise_exception``, e.g. for roles out of order). The message names the template's file."""


class WorkerError(PagedKVError, RuntimeError):
    """A tensor-parallel worker process died, raised or hung (``pagedkv.distributed``); the
    engine stops its workers and refuses further steps with this error."""

