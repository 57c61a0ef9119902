"""``Scorer``: what one eviction method does, and nothing else.

A scorer gives each key one float32 score when it enters the cache (higher is kept), or
says that it keeps by position only (sinks + recent window: ``ranks = False``), or that it
never evicts (``evicts = False``). The cache engine (:mod:`qfilters_mlx.cache.kv_cache`)
stores the scores and evicts by them; it asks a scorer only the questions below, so a new
method is one subclass plus :func:`~qfilters_mlx.scorers.registry.register`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import mlx.core as mx

__all__ = ["Scorer"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scorer:
    """One eviction method: its score at insertion and the traits the cache reads.

    Args:
        layer: the layer index (seeds position-hashed scores).
        sign: ``+1`` keeps large scores of a filter projection, ``-1`` small ones
            (:attr:`KVCacheConfig.score_sign`); scorers without a filter ignore it.
        seed: the seed of a seeded scorer (``qfilters_seed``); others ignore it.

    Class attributes (the traits the cache and the config read):
        name: the registered method name (``KVCacheConfig(method=name)``).
        evicts: ``False`` for a method that keeps every token (the cache never evicts,
            every rewind is a plain trim).
        ranks: ``False`` for a method that keeps by position only: the sinks and the last
            ``budget - n_sink`` positions (its scores are never read nor stored in
            :attr:`~qfilters_mlx.cache.kv_cache.QFiltersKVCache.qfilters_kept_bytes`).
        uses_filter: the score reads a Q-Filter ``[H_kv, D]`` (given, calibrated or estimated
            online by the cache, :mod:`qfilters_mlx.cache.calibration`).
        seeded: the score reads ``seed`` (``qfilters_seed``, ``--seed``).
    """

    name: ClassVar[str] = ""
    evicts: ClassVar[bool] = True
    ranks: ClassVar[bool] = True
    uses_filter: ClassVar[bool] = False
    seeded: ClassVar[bool] = False

    layer: int = 0
    sign: int = 1
    seed: int = 0

    @classmethod
    def from_config(cls, config, layer: int = 0) -> "Scorer":
        """The scorer of ``config`` (a :class:`~qfilters_mlx.config.KVCacheConfig`) for one layer."""
        return cls(layer=layer, sign=config.score_sign, seed=config.qfilters_seed)

    def scores(self, keys: mx.array, positions: mx.array, filters=None, backend=None) -> mx.array:
        """Scores of new keys as computed (non-finite values kept).

        Args:
            keys: ``[B, H_kv, L, D]`` post-RoPE keys, full precision.
            positions: ``[B, H_kv, L]`` int64 absolute positions.
            filters: ``[H_kv, D]`` float32 Q-Filter (scorers with ``uses_filter``), else ``None``.
            backend: the cache's kernel backend (:mod:`qfilters_mlx.backends`), or ``None``
                for the pure-MLX reference.

        Returns:
            ``[B, H_kv, L]`` float32. This base keeps by position: zeros (never read).
        """
        return mx.zeros(keys.shape[:3], dtype=mx.float32)

    def insertion_scores(self, keys, positions, filters=None, backend=None) -> mx.array:
        """:meth:`scores` with every non-finite score (a key holding NaN or inf) mapped to
        ``-inf``: such a token is evicted before any finite-scored one unless it is a sink
        or in the recent window. ``[B, H_kv, L]`` float32."""
        s = self.scores(keys, positions, filters, backend)
        return mx.where(mx.isfinite(s), s, -mx.inf) if self.ranks else s

    def decode_select(self, backend, scores, positions, keys, filters, free, position: int,
                      n_sink: int, recent):
        """One slot-mode decode step's bookkeeping: score the key just written into slot
        ``free`` and pick the next slot to free (``backend.decode_select``, whose reference
        is :func:`qfilters_mlx.backends.reference.decode_select`).

        Args:
            backend: the cache's kernel backend.
            scores: ``[B, H_kv, S]`` float32; positions: ``[B, H_kv, S]`` int64 (``S`` slots).
            keys: ``[B, H_kv, 1, D]`` the new key, full precision; filters: as :meth:`scores`.
            free: ``[B, H_kv]`` int32 the slot the new key was written to.
            position: its absolute position; n_sink, recent: the protected positions.

        Returns:
            ``(scores, positions, free)`` after the step.
        """
        pos = mx.full((*keys.shape[:2], 1), position, dtype=mx.int64)
        new = self.scores(keys, pos, filters, backend)
        return backend.decode_select(scores, positions, new, free, position, n_sink, recent)
