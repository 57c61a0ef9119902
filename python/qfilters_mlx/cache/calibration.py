"""Filter calibration of ``QFiltersKVCache`` (mixin): when a cache can score, freezing the
online Q-Filter from the first ``calib_tokens`` keys or queries, and receiving queries.

Step 2 of an ``update_and_fetch`` call (:mod:`.kv_cache`): a key-based filter is frozen in
the call that crosses ``calib_tokens``; a query-based one in :meth:`observe_queries`, once
the first ``calib_tokens`` queries have arrived. Estimators in :mod:`..backends.reference`.
"""

from __future__ import annotations

import mlx.core as mx

from qfilters_mlx.backends import reference


class CalibrationMixin:
    """The filter's life cycle: ``filter`` is ``None`` until calibration (online sources),
    then fixed; a filter given to the constructor (``filter_fixed``) needs none."""

    @property
    def _needs_filter(self) -> bool:
        return self.method == "qfilters" and not self.filter_fixed

    @property
    def _calibrates_from_queries(self) -> bool:
        return self._needs_filter and self.config.needs_queries

    @property
    def needs_queries(self) -> bool:
        """Whether the cache still waits for queries (query-based filter not estimated yet)."""
        return self._calibrates_from_queries and self.filter is None

    @property
    def scoring_ready(self) -> bool:
        """Whether new tokens can be scored (the filter exists, or none is needed)."""
        return not self._needs_filter or self.filter is not None

    def _calibrate(self) -> None:
        """Freeze the filter from exactly the first ``calib_tokens`` keys (and, for
        query-based configs, queries); score all live rows.

        Called only before any eviction, when rows ``[0, calib_tokens)`` are the
        first ``calib_tokens`` tokens ever fed.
        """
        cfg = self.config
        c = cfg.qfilters_calib_tokens
        if cfg.qfilters_filter_source == "queries":
            f = reference.estimate_filter_from_queries(self._queries[:, :, :c], self.keys.shape[1])
        else:
            f = reference.estimate_filter_from_keys(self.keys[:, :, :c])
            if cfg.qfilters_sign == "auto":
                f = f * reference.query_orientation(f, self._queries[:, :, :c])[:, None]
        self.filter = f  # (queries are kept until the first eviction: trim may undo this)
        n = self._n
        self.scores[:, :, :n] = self._score(self.keys[:, :, :n], self.positions[:, :, :n])

    def observe_queries(self, queries: mx.array) -> None:
        """Receive this call's post-RoPE queries ``[B, H_q, L, D]`` (from ``observe_queries``).

        Called after ``update_and_fetch`` of the same call (attention runs after
        the cache returns keys). Keeps the first ``calib_tokens`` queries; once
        they are all there, freezes the filter, scores the stored tokens and
        evicts down to the budget, exactly as a key-based cache does at the end
        of the call that crosses ``calib_tokens``.

        Raises:
            ValueError: ``queries`` not a 4-D array, no update before it, or a shape that
                does not fit the cache (the message names both), before anything changes.
        """
        if not self.needs_queries:
            self._queries_pending = False
            return
        if not isinstance(queries, mx.array) or queries.ndim != 4 or self.keys is None:
            raise ValueError("queries must be an mx.array [B, H_q, L, D] observed after an update")
        B, H, D = self._input_layout()[:3]
        if (queries.shape[0] != B or queries.shape[1] % H or queries.shape[3] != D
                or queries.shape[2] > self.offset):
            raise ValueError(f"queries {tuple(queries.shape)} do not fit the cache "
                             f"(B={B}, H_kv={H}, D={D}, offset={self.offset})")
        self._queries_pending = False
        self._note_observed(queries)
        c = self.config.qfilters_calib_tokens
        have = 0 if self._queries is None else self._queries.shape[2]
        need = min(c, self.offset) - have
        if need > 0:
            new = queries[:, :, :need]  # this call's rows start at token `have`
            self._queries = new if self._queries is None else mx.concatenate([self._queries, new], axis=2)
        if self._queries is not None and self._queries.shape[2] >= c:
            self._calibrate()
            if self._n > self._budget_now():
                self._evict()
            mx.async_eval(self.positions, self.scores)
