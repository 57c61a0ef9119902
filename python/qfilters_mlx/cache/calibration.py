"""Online filter calibration of ``QFiltersKVCache``: functions the cache calls.

A cache whose filter is not given (``qfilters_filter_source="queries"`` or ``"keys"``)
freezes it from exactly the first ``calib_tokens`` tokens it sees: a key-based filter in
the ``update_and_fetch`` call that crosses ``calib_tokens``, a query-based one in
``observe_queries`` once the first ``calib_tokens`` queries have arrived
(:func:`observe_queries`, the cache's method of that name; the key-based one is decided on
the cache's hot path). Estimators in :mod:`qfilters_mlx.backends.reference` (Godey et al.
2025, arXiv:2503.02812, Sec. 3). :func:`observe_queries` reads and writes the cache's own
(underscore) state, as the cache's other component modules do; the rest are pure.
"""

from __future__ import annotations

import mlx.core as mx

from qfilters_mlx.backends import reference
from qfilters_mlx.cache.journal import CallRecord

__all__ = ["check_queries", "checked_filters", "estimate_filter", "first_queries", "observe_queries"]


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


def checked_filters(config, filters):
    """A cache constructor's ``filters`` argument checked and cast to float32: ``[H_kv, D]``
    floating point, or ``None`` unless the config needs given filters (a scorer reading a
    filter with ``qfilters_filter_source="calibrated"``).

    Raises:
        ValueError: not a 2-d ``mx.array``, a head dimension other than ``config.head_dim``,
            or ``None`` where the calibrated filter is needed (names where it comes from).
        TypeError: not floating point.
    """
    if filters is not None:
        if not isinstance(filters, mx.array) or filters.ndim != 2:
            raise ValueError("filters must be an mx.array [H_kv, D], got "
                             f"{getattr(filters, 'shape', type(filters).__name__)}")
        if not mx.issubdtype(filters.dtype, mx.floating):
            raise TypeError(f"filters must be floating point, got {filters.dtype}")
        hd = config.head_dim
        if hd is not None and filters.shape[1] != hd:
            raise ValueError(f"filters head_dim {filters.shape[1]} != config.head_dim {hd}")
        return filters.astype(mx.float32)
    if config.scorer.uses_filter and config.qfilters_filter_source == "calibrated":
        raise ValueError(
            "qfilters_filter_source='calibrated' (the default) scores with the model's calibrated "
            "query filter, which KVCacheBuilder.for_model / install find or make: build the caches "
            "with them, pass filters= ([H_kv, D]), or choose an online filter "
            "(qfilters_filter_source='queries' inside observe_queries, or 'keys')")
    return None


def observe_queries(cache, queries: mx.array) -> None:
    """Receive this call's post-RoPE queries ``[B, H_q, L, D]`` (from ``observe_queries``).

    Called after ``update_and_fetch`` of the same call (attention runs after
    the cache returns keys). Keeps the first ``calib_tokens`` queries; once
    they are all there, freezes the filter, scores the stored tokens and
    evicts down to the budget, exactly as a key-based cache does at the end
    of the call that crosses ``calib_tokens``.

    Raises:
        ValueError: ``queries`` not a 4-D array, no update before it, or a shape that does
            not fit the cache (the message names both), before anything changes.
    """
    if not cache.needs_queries:
        cache._queries_pending = False
        return
    layout = None if cache.keys is None else cache.storage.layout(cache.keys, cache.values)
    check_queries(queries, layout, cache.offset)
    cache._queries_pending = False
    record = cache._journal.last() if cache._journal.active else None
    if isinstance(record, CallRecord) and record.offset + record.tokens == cache.offset:
        record.observed = queries  # (re-applied on a partial rewind)
    c = cache.config.qfilters_calib_tokens
    cache._queries = first_queries(cache._queries, queries, c, cache.offset)
    if cache._queries is not None and cache._queries.shape[2] >= c:
        cache._calibrate()
        if cache._n > cache.limits.budget:
            cache._evict()
        mx.async_eval(cache.positions, cache.scores)
