"""Read a GGUF file as Hugging Face weights and an mlx-lm config, with llama.cpp's ``gguf`` package.

Sources:

* GGUF file format, tensor names and metadata keys: ggml's ``docs/gguf.md``
  (github.com/ggml-org/ggml). The file is read with ``gguf.GGUFReader`` (memory-mapped) and each
  tensor dequantized to float32 with ``gguf.quants.dequantize`` (every ggml type: Q4_0, Q4_1,
  Q5_0, Q8_0, the K-quants, F16, ...).
* llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of the query and key projections of
  *llama* models (``LlamaModel.permute``) so that its RoPE can rotate adjacent pairs;
  :func:`unpermute_rows` applies the inverse, giving the Hugging Face layout (RoPE on the two
  halves of each head, ``rope_traditional = False`` in mlx-lm). qwen2 is stored unpermuted.

Supported architectures (:data:`ARCHITECTURES`): ``llama`` (SmolLM2) and ``qwen2``
(Qwen2.5, q/k/v biases).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ARCHITECTURES", "dequantized", "hf_name", "read_gguf", "read_metadata", "token_id",
           "unpermute_rows"]

# GGUF tensor-name parts -> Hugging Face module names (llama and qwen2 share them).
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

#: Per GGUF architecture: the Hugging Face class, whether q/k rows are permuted in the file, and
#: the config keys fixed by the architecture.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {"class": "LlamaForCausalLM", "permuted_qk": True,
              "config": {"attention_bias": False, "mlp_bias": False}},
    "qwen2": {"class": "Qwen2ForCausalLM", "permuted_qk": False,
              "config": {"use_sliding_window": False}},
}


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a llama query or key projection.

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


def hf_name(gguf_name: str) -> str:
    """Hugging Face name for a GGUF tensor name (``blk.3.attn_q.weight``, ``blk.3.attn_q.bias``)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def read_metadata(reader) -> dict[str, Any]:
    """The key-value metadata of a ``gguf.GGUFReader`` as Python values (``GGUF.*`` header
    fields left out). float32 values are rounded to their shortest decimal form (1e-05, not
    9.999999747378752e-06); arrays become lists."""
    from gguf import GGUFValueType

    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types == [GGUFValueType.FLOAT32]:
            value = float(np.format_float_positional(np.float32(value), trim="-"))
        out[name] = value
    return out


def dequantized(tensor) -> np.ndarray:
    """A ``gguf.ReaderTensor`` as a float32 array of shape ``reversed(tensor.shape)``
    (``(out, in)`` for a matrix: GGUF lists dimensions innermost first).

    Raises:
        ValueError: the dequantized size does not match the tensor's shape.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))
    if tensor.tensor_type == GGMLQuantizationType.F32:
        values = np.array(tensor.data, dtype=np.float32)  # a copy: the file may be deleted after
    else:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    if values.size != int(np.prod(shape)):
        raise ValueError(f"{tensor.name}: {values.size} values after dequantization, shape {shape}")
    return values.reshape(shape)


def token_id(meta: dict, key: str) -> int | None:
    """Id of ``tokenizer.ggml.<key>_token_id`` (bos, eos, padding, unknown), if present."""
    value = meta.get(f"tokenizer.ggml.{key}_token_id")
    return None if value is None else int(value)


def read_gguf(gguf_path: str | Path) -> tuple[dict[str, np.ndarray], dict, dict]:
    """Float32 weights under Hugging Face names, the mlx-lm ``config.json`` dict, and the metadata.

    Every tensor is dequantized to float32 (:func:`dequantized`) and renamed (:func:`hf_name`);
    for ``llama`` the q/k rows are un-permuted (:func:`unpermute_rows`);
    ``tie_word_embeddings`` is true when the file has no ``output`` tensor.

    Returns:
        ``(weights, config, meta)``: ``{name: np.ndarray float32}``, the ``config.json``
        contents, and the GGUF metadata (:func:`read_metadata`).

    Raises:
        ValueError: an architecture outside :data:`ARCHITECTURES`, a required metadata key
            missing, or an unexpected tensor name.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{gguf_path}: architecture {arch!r} is not supported "
                         f"(only {', '.join(ARCHITECTURES)})")
    rules = ARCHITECTURES[arch]

    def hparam(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            if default is None:
                raise ValueError(f"{gguf_path}: metadata '{arch}.{key}' is missing")
            return default
        return value

    n_heads = int(hparam("attention.head_count"))
    n_kv_heads = int(hparam("attention.head_count_kv", n_heads))
    hidden = int(hparam("embedding_length"))
    weights: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        value = dequantized(tensor)
        if rules["permuted_qk"] and tensor.name.endswith("attn_q.weight"):
            value = unpermute_rows(value, n_heads)
        elif rules["permuted_qk"] and tensor.name.endswith("attn_k.weight"):
            value = unpermute_rows(value, n_kv_heads)
        weights[hf_name(tensor.name)] = np.ascontiguousarray(value)
    del reader
    config = {
        "architectures": [rules["class"]],
        "model_type": arch,
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
        "vocab_size": int(weights["model.embed_tokens.weight"].shape[0]),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        **rules["config"],
        "bos_token_id": token_id(meta, "bos"),
        "eos_token_id": token_id(meta, "eos"),
        "pad_token_id": token_id(meta, "padding"),
        "torch_dtype": "float32",
    }
    return weights, config, meta
