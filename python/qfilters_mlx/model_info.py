"""What a model's layers store: key head width, KV heads, layer count, identity.

One place for model introspection, shared by the cache builder, calibration and
the evaluation.
"""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx


def model_head_dim(model) -> int:
    """Key head dimension of an mlx-lm model.

    Uses ``model.args.head_dim`` when present, else ``hidden_size // num_attention_heads``.

    Raises:
        ValueError: the model exposes neither.
    """
    args = getattr(model, "args", None)
    hd = getattr(args, "head_dim", None)
    if hd:
        return int(hd)
    hidden = getattr(args, "hidden_size", None)
    heads = getattr(args, "num_attention_heads", None)
    if hidden and heads:
        return int(hidden) // int(heads)
    raise ValueError("cannot infer head_dim: model.args has neither head_dim nor hidden_size/num_attention_heads")


def model_dims(model) -> tuple[int, int, int]:
    """``(n_layers, n_kv_heads, head_dim)`` of an mlx-lm model."""
    args = model.args
    n_kv = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    return len(model.layers), int(n_kv), model_head_dim(model)


def model_identity(model) -> str:
    """A stable hash (16 hex chars) of the model's configuration (``model.args``)."""
    args = {k: v for k, v in sorted(vars(model.args).items())}
    blob = json.dumps(args, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def check_filters_shape(filters, model) -> None:
    want = model_dims(model)
    if not isinstance(filters, mx.array) or tuple(filters.shape) != want:
        raise ValueError(f"filters must have shape [n_layers, n_kv_heads, head_dim] = {want}, "
                         f"got {getattr(filters, 'shape', type(filters).__name__)}")
    if not mx.issubdtype(filters.dtype, mx.floating):
        raise TypeError(f"filters must be floating point, got {filters.dtype}")
