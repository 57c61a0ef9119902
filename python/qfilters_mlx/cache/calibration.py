"""Online filter calibration of ``QFiltersKVCache``: pure functions the cache calls.

A cache whose filter is not given (``qfilters_filter_source="queries"`` or ``"keys"``)
freezes it from exactly the first ``calib_tokens`` tokens it sees: a key-based filter in
the ``update_and_fetch`` call that crosses ``calib_tokens``, a query-based one in
``observe_queries`` once the first ``calib_tokens`` queries have arrived
(:mod:`qfilters_mlx.cache.kv_cache` decides when; this module computes). Estimators in
:mod:`qfilters_mlx.backends.reference` (Godey et al. 2025, arXiv:2503.02812, Sec. 3).
"""

from __future__ import annotations

import mlx.core as mx

from qfilters_mlx.backends import reference

__all__ = ["check_queries", "estimate_filter", "first_queries"]


def estimate_filter(config, keys: mx.array, queries: mx.array | None) -> mx.array:
    """The ``[H_kv, D]`` float32 filter of ``config``'s online source.

    Args:
        config: the cache's ``KVCacheConfig`` (``qfilters_filter_source``, ``qfilters_sign``,
            ``qfilters_calib_tokens``).
        keys: ``[B, H_kv, >= calib, D]`` full-precision keys of the first tokens.
        queries: ``[B, H_q, >= calib, D]`` their post-RoPE queries (``"queries"`` source or
            ``qfilters_sign="auto"``), else unused.

    Returns:
        ``queries``: the queries' top singular direction per KV head; ``keys``: the keys'
        (key-SVD), turned towards the queries per head with ``qfilters_sign="auto"``.
    """
    c = config.qfilters_calib_tokens
    if config.qfilters_filter_source == "queries":
        return reference.estimate_filter_from_queries(queries[:, :, :c], keys.shape[1])
    f = reference.estimate_filter_from_keys(keys[:, :, :c])
    if config.qfilters_sign == "auto":
        f = f * reference.query_orientation(f, queries[:, :, :c])[:, None]
    return f


def check_queries(queries, layout: tuple | None, offset: int) -> None:
    """Raise unless ``queries`` (``observe_queries``' argument) fit a cache whose inputs
    are ``layout = (B, H_kv, D, ...)`` (``None``: nothing stored yet) at ``offset``.

    Raises:
        ValueError: not a 4-D ``mx.array``, no update before it, or a shape that does not fit
            (``B`` equal, ``H_q`` a multiple of ``H_kv``, ``D`` equal, ``L <= offset``).
    """
    if not isinstance(queries, mx.array) or queries.ndim != 4 or layout is None:
        raise ValueError("queries must be an mx.array [B, H_q, L, D] observed after an update")
    B, H, D = layout[:3]
    if (queries.shape[0] != B or queries.shape[1] % H or queries.shape[3] != D
            or queries.shape[2] > offset):
        raise ValueError(f"queries {tuple(queries.shape)} do not fit the cache "
                         f"(B={B}, H_kv={H}, D={D}, offset={offset})")


def first_queries(kept: mx.array | None, queries: mx.array, calib_tokens: int, offset: int):
    """The first ``min(calib_tokens, offset)`` queries ever observed: ``kept`` (``[B, H_q,
    have, D]`` or ``None``) followed by the head of this call's ``queries`` (whose first row
    is token ``have``); ``kept`` itself when it already holds them."""
    have = 0 if kept is None else kept.shape[2]
    need = min(calib_tokens, offset) - have
    if need <= 0:
        return kept
    new = queries[:, :, :need]
    return new if kept is None else mx.concatenate([kept, new], axis=2)
