"""The input checks of ``QFiltersKVCache.update_and_fetch``, run before any state changes:
rank, dtype and shape agreement with the cache, its filter and its storage, and the
query-observation contract of query-calibrated caches. Like the cache's other component
modules it reads the cache's own (underscore) state."""

from __future__ import annotations

import mlx.core as mx

__all__ = ["check_update"]


def check_update(cache, keys, values) -> None:
    """Check one call's ``keys``, ``values`` (``[B, H_kv, L, D]``) against ``cache``; on
    success, mark the call's queries as owed when the cache waits for them.

    Raises:
        TypeError: not an ``mx.array``, not floating point, or dtypes that disagree.
        ValueError: not ``[B, H_kv, L, D]``, ``L == 0``, a shape that does not match the
            cache, its filter or its storage, or queries that a query-calibrated cache
            needs but never saw.
    """
    cache.storage.check(keys, values)
    for name, x in (("keys", keys), ("values", values)):
        if not isinstance(x, mx.array):
            raise TypeError(f"{name} must be an mx.array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must be [B, H_kv, L, D], got shape {tuple(x.shape)}")
        if not mx.issubdtype(x.dtype, mx.floating):
            raise TypeError(f"{name} must be a floating dtype, got {x.dtype}")
    if keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"keys and values must agree on [B, H_kv, L], got {tuple(keys.shape)} "
            f"and {tuple(values.shape)}"
        )
    if keys.dtype != values.dtype:
        raise TypeError(f"keys and values must share a dtype, got {keys.dtype} and {values.dtype}")
    if keys.shape[2] == 0:
        raise ValueError("keys must hold at least one token (L >= 1)")
    if cache.needs_queries and not cache.queries_observed:
        raise ValueError(
            "this cache estimates its filter from queries (qfilters_sign='auto' or "
            "qfilters_filter_source='queries'): run the model inside "
            "`with qfilters_mlx.observe_queries(model, caches):`"
        )
    if cache.needs_queries and cache._queries_pending:
        raise ValueError(
            f"layer {cache.layer_idx}: the queries of the previous update_and_fetch never arrived "
            "(observe_queries did not see this layer's attention), so this cache cannot estimate "
            "its filter and would grow past its budget; use qfilters_filter_source='keys' with "
            "qfilters_sign=+1 or -1, or filters from a file (`qfilters-mlx calibrate`)"
        )
    if cache.filter is not None and tuple(cache.filter.shape) != (keys.shape[1], keys.shape[3]):
        raise ValueError(
            f"filters shape {tuple(cache.filter.shape)} does not match keys "
            f"[H_kv, D] = {(keys.shape[1], keys.shape[3])}"
        )
    window = cache.recent_window
    if not isinstance(window, int) and len(window) != keys.shape[1]:
        raise ValueError(f"layer {cache.layer_idx}: qfilters_recent has {len(window)} per-head "
                         f"windows, the keys have H_kv = {keys.shape[1]} heads")
    if cache.keys is None:  # (the first call; later ones are checked against the stored rows)
        hd = cache.config.head_dim
        if hd is not None and keys.shape[3] != hd:
            raise ValueError(f"keys head_dim {keys.shape[3]} does not match config.head_dim {hd}")
    else:
        B, H, D, Dv, dtype = cache.storage.layout(cache.keys, cache.values)
        if (keys.shape[0], keys.shape[1], keys.shape[3]) != (B, H, D):
            raise ValueError(
                f"keys [B, H_kv, L, D] = {tuple(keys.shape)} do not match the cache "
                f"(B={B}, H_kv={H}, D={D})"
            )
        if values.shape[3] != Dv:
            raise ValueError(f"values head_dim {values.shape[3]} does not match the cache ({Dv})")
        if keys.dtype != dtype:
            raise TypeError(f"keys dtype {keys.dtype} does not match the cache ({dtype})")
    # Checks passed: the update goes ahead; a cache waiting for queries expects this
    # call's queries (observe_queries) before its next update.
    cache._queries_pending = cache.needs_queries
