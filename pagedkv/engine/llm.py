"""``LLM``: offline batched generation, shaped like vLLM's ``LLM`` so users can switch::

    from pagedkv import LLM, SamplingParams
    llm = LLM(model="/path/to/checkpoint")
    outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)

``LLM(model=DIR)`` loads a Hugging Face checkpoint directory (offline). ``LLM.from_shape(
"qwen3-0.6b")`` builds a named architecture with random weights (benchmarks; prompts are token
ids, outputs carry no text). ``LLM.from_model(model, tokenizer)`` wraps an already built
``DecoderForCausalLM``.

``generate`` validates every prompt before queueing any (a bad one raises and nothing was
allocated), then steps the engine until all finish and returns one ``RequestOutput`` per prompt
in input order. The lower-level ``add_request`` / ``step`` / ``abort`` / ``has_unfinished_requests``
drive the engine a step at a time.
"""

from __future__ import annotations

import numbers
import os
from typing import Any, Sequence

import torch

from pagedkv.engine.llm_engine import (
    LLMEngine,
    PromptType,
    build_engine,
    make_attention_backend,
    resolve_device,
)
from pagedkv.engine.heap import release_frozen
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.progress import ProgressBar
from pagedkv.config import EngineConfig
from pagedkv.errors import ConfigError, InvalidRequestError, InvariantError
from pagedkv.sampling.params import SamplingParams


def _tensor_parallel_engine(model, ec: EngineConfig, dtype, device, attention_backend, tokenizer):
    """``LLM``'s engine over ``ec.tensor_parallel_size`` worker processes: the config,
    tokenizer and generation defaults load here, the weights in each rank
    (``pagedkv.distributed``)."""
    from pagedkv.distributed.executor import build_tensor_parallel_engine
    from pagedkv.models.config import load_model_config
    from pagedkv.models.generation_config import load_generation_defaults
    from pagedkv.models.tokenizer import load_tokenizer

    path = os.fspath(model)
    config = load_model_config(path, max_model_len=ec.max_model_len)
    return build_tensor_parallel_engine(
        path, load_tokenizer(path, tokenizer), config, ec, dtype=dtype, device=device,
        attention_backend=attention_backend, generation_defaults=load_generation_defaults(path))


def _is_single_prompt(x: Any) -> bool:
    """A string, a ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` dict, or one flat list
    (tuple, array) of token ids, as opposed to a list of prompts."""
    if isinstance(x, (str, dict)):
        return True
    if hasattr(x, "tolist"):
        x = x.tolist()
    return isinstance(x, (list, tuple)) and (
        len(x) == 0 or (isinstance(x[0], numbers.Integral) and not isinstance(x[0], bool)))


