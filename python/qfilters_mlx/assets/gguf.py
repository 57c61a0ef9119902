"""Read a llama GGUF file as Hugging Face llama weights and config.

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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["dequantized_weights", "hf_name", "metadata_scalar", "read_llama_gguf", "token_id",
           "unpermute_rows"]

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
# Block size of GGUF's Q4_0, Q4_1 and Q8_0 formats (values per scale).
_GGUF_BLOCK = 32


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


def hf_name(gguf_name: str) -> str:
    """Hugging Face llama name for a GGUF tensor name (``blk.3.attn_q.weight``)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a llama model")


def metadata_scalar(value: Any) -> Any:
    """Python value of a GGUF metadata scalar (``mx.load`` gives 0-d arrays).

    float32 values are rounded to their shortest decimal form (1e-05, not
    9.999999747378752e-06).
    """
    if not hasattr(value, "item"):
        return value
    if getattr(value, "dtype", None) is not None and "float" in str(value.dtype):
        return float(np.format_float_positional(np.float32(value.item()), trim="-"))
    return value.item()


def dequantized_weights(tensors: dict) -> dict:
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


def token_id(meta: dict, key: str) -> int | None:
    """Id of ``tokenizer.ggml.<key>_token_id`` (bos, eos, padding, unknown), if present."""
    value = meta.get(f"tokenizer.ggml.{key}_token_id")
    return None if value is None else int(metadata_scalar(value))


def read_llama_gguf(gguf_path: Path) -> tuple[dict, dict, dict]:
    """Float32 weights under Hugging Face llama names, the ``config.json`` dict, and the metadata.

    All tensors are dequantized to float32 (:func:`dequantized_weights`), renamed
    (:func:`hf_name`), and the q/k rows are un-permuted (:func:`unpermute_rows`);
    ``tie_word_embeddings`` is true when the file has no ``output`` tensor.

    Returns:
        ``(weights, config, meta)``: ``{name: mx.array float32}``, the mlx-lm
        ``config.json`` contents, and the raw GGUF metadata (``mx.load`` values).

    Raises:
        ValueError: not a llama model, or a required metadata key is missing.
    """
    import mlx.core as mx

    tensors, meta = mx.load(str(gguf_path), return_metadata=True)
    arch = metadata_scalar(meta.get("general.architecture"))
    if arch != "llama":
        raise ValueError(f"{gguf_path}: architecture {arch!r} is not supported (only 'llama')")

    def hparam(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            if default is None:
                raise ValueError(f"{gguf_path}: metadata '{arch}.{key}' is missing")
            return default
        return metadata_scalar(value)

    n_heads = int(hparam("attention.head_count"))
    n_kv_heads = int(hparam("attention.head_count_kv", n_heads))
    hidden = int(hparam("embedding_length"))
    weights = {}
    for name, value in dequantized_weights(tensors).items():
        if name.endswith("attn_q.weight"):
            value = unpermute_rows(value, n_heads)
        elif name.endswith("attn_k.weight"):
            value = unpermute_rows(value, n_kv_heads)
        weights[hf_name(name)] = value
    del tensors
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
        "vocab_size": int(hparam("vocab_size", len(list(meta["tokenizer.ggml.tokens"])))),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": token_id(meta, "bos"),
        "eos_token_id": token_id(meta, "eos"),
        "pad_token_id": token_id(meta, "padding"),
        "torch_dtype": "float32",
    }
    return weights, config, meta
