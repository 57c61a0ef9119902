"""Insertion-time scores of the methods that share the eviction engine.

Each token is scored once, when it enters the cache; the score never changes.
Higher scores are kept. See DESIGN.md, "Scorers sharing one eviction engine":

=============== ============================= ==========================================
method          score at insertion            source
=============== ============================= ==========================================
qfilters        ``sign * <k, u>``             Godey et al. 2025, arXiv:2503.02812
l2norm          ``-||k||_2``                  Devoto et al. 2024 (kvpress KnormPress)
streaming_llm   none (sinks + recent window)  Xiao et al. 2023
random          seeded uniform in ``[0, 1)``  control arm
full            none (never evicts)           baseline
=============== ============================= ==========================================
"""

from __future__ import annotations

import mlx.core as mx

from qfilters_mlx.backends import reference

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

    Being a pure function of the absolute position, the random arm is
    reproducible and independent of how the prompt was chunked.

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


def insertion_scores(method: str, keys: mx.array, positions, *, filters=None,
                     sign: int = 1, seed: int = 0, layer: int = 0, backend=None,
                     finite: bool = True) -> mx.array:
    """Scores ``[B, H, L]`` float32 of new keys ``[B, H, L, D]`` for ``method``.

    ``qfilters`` needs ``filters`` ``[H, D]`` and uses ``backend.projection_scores``
    when a backend is given (the reference otherwise). A non-finite score (a key
    holding NaN or inf) becomes ``-inf``: such a token is evicted before any
    finite-scored one, unless it is a sink or in the recent window. With
    ``finite=False`` the scores are returned as computed (NaN/inf kept), for a caller
    that maps them itself (the slot cache's ``decode_select``).
    """
    if method in ("qfilters", "l2norm"):
        if method == "qfilters":
            fn = backend.projection_scores if backend is not None else reference.projection_scores
            s = fn(keys, filters, sign)
        else:
            s = reference.l2norm_scores(keys)
        # Non-finite keys (NaN/inf) rank lowest: never kept over a finite-scored token.
        # (`finite=False` leaves that to the caller: decode_insert does it itself.)
        return mx.where(mx.isfinite(s), s, -mx.inf) if finite else s
    if method == "random":
        return random_scores(positions, seed, layer)
    # streaming_llm and full never rank by score.
    return mx.zeros(keys.shape[:3], dtype=mx.float32)
