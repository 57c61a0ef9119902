"""The random control arm: a seeded uniform score in ``[0, 1)`` per (layer, KV head, absolute
position), hashed with MurmurHash3's 32-bit finaliser, so that the kept set does not depend on
how the prompt was chunked."""

from __future__ import annotations

import mlx.core as mx

from qfilters_mlx.scorers.base import Scorer
from qfilters_mlx.scorers.registry import register

__all__ = ["RandomScorer", "random_scores"]

_GOLDEN = 0x9E3779B1
_MIX1 = 0x85EBCA6B
_MIX2 = 0xC2B2AE35


def _u32(x: int) -> mx.array:
    return mx.array(x & 0xFFFFFFFF, dtype=mx.uint32)


def _fmix32(h: mx.array) -> mx.array:
    """MurmurHash3's 32-bit finaliser (wrapping uint32 arithmetic)."""
    h = h ^ (h >> 16)
    h = h * _u32(_MIX1)
    h = h ^ (h >> 13)
    h = h * _u32(_MIX2)
    return h ^ (h >> 16)


def random_scores(positions: mx.array, seed: int, layer: int) -> mx.array:
    """Seeded uniform scores in ``[0, 1)`` that depend only on (seed, layer, head, position).

    Args:
        positions: ``[B, H, L]`` integer absolute token positions.
        seed: non-negative int; layer: layer index.

    Returns:
        ``[B, H, L]`` float32.
    """
    H = positions.shape[1]
    head = mx.arange(H, dtype=mx.uint32)[None, :, None]
    h = positions.astype(mx.uint32) * _u32(_GOLDEN)
    h = h ^ _fmix32(head + _u32(seed * 0x27D4EB2F + layer * 0x165667B1 + 1))
    h = _fmix32(h)
    return (h >> 8).astype(mx.float32) * (1.0 / (1 << 24))


@register
class RandomScorer(Scorer):
    """:func:`random_scores` of the key's position (``qfilters_seed``, the layer)."""

    name = "random"
    seeded = True

    def scores(self, keys, positions, filters=None, backend=None):
        return random_scores(positions, self.seed, self.layer)
