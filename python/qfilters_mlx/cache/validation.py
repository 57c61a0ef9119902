"""Input checks of ``update_and_fetch`` (mixin of ``QFiltersKVCache``): every check runs
before any state changes, and each error names the argument and the expected shape or dtype."""

from __future__ import annotations

import mlx.core as mx


class ValidationMixin:
    """``_validate(keys, values)``: rank, dtype, shape agreement with the cache and its filter,
    and the query-observation contract of query-calibrated caches.

    Raises:
        TypeError: not an ``mx.array``, not floating point, or dtypes that disagree.
        ValueError: not ``[B, H_kv, L, D]``, ``L == 0``, a shape that does not match the cache
            or its filter, or queries that a query-calibrated cache needs but never saw.
    """

    @staticmethod
    def _checked_filters(config, filters):
        """The constructor's ``filters`` argument checked (``[H_kv, D]`` floating point, or
        ``None`` unless the config needs it: the calibrated filter) and cast to float32."""
        if filters is not None:
            if not isinstance(filters, mx.array) or filters.ndim != 2:
                raise ValueError("filters must be an mx.array [H_kv, D], got "
                                 f"{getattr(filters, 'shape', type(filters).__name__)}")
            if not mx.issubdtype(filters.dtype, mx.floating):
                raise TypeError(f"filters must be floating point, got {filters.dtype}")
            hd = config.head_dim
            if hd is not None and filters.shape[1] != hd:
                raise ValueError(f"filters head_dim {filters.shape[1]} != config.head_dim {hd}")
            filters = filters.astype(mx.float32)
        elif config.method == "qfilters" and config.qfilters_filter_source == "calibrated":
            raise ValueError(
                "qfilters_filter_source='calibrated' (the default) scores with the model's calibrated "
                "query filter, which KVCacheBuilder.for_model / install find or make: build the caches "
                "with them, pass filters= ([H_kv, D]), or choose an online filter "
                "(qfilters_filter_source='queries' inside observe_queries, or 'keys')")
        return filters

    def _input_layout(self) -> tuple:
        """``(B, H_kv, D_k, D_v, dtype)`` of the inputs the stored rows came from
        (the stored buffers' own here; the quantized cache overrides it). Needs a non-empty cache."""
        B, H, _, D = self.keys.shape
        return B, H, D, self.values.shape[3], self.keys.dtype

    def _validate(self, keys, values) -> None:
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
        if self.needs_queries and not self.queries_observed:
            raise ValueError(
                "this cache estimates its filter from queries (qfilters_sign='auto' or "
                "qfilters_filter_source='queries'): run the model inside "
                "`with qfilters_mlx.observe_queries(model, caches):`"
            )
        if self.needs_queries and getattr(self, "_queries_pending", False):
            raise ValueError(
                f"layer {self.layer_idx}: the queries of the previous update_and_fetch never arrived "
                "(observe_queries did not see this layer's attention), so this cache cannot estimate "
                "its filter and would grow past its budget; use qfilters_filter_source='keys' with "
                "qfilters_sign=+1 or -1, or filters from a file (`qfilters-mlx calibrate`)"
            )
        if self.filter is not None and tuple(self.filter.shape) != (keys.shape[1], keys.shape[3]):
            raise ValueError(
                f"filters shape {tuple(self.filter.shape)} does not match keys "
                f"[H_kv, D] = {(keys.shape[1], keys.shape[3])}"
            )
        window = self.recent_window
        if not isinstance(window, int) and len(window) != keys.shape[1]:
            raise ValueError(f"layer {self.layer_idx}: qfilters_recent has {len(window)} per-head "
                             f"windows, the keys have H_kv = {keys.shape[1]} heads")
        hd = self.config.head_dim
        if hd is not None and keys.shape[3] != hd:
            raise ValueError(f"keys head_dim {keys.shape[3]} does not match config.head_dim {hd}")
        if self.keys is not None:
            B, H, D, Dv, dtype = self._input_layout()
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
        self._queries_pending = self.needs_queries
