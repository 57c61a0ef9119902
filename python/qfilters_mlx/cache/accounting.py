"""Byte accounting of ``QFiltersKVCache``: what it holds, and holding no more.

The cache's properties (``nbytes``, ``journal_nbytes``, ``kept_kv_bytes``,
``full_seq_bytes``, ``qfilters_kept_bytes``, ``compression_ratio``;
:mod:`qfilters_mlx.cache.kv_cache`) call the pure functions here with the arrays they hold.
Stored rows are counted as stored: the model's dtype, or packed ``uint32`` words with
their scales and biases when quantized (:mod:`qfilters_mlx.cache.quantized`).
:func:`shrink_to_fit` (``QFiltersKVCache.shrink_to_fit``) cuts what a cache holds to what
these count; like the cache's other component modules it reads and writes the cache's own
(underscore) state.
"""

from __future__ import annotations

import mlx.core as mx

from qfilters_mlx.cache.rows import Rows

__all__ = ["FILTER_BYTES_PER_ELEMENT", "arrays_nbytes", "cache_nbytes", "compression_ratio",
           "full_seq_bytes", "journal_nbytes", "kept_kv_bytes", "kv_bytes", "method_bytes",
           "qfilters_kept_bytes", "shrink_to_fit"]

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


def method_bytes(ranks: bool, keys, values, n: int, filt) -> int:
    """Bytes the eviction method needs for ``n`` kept rows: their K/V (:func:`kv_bytes`),
    their float32 scores when its scorer ranks by score (``ranks``, :attr:`Scorer.ranks`:
    ``B * H * n * 4``) and the frozen filter in full (``H_kv * D * 4``)."""
    if keys is None:
        return 0
    B, H = keys.shape[:2]
    total = kv_bytes(keys, values, n)
    if ranks:
        total += B * H * n * 4
    if filt is not None:
        total += filt.size * FILTER_BYTES_PER_ELEMENT
    return total


def journal_nbytes(cache) -> int:
    """Bytes held only to make rewinds exact (``max_rewind``): per decode step recorded, the
    slot and the rows it held (``B H (4 + (D_k + D_v) itemsize + 12)``; the step entering
    slot mode: the scores/positions buffers before it, ``12 B H capacity``); per multi-token
    call, the rows its eviction dropped (:attr:`RewindJournal.nbytes`); plus the free slot's
    rows."""
    return cache._journal.nbytes + arrays_nbytes(cache._victim_rows)


def cache_nbytes(cache) -> int:
    """Bytes of every array the cache holds: buffers at capacity, scores, positions, filter,
    the rewind journal (:func:`journal_nbytes`) and what the storage holds besides the rows
    (quantized: the full-precision keys kept until the first eviction)."""
    return (arrays_nbytes(cache.keys, cache.values, cache.scores, cache.positions, cache.filter)
            + journal_nbytes(cache) + cache.storage.nbytes)


def shrink_to_fit(cache, journal_rows: int | None = None) -> None:
    """Hold only what the cache needs from now on, as buffers of its own: the K/V, score
    and position buffers cut to the live rows (``size()``; in slot mode the ``budget + 1``
    slots), the rewind journal cut to at most ``journal_rows`` K/V rows (oldest records
    dropped first: ``rewindable_tokens`` shrinks to what the rest cover; ``None``: kept
    whole), and every array that is a view of a larger buffer copied out of it
    (``mx.contiguous``), then evaluated. What it holds afterwards is what ``nbytes`` counts.
    Outputs, kept sets and every rewind still within reach are unchanged (the spare rows of
    a step block hold nothing; a buffer grows again on the next append).

    For a cache kept at rest (a stored prompt cache): mlx-lm's ``copy.deepcopy`` of an
    array keeps the whole buffer it is a view of, and buffers grow in ``step`` blocks.

    Raises:
        ValueError: ``journal_rows < 0``.
    """
    if journal_rows is not None:
        cache._journal.keep_rows(journal_rows)
    rows = cache._n if cache._free is None else cache.scores.shape[2]

    def fit(a, cut=True):
        if a is None:
            return None
        if isinstance(a, tuple):
            return tuple(fit(x, cut) for x in a)
        return mx.contiguous(a[:, :, :rows] if cut else a)

    if cache.rows.keys is not None:
        cache.rows = Rows(*(fit(a) for a in cache.rows))
    cache.filter, cache._queries = fit(cache.filter, False), fit(cache._queries, False)
    cache._victim_rows, cache._free = fit(cache._victim_rows, False), fit(cache._free, False)
    cache._journal.pack_steps()  # (a run of decode steps: five arrays, not five per step)
    cache._journal.map_arrays(mx.contiguous)
    cache.storage.map_arrays(mx.contiguous)
    cache._last_kv = None
    held = (*cache.rows, cache.filter, cache._queries, cache._victim_rows, cache._free)
    mx.eval([a for a in held if a is not None] + cache._journal.arrays() + cache.storage.arrays())


def kept_kv_bytes(cache) -> int:
    """Bytes of the kept K/V rows alone (``size()`` rows as stored: packed words, scales
    and biases when quantized), without buffer slack, scores or filter."""
    return kv_bytes(cache.keys, cache.values, cache.size())


def full_seq_bytes(cache) -> int:
    """K/V bytes a full cache would hold for ``tokens_seen`` tokens, stored as this cache
    stores rows (quantized: a full ``QuantizedKVCache`` of the same bits)."""
    return kv_bytes(cache.keys, cache.values, cache.offset)


def qfilters_kept_bytes(cache) -> int:
    """Bytes the method needs (:func:`method_bytes`): kept K/V, their float32 scores when
    its scorer ranks by score, and the frozen filter in full (``H_kv * D * 4`` bytes)."""
    return method_bytes(cache.scorer.ranks, cache.keys, cache.values, cache.size(), cache.filter)


def compression_ratio(cache) -> float:
    """``full_seq_bytes / qfilters_kept_bytes`` (1.0 when empty)."""
    kept = qfilters_kept_bytes(cache)
    return full_seq_bytes(cache) / kept if kept else 1.0
