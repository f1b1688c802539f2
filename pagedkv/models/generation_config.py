"""``generation_config.json``: the checkpoint's generation defaults, read as vLLM reads them.

* ``eos_token_id`` (an int or a list): the ids generation stops on. Instruct models list several
  (Llama-3: ``<|end_of_text|>``, ``<|eot_id|>``; Qwen2.5/3: ``<|im_end|>``, ``<|endoftext|>``),
  and ``config.json`` often names only one. The engine stops on the union (``config.json``'s
  first).
* Sampling defaults, used when the caller passes no ``SamplingParams`` (vLLM's
  ``get_diff_sampling_param``): ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
  ``max_new_tokens`` (as ``max_tokens``). ``repetition_penalty`` is read and kept, and applied
  once ``SamplingParams`` has it.

A missing file gives empty defaults; a malformed one raises ``ConfigError``.
"""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass, field

from pagedkv.errors import ConfigError

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    sampling: dict = field(default_factory=dict)  # SamplingParams field -> value

    @classmethod
    def from_dict(cls, d: dict, source: str = GENERATION_CONFIG_FILE) -> "GenerationDefaults":
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        eos = d.get("eos_token_id")
        if eos is None:
            ids: tuple[int, ...] = ()
        else:
            raw = eos if isinstance(eos, list) else [eos]
            if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0
                       for t in raw):
                raise ConfigError(f"{source}: eos_token_id must be an id or a list of ids, got {eos!r}")
            ids = tuple(dict.fromkeys(int(t) for t in raw))
        sampling = {}
        for key, name in SAMPLING_KEYS.items():
            v = d.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ConfigError(f"{source}: {key} must be a number, got {v!r}")
            sampling[name] = int(v) if name in ("top_k", "max_tokens") else float(v)
        return cls(eos_token_ids=ids, sampling=sampling)


def load_generation_defaults(model_dir: str | os.PathLike) -> GenerationDefaults:
    """The defaults of ``<model_dir>/generation_config.json`` (empty when there is none)."""
    path = os.path.join(os.fspath(model_dir), GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return GenerationDefaults()
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return GenerationDefaults.from_dict(d, path)


__all__ = ["GENERATION_CONFIG_FILE", "GenerationDefaults", "load_generation_defaults"]
