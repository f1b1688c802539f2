"""Tokenizer of a checkpoint directory: ``tokenizer.json`` (Hugging Face ``tokenizers``) plus
the special tokens named in ``tokenizer_config.json``. Offline; no transformers import.

BOS/EOS insertion on ``encode`` is whatever ``tokenizer.json``'s post-processor does (as with
transformers' fast tokenizers).
"""

from __future__ import annotations

import json
import os
from typing import Iterable

from pagedkv.errors import CheckpointError, ConfigError


def _token_str(v) -> str | None:
    if v is None:
        return None
    if isinstance(v, dict):  # older configs: {"content": "<s>", ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


class Tokenizer:
    def __init__(self, tokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, source: str = "tokenizer"):
        self._tok = tokenizer
        self.source = source
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.bos_token_id = self._special_id(bos_token, "bos_token")
        self.eos_token_id = self._special_id(eos_token, "eos_token")
        self.pad_token_id = self._special_id(pad_token, "pad_token")

    def _special_id(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise CheckpointError(f"{self.source}: {what} {token!r} is not in the tokenizer's vocabulary")
        return tid

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = os.fspath(model_dir)
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise CheckpointError(
                f"{model_dir}: tokenizer.json is missing; pagedkv needs a fast-tokenizer file "
                f"(save one with tokenizer.save_pretrained), or pass prompts as token ids"
            )
        try:
            tok = HFTokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a plain Exception subclass
            raise CheckpointError(f"{path}: cannot read tokenizer: {e}") from None
        cfg: dict = {}
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    cfg = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from None
            if not isinstance(cfg, dict):
                raise CheckpointError(f"{cfg_path} must hold a JSON object")
        return cls(
            tok,
            bos_token=_token_str(cfg.get("bos_token")),
            eos_token=_token_str(cfg.get("eos_token")),
            pad_token=_token_str(cfg.get("pad_token")),
            source=path,
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, tid: int) -> str | None:
        return self._tok.id_to_token(tid)

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer for random-weight shapes: id ``i`` is the word ``t{i}`` (words
    joined by spaces when decoding), so a server can stream text for token-id prompts of a
    model without a real vocabulary. No special tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise CheckpointError(f"vocab_size must be a positive int, got {vocab_size!r}")
    tok = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(tok, source=f"synthetic word-level tokenizer ({vocab_size} ids)")


def load_tokenizer(model_dir: str | os.PathLike,
                   tokenizer: bool | str | os.PathLike = "auto") -> Tokenizer | None:
    """The tokenizer ``load_checkpoint`` gives a checkpoint: True (required, from
    ``model_dir``), "auto" (``model_dir``'s, None when absent), False (none), or a directory
    to load it from. Torch-free, so the serving front loads it without the engine."""
    model_dir = os.fspath(model_dir)
    if tokenizer is True or (tokenizer == "auto" and os.path.isfile(os.path.join(model_dir, "tokenizer.json"))):
        return Tokenizer.from_dir(model_dir)
    if isinstance(tokenizer, (str, os.PathLike)) and tokenizer != "auto":
        tok_dir = os.fspath(tokenizer)
        if not os.path.isdir(tok_dir):
            raise ConfigError(f"tokenizer directory {tok_dir!r} does not exist")
        return Tokenizer.from_dir(tok_dir)
    if tokenizer not in (False, "auto"):
        raise ConfigError(
            f"tokenizer must be a directory, 'auto', True or False, got {tokenizer!r}")
    return None


__all__ = ["Tokenizer", "load_tokenizer", "synthetic_tokenizer"]
