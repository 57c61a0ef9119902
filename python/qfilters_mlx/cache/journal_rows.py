"""Pure functions on the cache's row arrays ``rows = (keys, values, scores, positions)``
(each ``[B, H, capacity, ...]``) that the rewind journal (:mod:`.journal`) records and undoes
with: the rows an eviction dropped, rows of a position range, a slot layout rebuilt.
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["dropped_rows", "pad_rows", "rows_between", "to_slots"]

_BIG = 2**62


def dropped_rows(kept: mx.array, arrays: tuple) -> tuple:
    """The rows of ``arrays`` (each ``[B, H, n, ...]``) not listed in ``kept [B, H, K]``,
    ascending: ``[B, H, n - K, ...]`` (the rows an eviction drops)."""
    B, H, n = arrays[2].shape
    K = kept.shape[2]
    is_kept = mx.put_along_axis(mx.zeros((B, H, n), mx.int32), kept.astype(mx.int32),
                                mx.array(n, mx.int32), axis=2)
    order = mx.argsort(mx.arange(n, dtype=mx.int32)[None, None] + is_kept, axis=2)[:, :, : n - K]
    return tuple(mx.take_along_axis(a, order[..., None] if a.ndim == 4 else order, axis=2)
                 for a in arrays)


def pad_rows(a: mx.array, rows: int) -> mx.array:
    """``a [B, H, n, ...]`` followed by zero rows up to ``rows`` (``rows <= n``: ``a``
    itself): a buffer back at the size it had before an undone call or step (rows grown
    in step blocks, never written, are zeros)."""
    if rows <= a.shape[2]:
        return a
    return mx.concatenate([a, mx.zeros((*a.shape[:2], rows - a.shape[2], *a.shape[3:]), a.dtype)], axis=2)


def rows_between(arrays: tuple, lo: int, hi: int, n: int) -> tuple:
    """The ``n`` rows per (batch row, head) with ``lo <= position < hi``, in temporal
    order, from ``arrays = (keys, values, scores, positions)`` (each head holds
    exactly ``n`` such rows)."""
    pos = arrays[3]
    key = mx.where((pos >= lo) & (pos < hi), pos, mx.array(_BIG, mx.int64))
    order = mx.argsort(key, axis=2)[:, :, :n]
    return tuple(mx.take_along_axis(a, order[..., None] if a.ndim == 4 else order, axis=2)
                 for a in arrays)


def to_slots(arrays: tuple, order: mx.array) -> tuple:
    """Put temporal rows (``[B, H, S-1, ...]``) back into the slot layout they were
    taken from (``order [B, H, S-1]``: the slot of each row). The one slot not in
    ``order`` is the free slot, whose content is never read (zeros)."""
    out = []
    for a in arrays:
        B, H, n = a.shape[:3]
        buf = mx.zeros((B, H, n + 1, *a.shape[3:]), a.dtype)
        idx = order.astype(mx.int32)
        out.append(mx.put_along_axis(buf, idx[..., None] if a.ndim == 4 else idx, a, axis=2))
    return tuple(out)
