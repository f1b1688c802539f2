"""Load a Hugging Face checkpoint directory, offline: ``config.json``, ``*.safetensors`` (one
file, or shards listed by ``model.safetensors.index.json``) and the tokenizer.

Name checking is strict: every tensor the architecture needs must be present exactly once with
the right shape, in one of the model's tensor layouts (``hf_weight_layouts``: one for dense
models; per-expert or stacked experts for MoE models), and every tensor present must be used
(``rotary_emb.inv_freq`` buffers of old checkpoints, ``lm_head.weight`` of tied models,
DeepSeek-V3's multi-token-prediction layers ``model.layers.{L + i}.*``, ``i <
num_nextn_predict_layers``, and Qwen3-Next's ``mtp.*`` are the only ones skipped). Errors list
the tensors and files involved.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from pagedkv.attention.backend import AttentionBackend
from pagedkv.errors import CheckpointError, ConfigError
from pagedkv.models.config import ModelArchConfig, load_model_config, normalize_dtype_name
from pagedkv.models.decoder import DecoderForCausalLM
from pagedkv.models.generation_config import GenerationDefaults, load_generation_defaults
from pagedkv.models.registry import get_model_class
from pagedkv.models.tokenizer import Tokenizer, load_tokenizer

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, config: ModelArchConfig) -> torch.dtype:
    """``"auto"``/``None`` -> the checkpoint's dtype; otherwise float32/bfloat16/float16 by name
    (aliases fp32, bf16, fp16, half) or as a torch dtype."""
    if dtype is None or dtype == "auto":
        return _TORCH_DTYPES[config.dtype]
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise ConfigError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    return _TORCH_DTYPES[normalize_dtype_name(dtype)]


def _short_list(names, limit: int = 20) -> str:
    names = sorted(names)
    s = ", ".join(names[:limit])
    return s + (f" ... ({len(names) - limit} more)" if len(names) > limit else "")


def checkpoint_files(model_dir: str | os.PathLike) -> dict[str, str]:
    """Tensor name -> safetensors file path, for a single-file or a sharded checkpoint."""
    model_dir = os.fspath(model_dir)
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                index = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index_path} is not valid JSON: {e}") from None
        wmap = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise CheckpointError(f"{index_path}: 'weight_map' (tensor name -> file name) is missing or malformed")
        missing_files = sorted({f for f in wmap.values() if not os.path.isfile(os.path.join(model_dir, f))})
        if missing_files:
            raise CheckpointError(f"{index_path} lists shard files that do not exist: {_short_list(missing_files)}")
        return {name: os.path.join(model_dir, f) for name, f in wmap.items()}
    single = os.path.join(model_dir, SINGLE_FILE)
    files = [single] if os.path.isfile(single) else sorted(
        os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors")
    )
    if not files:
        raise CheckpointError(
            f"{model_dir}: no *.safetensors weights found (pytorch_model.bin is not supported; "
            f"re-save the model with save_pretrained to get safetensors)"
        )
    out: dict[str, str] = {}
    for path in files:
        for name in _file_keys(path):
            if name in out:
                raise CheckpointError(f"tensor {name} is stored twice: in {out[name]} and {path}")
            out[name] = path
    return out


def _open(path: str):
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError, ...
        raise CheckpointError(f"{path}: cannot read safetensors file ({type(e).__name__}: {e})") from None


def _file_keys(path: str) -> list[str]:
    with _open(path) as f:
        return list(f.keys())


def _ignorable(name: str, config: ModelArchConfig) -> bool:
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if config.mla is not None and name.startswith("model.layers."):
        # DeepSeek's multi-token-prediction modules follow the decoder's layers (transformers
        # does not load them either)
        layer = name.split(".")[2]
        mtp = config.raw.get("num_nextn_predict_layers") or 0
        if layer.isdigit() and isinstance(mtp, int) and (
                config.num_hidden_layers <= int(layer) < config.num_hidden_layers + mtp):
            return True
    if config.linear_attn is not None and name.startswith("mtp."):
        return True  # Qwen3-Next's multi-token-prediction module (transformers skips it too)
    if config.dsv4 is not None and (name.startswith("mtp.") or ".mtp." in name):
        return True  # DeepSeek-V4's multi-token-prediction module (as transformers)
    return config.tie_word_embeddings and name == "lm_head.weight"


@torch.no_grad()
def load_weights(model: DecoderForCausalLM, model_dir: str | os.PathLike) -> None:
    """Fill ``model``'s parameters from the checkpoint in ``model_dir`` (strict names and shapes)."""
    config = model.config
    files = checkpoint_files(model_dir)
    present = set(files)
    # the layout (of the model's hf_weight_layouts) whose names the checkpoint has exactly
    best = None
    for layout, expected in model.hf_weight_layouts().items():
        missing = sorted(set(expected) - present)
        unexpected = sorted(n for n in present - set(expected) if not _ignorable(n, config))
        if best is None or len(missing) + len(unexpected) < len(best[1]) + len(best[2]):
            best = (layout, missing, unexpected, expected)
    layout, missing, unexpected, expected = best
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_short_list(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_short_list(unexpected)}")
        layouts = list(model.hf_weight_layouts())
        closest = f" (closest of the layouts {', '.join(layouts)}: {layout})" if len(layouts) > 1 else ""
        raise CheckpointError(
            f"{os.fspath(model_dir)}: checkpoint does not match {config.architecture} "
            f"({config.num_hidden_layers} layers, tie_word_embeddings={config.tie_word_embeddings}, "
            f"qkv_bias={config.qkv_bias}, qk_norm={config.qk_norm}){closest}: " + "; ".join(parts)
        )
    by_file: dict[str, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for path, names in sorted(by_file.items()):
        with _open(path) as f:
            keys = set(f.keys())
            absent = [n for n in names if n not in keys]
            if absent:
                raise CheckpointError(
                    f"{path}: the index maps these tensors to this file but it lacks them: {_short_list(absent)}"
                )
            for name in names:
                param, rows = expected[name]
                try:
                    t = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"{path}: cannot read tensor {name} ({type(e).__name__}: {e})") from None
                want = tuple(param.shape) if rows is None else (rows[1], *param.shape[1:])
                if tuple(t.shape) != want:
                    raise CheckpointError(
                        f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {want} "
                        f"(from config.json)"
                    )
                if t.is_floating_point() != param.dtype.is_floating_point:
                    kind = "a float" if param.dtype.is_floating_point else "an integer"
                    raise CheckpointError(f"{path}: tensor {name} has dtype {t.dtype}, expected {kind} type")
                dst = param.data if rows is None else param.data[rows[0] : rows[0] + rows[1]]
                dst.copy_(t.to(param.dtype))