class LLM:
    """See the module docstring. ``LLM(path, dtype=, device=, attention_backend=, tokenizer=,
    **engine_options)``: the engine options are the fields of
    :class:`~pagedkv.config.EngineConfig` (vLLM's names where vLLM has them: ``block_size``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``enable_prefix_caching``,
    ``gpu_memory_utilization``, ``num_gpu_blocks_override``, ``enforce_eager``, ``seed``, ...;
    pagedkv's own: ``kv_cache_memory_bytes``, ``async_scheduling``, ``compile_model``,
    ``warmup``, ``sanitize``, ``allow_long_max_model_len``), or ``config=EngineConfig(...)``.
    ``async_scheduling`` (schedule the next step while the device runs the current one; same
    tokens) and ``compile_model`` (``torch.compile`` the model's pointwise regions; CUDA only)
    default to on with CUDA and off on CPU, so ``LLM(path)`` is the fast engine.
    ``attention_backend``: ``"auto"``, ``"torch_ref"``, ``"triton"`` or an
    ``AttentionBackend``.

    ``tokenizer``: a directory to load the tokenizer from (vLLM's spelling), ``"auto"`` (the
    model directory's, if it has one), ``True`` (required from the model directory) or
    ``False`` (none). ``max_model_len`` above the model's trained context (see
    ``ModelArchConfig.max_trained_len``) is refused unless ``allow_long_max_model_len=True``
    (or ``PAGEDKV_ALLOW_LONG_MAX_MODEL_LEN=1``). Deleting the ``LLM`` (or :meth:`shutdown`)
    gives its memory back, so a second one in the same process starts as the first did.
    ``sanitize=True`` checks every index-layer invariant on every step (``pagedkv.sanitizer``).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        attention_backend: Any = "auto",
        tokenizer: bool | str | os.PathLike = "auto",
        config: EngineConfig | None = None,
        _engine: LLMEngine | None = None,
        **engine_options,
    ) -> None:
        self.engine = None
        if _engine is None:
            from pagedkv.models.loader import load_checkpoint

            ec = config if config is not None else EngineConfig.from_options(**engine_options)
            if config is not None and engine_options:
                raise ConfigError("LLM takes config=EngineConfig(...) or engine options, not "
                                  f"both (got {sorted(engine_options)})")
            dev = resolve_device(device)
            if ec.tensor_parallel_size > 1:
                _engine = _tensor_parallel_engine(model, ec, dtype, dev, attention_backend,
                                                  tokenizer)
            else:
                backend = make_attention_backend(attention_backend, dev)
                torch.manual_seed(ec.seed)
                ck = load_checkpoint(model, dtype=dtype, device=dev, backend=backend,
                                     max_model_len=ec.max_model_len, tokenizer=tokenizer)
                _engine = build_engine(ck.model, ck.tokenizer, ec,
                                       generation_defaults=ck.generation)
        self.engine = _engine
        self.model_name = os.fspath(model)
        # where the chat template lives: the tokenizer's directory (tokenizer_config.json /
        # chat_template.jinja), which is the model's unless tokenizer=DIR named another
        self._chat_template_dir = (os.fspath(tokenizer) if isinstance(tokenizer, (str, os.PathLike))
                                   and tokenizer != "auto" else self.model_name)
        self._chat_template = None

    # ----- life cycle ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Drop the engine and give its memory back (device memory included: the engine's
        objects were frozen out of the cyclic GC at start-up, see ``pagedkv.engine.heap``).
        Also what deleting the ``LLM`` does. The object is unusable afterwards."""
        engine, self.engine = self.__dict__.get("engine"), None
        if engine is None:
            return
        stop = getattr(engine.runner, "shutdown", None)  # tensor-parallel worker processes
        if stop is not None:
            stop()
        del engine
        release_frozen()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter shutdown: modules may be gone already
            pass

    # ----- other constructors --------------------------------------------------------------
    @classmethod
    def from_model(cls, model: Any, tokenizer: Any = None, *, attention_backend: Any = None,
                   name: str = "model", **engine_kwargs) -> "LLM":
        """Wrap a built ``DecoderForCausalLM`` (its current backend unless one is given)."""
        if attention_backend is not None:
            model.set_attention_backend(make_attention_backend(attention_backend, model.device))
        engine = build_engine(model, tokenizer, **engine_kwargs)
        return cls(name, _engine=engine)

    @classmethod
    def from_shape(cls, shape: str, *, dtype: str | torch.dtype = "auto",
                   device: str | torch.device | None = None, attention_backend: Any = "auto",
                   tokenizer: Any = None, **engine_options) -> "LLM":
        """A named architecture (``"qwen3-0.6b"``, ``"llama-3.2-1b"`` ...) with deterministic
        random weights. No tokenizer by default (prompts are token ids); ``tokenizer="synthetic"``
        gives it a word-level one over its vocabulary (``t0 t1 ...``: text to stream, e.g. for
        ``pagedkv serve --shape``), or pass a ``Tokenizer``. With ``tensor_parallel_size`` N >
        1 each rank builds its shard with random weights (``random_shard``): the sizes and work
        of the one-process model, not its weights (another random function; for throughput)."""
        from pagedkv.models.config import shape_config
        from pagedkv.models.loader import resolve_dtype
        from pagedkv.models.registry import get_model_class

        cfg = shape_config(shape)
        dev = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, cfg)
        ec = EngineConfig.from_options(**engine_options)
        if isinstance(tokenizer, str):
            if tokenizer != "synthetic":
                raise ConfigError(f"from_shape: tokenizer must be None, 'synthetic' or a "
                                  f"Tokenizer, got {tokenizer!r}")
            from pagedkv.models.tokenizer import synthetic_tokenizer

            tokenizer = synthetic_tokenizer(cfg.vocab_size)
        if ec.tensor_parallel_size > 1:
            from pagedkv.distributed.executor import build_tensor_parallel_engine

            engine = build_tensor_parallel_engine(None, tokenizer, cfg, ec, dtype=torch_dtype,
                                                  device=dev, attention_backend=attention_backend,
                                                  shape=shape)
            return cls(f"shape:{shape}", _engine=engine)
        backend = make_attention_backend(attention_backend, dev)
        model = get_model_class(cfg.architecture)(cfg, backend=backend, dtype=torch_dtype,
                                                  device=dev)
        model.init_random_weights(ec.seed).finish_loading().eval()
        engine = build_engine(model, tokenizer, ec)
        return cls(f"shape:{shape}", _engine=engine)

    # ----- properties ----------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.config

    @property
    def scheduler(self):
        return self.engine.scheduler

    @property
    def runner(self):
        return self.engine.runner

    @property
    def kv_cache_sizing(self):
        return self.engine.sizing

    def get_kv_stats(self) -> dict:
        return self.engine.kv_stats()

    # ----- generation ----------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, a ``{"prompt": text}`` or
        ``{"prompt_token_ids": ids}`` dict, or a list of those); returns one finished
        ``RequestOutput`` per prompt, in input order."""
        if isinstance(prompts, (list, tuple)) and not prompts:
            return []  # no prompts (an empty prompt is [[]] or "")
        if _is_single_prompt(prompts):
            prompts = [prompts]
        elif isinstance(prompts, (bytes, bytearray)) or not (
                isinstance(prompts, Sequence) or hasattr(prompts, "tolist")):
            raise InvalidRequestError(
                "prompts must be a string, a list of token ids, a {'prompt': ...} / "
                "{'prompt_token_ids': ...} dict, or a list of those; got "
                f"{type(prompts).__name__}")
        prompts = list(prompts)
        if not prompts:
            return []
        if not isinstance(sampling_params, (list, tuple)):
            params = [sampling_params] * len(prompts)  # one for all (validated per request)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(
                    f"{len(prompts)} prompts but {len(params)} sampling params; pass one, or one "
                    "per prompt"
                )
        engine = self.engine
        validated = [engine.validate(p, sp) for p, sp in zip(prompts, params)]
        ids = [engine.add_request(None, None, _validated=v) for v in validated]
        return self._run(ids, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every one of ``request_ids`` finished. If anything raises meanwhile (a
        bug, a device error, the caller's Ctrl-C), ``LLMEngine.recover`` aborts this call's
        requests before the exception propagates: their blocks are free again and the next
        call works."""
        engine = self.engine
        wanted = set(request_ids)
        results: dict[str, RequestOutput] = {}
        bar = ProgressBar(len(request_ids), "pagedkv generate", enabled=use_tqdm)
        start_tokens = engine.stats.tokens_generated
        try:
            while len(results) < len(wanted):
                outs = engine.step(finished_only=True)
                for out in outs:
                    if out.request_id in wanted:
                        results[out.request_id] = out
                if not engine.scheduler.has_requests() and len(results) < len(wanted):
                    missing = sorted(wanted - set(results))
                    raise InvariantError("progress", "the engine has no work left but requests "
                                         "are unfinished", missing=missing[:5])
                bar.update(len(results), engine.stats.tokens_generated - start_tokens)
            engine.settle()  # async scheduling: nothing left in flight between calls
        except BaseException:
            engine.recover(request_ids)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in request_ids]

    # ----- chat ----------------------------------------------------------------------------
    def get_chat_template(self):
        """The checkpoint's chat template (``pagedkv.models.chat_template.ChatTemplate``),
        loaded once; ``ChatTemplateError`` when the checkpoint has none."""
        if self._chat_template is None:
            from pagedkv.errors import ChatTemplateError
            from pagedkv.models.chat_template import ChatTemplate

            if not os.path.isdir(self._chat_template_dir):
                raise ChatTemplateError(
                    f"{self.model_name} is not a checkpoint directory, so it has no chat "
                    "template; render the prompt yourself and call generate")
            self._chat_template = ChatTemplate.from_dir(self._chat_template_dir)
        return self._chat_template

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools=None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, as vLLM's ``LLM.chat``: ``messages`` is one
        conversation (a list of ``{"role": ..., "content": ...}`` dicts) or a list of them.
        Each is rendered with the checkpoint's chat template exactly as transformers'
        ``apply_chat_template`` renders it (``chat_template``: a template string to use
        instead; ``chat_template_kwargs``: extra template variables such as
        ``enable_thinking``), tokenized without adding special tokens (the template wrote
        them), and generated like ``generate``. Returns one ``RequestOutput`` per conversation."""
        from pagedkv.models.chat_template import ChatTemplate

        if self.tokenizer is None:
            raise InvalidRequestError("chat needs a tokenizer; this model has none")
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
            conversations = [messages]
        elif isinstance(messages, (list, tuple)):
            conversations = list(messages)
        else:
            raise InvalidRequestError(
                "messages must be a conversation (a list of {'role', 'content'} dicts) or a list "
                f"of conversations, got {type(messages).__name__}")
        if not conversations:
            return []
        template = self.get_chat_template()
        if chat_template is not None:
            template = ChatTemplate.from_string(chat_template, template.special_tokens)
        kwargs = dict(chat_template_kwargs or {})
        prompts = []
        for conv in conversations:
            text = template.render(conv, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, tools=tools,
                                   **kwargs)
            prompts.append({"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ----- step-level API ------------------------------------------------------------------
    def add_request(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        return self.engine.add_request(prompt, sampling_params, request_id)

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()


__all__ = ["LLM"]
