"""The state of one layer's eviction cache as values, and the one eviction routine.

* :class:`Rows`: the live rows, one value (keys, values, scores, positions) that the cache
  holds as ``cache.rows`` and its component modules take and return (the rewind journal's
  undo functions, compress-once, byte accounting, persistence).
* :class:`Limits`: what the next eviction keeps (budget, sinks, recent window) and whether
  the cache is in the compress-once mode, resolved from the configuration once: when the cache
  is set up, loaded or compressed (:func:`resolve_limits`), not on every call.
* :func:`evict`: the selection and compaction of the kept rows, the one routine of the
  streaming eviction and of the compression.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx

__all__ = ["EMPTY", "Limits", "Rows", "evict", "resolve_limits", "window"]


class Rows(NamedTuple):
    """The rows a cache holds, each ``None`` while it is empty.

    Attributes:
        keys, values: ``[B, H_kv, capacity, D]`` buffers in the storage's layout (the model's
            dtype, or packed ``uint32`` words when quantized); rows ``[0, size())`` are live
            (in slot mode ``budget + 1`` slots, one free).
        scores: ``[B, H_kv, capacity]`` float32 insertion scores (meaningful once scoring is ready).
        positions: ``[B, H_kv, capacity]`` int64 absolute positions.
    """

    keys: mx.array | None
    values: mx.array | None
    scores: mx.array | None
    positions: mx.array | None

    def head(self, n: int) -> "Rows":
        """The first ``n`` rows of each array (``None`` stays ``None``)."""
        return Rows(*(None if a is None else a[:, :, :n] for a in self))

    def take(self, order: mx.array) -> "Rows":
        """The rows ``order [B, H_kv, m]`` (int) of each array, gathered along the row axis."""
        return Rows(*(mx.take_along_axis(a, order[..., None] if a.ndim == 4 else order, axis=2)
                      for a in self))


EMPTY = Rows(None, None, None, None)


class Limits(NamedTuple):
    """What the next eviction keeps, per (batch row, KV head).

    Attributes:
        budget: rows kept after a call (``math.inf``: none evicted: compress-once before its
            compression, or after it without ``growth``).
        n_sink: leading positions kept.
        recent: trailing positions kept: one int, or ``H_kv`` ints (per-head windows).
        once: the compress-once mode (single-token calls append while below ``budget``).
    """

    budget: int | float
    n_sink: int
    recent: int | tuple
    once: bool


def window(config, ranks: bool, budget: int | float) -> tuple:
    """``(n_sink, recent)`` of a compress-once cache keeping ``budget`` rows: cut to it, sinks
    first (a scorer that keeps by position only, ``ranks`` False: the newest rows fill the rest)."""
    sinks = min(config.qfilters_n_sink, budget)
    if not ranks:
        return sinks, budget - sinks
    return sinks, min(config.qfilters_recent, budget - sinks)


def resolve_limits(config, recent, ranks: bool, compressed: int | None) -> Limits:
    """The limits of a cache of ``config``.

    Args:
        recent: the layer's recent window (``config.layer_recent(layer)``: an int or ``H_kv``
            ints).
        ranks: the scorer ranks by score (:attr:`Scorer.ranks`).
        compressed: compress-once: the rows its compression kept, ``None`` before it.
    """
    if not config.compress_once:
        return Limits(config.qfilters_budget, config.qfilters_n_sink, recent, False)
    growth = config.mode.growth
    budget = math.inf if compressed is None or growth is None else max(1, compressed + growth)
    return Limits(budget, *window(config, ranks, budget), True)


def evict(backend, rows: Rows, n: int, budget: int, n_sink: int, recent) -> tuple:
    """``(kept, rows)``: the rows of the first ``n`` of ``rows`` that an eviction to ``budget``
    keeps (the first ``n_sink`` and last ``recent`` positions, the rest by highest score, ties
    to the earlier position, in temporal order: ``backend.select_compact``), and ``kept
    [B, H_kv, budget]`` int32, their indices among the ``n``."""
    live = rows.head(n)
    kept, k, v = backend.select_compact(live.scores, live.keys, live.values, budget, n_sink, recent)
    return kept, Rows(k, v, mx.take_along_axis(live.scores, kept, axis=2),
                      mx.take_along_axis(live.positions, kept, axis=2))