def load_model(
    model_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    backend: AttentionBackend | None = None,
    max_model_len: int | None = None,
    config: ModelArchConfig | None = None,
) -> DecoderForCausalLM:
    """Build the model for ``model_dir``'s architecture and load its weights."""
    config = config or load_model_config(model_dir, max_model_len=max_model_len)
    cls = get_model_class(config.architecture)
    model = cls(config, backend=backend, dtype=resolve_dtype(dtype, config), device=device)
    load_weights(model, model_dir)
    return model.finish_loading().eval()


@dataclass
class LoadedCheckpoint:
    model_dir: str
    config: ModelArchConfig
    model: DecoderForCausalLM
    tokenizer: Tokenizer | None
    generation: GenerationDefaults = GenerationDefaults()


def load_checkpoint(
    model_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    backend: AttentionBackend | None = None,
    max_model_len: int | None = None,
    tokenizer: bool | str | os.PathLike = True,
) -> LoadedCheckpoint:
    """Config + model + tokenizer + generation defaults. ``tokenizer``: True (required, from
    ``model_dir``), "auto" (``model_dir``'s, None when absent), False (skip), or a directory
    to load it from (vLLM's ``tokenizer=``)."""
    model_dir = os.fspath(model_dir)
    config = load_model_config(model_dir, max_model_len=max_model_len)
    model = load_model(model_dir, dtype=dtype, device=device, backend=backend, config=config)
    tok = load_tokenizer(model_dir, tokenizer)
    return LoadedCheckpoint(model_dir=model_dir, config=config, model=model, tokenizer=tok,
                            generation=load_generation_defaults(model_dir))


__all__ = [
    "LoadedCheckpoint",
    "checkpoint_files",
    "load_checkpoint",
    "load_model",
    "load_weights",
    "resolve_dtype",
]
