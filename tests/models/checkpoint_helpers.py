"""A tiny random checkpoint of any transformers causal LM, built once into a test cache.

``build_hf_checkpoint(cache_dir, "name", "NameForCausalLM", config, fill)`` writes (once per
config, seed, dtype, layout and transformers version) the model that transformers' own class
builds from ``config`` (a dict of its config class's keys), its weights set by ``fill(model,
seed)``, cast to ``dtype`` and saved with ``save_pretrained`` (``save_original_format=False``:
transformers' module names), plus the tiny llama checkpoint's byte-level BPE tokenizer
(``pagedkv.models.tiny``). Built in a temporary directory and renamed into place, so
concurrent builders are safe. ``copy_without_tensor`` copies a checkpoint with one tensor
dropped (the strict loader's tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Callable

import torch

from pagedkv.models.tiny import build_tiny_checkpoint

MARKER = "pagedkv_tiny_hf.json"


def build_hf_checkpoint(cache_dir: str, name: str, architecture: str, config: dict,
                        fill: Callable, *, seed: int = 0, dtype: str = "float32",
                        save_original_format: bool = True) -> str:
    import transformers

    blob = json.dumps([architecture, config, seed, dtype, save_original_format,
                       transformers.__version__], sort_keys=True).encode()
    target = os.path.join(cache_dir, f"{name}-" + hashlib.sha256(blob).hexdigest()[:12])
    if os.path.isfile(os.path.join(target, MARKER)):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    tok_dir = build_tiny_checkpoint("llama", cache_dir, vocab_size=config["vocab_size"],
                                    num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=1,
                                    head_dim=8, intermediate_size=16)
    tmp = tempfile.mkdtemp(prefix=f".{name}-building-", dir=cache_dir)
    try:
        config_cls = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
        model = getattr(transformers, architecture)(config_cls(**config))
        fill(model, seed)
        model = model.to(getattr(torch, dtype))
        model.save_pretrained(tmp, **({} if save_original_format
                                      else {"save_original_format": False}))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tok_dir, f), tmp)
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as fh:
            json.dump({"architecture": architecture, "config": config, "seed": seed,
                       "dtype": dtype}, fh)
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, MARKER)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def copy_without_tensor(src, dst, name: str):
    """A copy of the checkpoint directory ``src`` at ``dst`` whose ``model.safetensors`` lacks
    the tensor ``name``; returns ``dst``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = os.path.join(dst, "model.safetensors")
    tensors = load_file(f)
    del tensors[name]
    save_file(tensors, f, metadata={"format": "pt"})
    return dst
