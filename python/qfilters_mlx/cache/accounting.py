"""Byte accounting of ``QFiltersKVCache``: pure functions of its arrays.

The cache's properties (``nbytes``, ``journal_nbytes``, ``kept_kv_bytes``,
``full_seq_bytes``, ``qfilters_kept_bytes``, ``compression_ratio``;
:mod:`qfilters_mlx.cache.kv_cache`) call these with the arrays they hold. Stored rows
are counted as stored: the model's dtype, or packed ``uint32`` words with their scales
and biases when quantized (:mod:`qfilters_mlx.cache.quantized`).
"""

from __future__ import annotations

__all__ = ["FILTER_BYTES_PER_ELEMENT", "arrays_nbytes", "kv_bytes", "method_bytes"]

FILTER_BYTES_PER_ELEMENT = 4  # filters are float32


def arrays_nbytes(*arrays) -> int:
    """Bytes of the given arrays (``None`` counts 0; a tuple counts its arrays)."""
    total = 0
    for a in arrays:
        if isinstance(a, (tuple, list)):
            total += arrays_nbytes(*a)
        elif a is not None:
            total += a.nbytes
    return total


def kv_bytes(keys, values, tokens: int) -> int:
    """K/V bytes of ``tokens`` rows stored like ``keys`` / ``values`` (``[B, H_kv, *, D]``
    buffers; ``None``: 0): ``B * H * tokens * (D_k * itemsize_k + D_v * itemsize_v)``."""
    if keys is None:
        return 0
    B, H, _, Dk = keys.shape
    Dv = values.shape[3]
    return B * H * tokens * (Dk * keys.dtype.size + Dv * values.dtype.size)


def method_bytes(method: str, keys, values, n: int, filt) -> int:
    """Bytes the eviction method needs for ``n`` kept rows: their K/V (:func:`kv_bytes`),
    their float32 scores when it ranks by score (``qfilters``, ``l2norm``, ``random``:
    ``B * H * n * 4``) and the frozen filter in full (``H_kv * D * 4``)."""
    if keys is None:
        return 0
    B, H = keys.shape[:2]
    total = kv_bytes(keys, values, n)
    if method in ("qfilters", "l2norm", "random"):
        total += B * H * n * 4
    if filt is not None:
        total += filt.size * FILTER_BYTES_PER_ELEMENT
    return total
